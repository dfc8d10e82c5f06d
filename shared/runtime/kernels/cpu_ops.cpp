// specserve's CPU operators: matrix products over weights as stored (GGUF Q4_1 / Q8_0 blocks, or
// float32), and the decoder stack of a Llama-family model in one call over a paged KV cache.
//
// Exactness rules, which the Python tests check:
// - A weight is dequantized exactly as gguf-py does it (Q4_1: d * q + m, Q8_0: d * q, in float32 with
//   one rounding per operation; compiled with -ffp-contract=off so that no mul+add is fused), then
//   multiplied in float32. The products equal a float32 matmul over the dequantized weights up to
//   summation order.
// - Batch invariance: the sum behind one output element (one token, one row) is computed by the same
//   operations in the same order whatever else shares the call (other tokens, other rows, threads).
//   Each (row, token) keeps two 16-lane accumulators (elements 0-15 and 16-31 of every 32-wide block),
//   added in block order and reduced in one fixed order. Attention visits a token's visible keys in
//   one order (its committed context, then its own tree ancestors), so a tree node's logits equal
//   those of the same token decoded alone.
// Three variants, each batch invariant by itself (they are not bit-identical to one another):
// - "avx512": AVX-512 intrinsics, where the CPU has AVX-512 F/BW/DQ/VL, FMA and F16C;
// - "avx2": AVX2 + FMA intrinsics, where the CPU has AVX2, FMA and F16C (and not AVX-512). 8-lane
//   vectors: the two accumulators of a (row, token) are 8 lanes wide, each taking two 8-wide chunks of
//   its 16 elements of every block in order, and are reduced in one fixed order;
// - "generic": plain C++ with the same accumulation structure as AVX-512, which the compiler vectorizes
//   for the machine it is built on where the build targets it (-mcpu=native on aarch64: NEON); on x86
//   it is the last-resort fallback (built for baseline x86-64).
// The best one this CPU runs is chosen when the library loads; SPECSERVE_CPU_KERNELS_VARIANT=avx512|avx2|
// generic forces one (one this CPU lacks: the best it has; SPECSERVE_CPU_KERNELS_GENERIC=1 is an alias of
// =generic), and the `set_variant` operator switches within a process (an error for one the CPU lacks).
// Products on int8 activations (section "int8 activations"): Q4_1 / Q8_0 weights times activations
// quantized per token per 32-wide block, exact int32 sums per block; batch invariant by the same rule.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#define SPECSERVE_X86 1
#include <immintrin.h>
#else
#define SPECSERVE_X86 0
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

enum Kind : int64_t { kF32 = 0, kQ8_0 = 1, kQ4_1 = 2, kQ8_0P = 3, kQ4_1P = 4 };
constexpr int64_t QK = 32;  // elements per quantized block
constexpr int64_t PANEL = 16;  // rows of a panel (kQ8_0P, kQ4_1P)

inline bool is_panel(int64_t kind) { return kind == kQ8_0P || kind == kQ4_1P; }

// A weight in the operators' layout (shared/runtime/quant.py packs it at load, exactly):
// - F32: data float32 [rows, cols];
// - Q8_0: data int8 [rows, cols] (32 per block), scales float32 [rows, cols / 32] (d);
// - Q4_1: data uint8 [rows, cols / 2], 16 bytes a block (low nibbles: elements 0-15, high: 16-31,
//   as GGUF stores them), scales float32 [rows, cols / 32, 2] (d, m).
// GGUF's fp16 d and m are widened to float32 once at load (exact), so a block costs 24 bytes (Q4_1)
// or 36 (Q8_0) instead of 20 or 34, for fewer instructions per block.
// The panel kinds hold the same blocks for the int8 products alone (quant.py `panels` packs them), 16 rows
// (a panel) side by side, so that one 512-bit register holds 4 bytes of each of 16 rows:
// - Q4_1P: data per (panel, block) 4 x 64 bytes: chunk k, lane i = bytes 4k..4k+3 of row i's 16 nibble
//   bytes; scales per (panel, block) d of the 16 rows, then m of the 16 rows;
// - Q8_0P: data per (panel, block) 8 x 64 bytes: chunk k, lane i = values 4k..4k+3 of row i, each stored
//   + 128 (as uint8); scales per (panel, block) d of the 16 rows.
// Rows: a multiple of 16.
struct Weight {
  const uint8_t* data;
  const float* scales;
  int64_t kind, rows, cols;
  const float* bias;  // nullptr: none
};

Weight make_weight(const at::Tensor& data, const at::Tensor& scales, int64_t kind, int64_t cols,
                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(data.is_contiguous() && data.device().is_cpu(), "weights must be contiguous CPU tensors");
  TORCH_CHECK(kind >= kF32 && kind <= kQ4_1P, "unknown weight kind ", kind);
  TORCH_CHECK(kind == kF32 ? data.scalar_type() == at::kFloat : data.scalar_type() == at::kByte,
              "weight kind ", kind, " does not match the tensor's dtype");
  TORCH_CHECK(kind == kF32 || cols % QK == 0, "quantized rows must be a multiple of 32 wide");
  Weight w;
  w.data = static_cast<const uint8_t*>(data.data_ptr());
  w.kind = kind;
  w.cols = cols;
  const int64_t row_bytes = kind == kF32 ? cols * 4 : kind == kQ8_0 || kind == kQ8_0P ? cols : cols / 2;
  TORCH_CHECK(cols > 0 && data.numel() * data.element_size() % row_bytes == 0, "weight size is not a whole number of rows");
  w.rows = data.numel() * data.element_size() / row_bytes;
  TORCH_CHECK(!is_panel(kind) || w.rows % PANEL == 0, "a panel weight's rows must be a multiple of ", PANEL);
  w.scales = nullptr;
  if (kind != kF32) {
    const int64_t per_row = kind == kQ8_0 || kind == kQ8_0P ? cols / QK : cols / QK * 2;
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == w.rows * per_row,
                "scales must be float32 with ", per_row, " values per row");
    w.scales = scales.data_ptr<float>();
  }
  w.bias = nullptr;
  if (bias.has_value() && bias->defined() && bias->numel() > 0) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.rows,
                "bias must be float32 with one value per row");
    w.bias = bias->data_ptr<float>();
  }
  return w;
}

// ---- plain C++ variant -------------------------------------------------------------------------

namespace generic {

// Dequantized elements [b*32, b*32+32) of row `r` into out[32] (past the row's end: zeros).
inline void dequant_block(const Weight& w, int64_t r, int64_t b, float* out) {
  const int64_t nb = w.cols / QK;
  if (w.kind == kF32) {
    const float* src = reinterpret_cast<const float*>(w.data) + r * w.cols + b * QK;
    int64_t valid = std::min<int64_t>(QK, w.cols - b * QK);
    for (int64_t i = 0; i < QK; ++i) out[i] = i < valid ? src[i] : 0.0f;
  } else if (w.kind == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.data) + r * w.cols + b * QK;
    float d = w.scales[r * nb + b];
    for (int i = 0; i < QK; ++i) out[i] = d * static_cast<float>(q[i]);
  } else {
    const uint8_t* q = w.data + (r * nb + b) * 16;
    float d = w.scales[(r * nb + b) * 2], m = w.scales[(r * nb + b) * 2 + 1];
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>(q[i] & 0xF) + m;
      out[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
    }
  }
}

// One (row, token) dot product with the lane structure of the AVX-512 variant.
float dot_row(const Weight& w, int64_t r, const float* x) {
  float lo[16] = {0}, hi[16] = {0}, wb[QK], xb[QK];
  int64_t nb = (w.cols + QK - 1) / QK;
  for (int64_t b = 0; b < nb; ++b) {
    dequant_block(w, r, b, wb);
    int64_t valid = std::min<int64_t>(QK, w.cols - b * QK);
    for (int64_t i = 0; i < QK; ++i) xb[i] = i < valid ? x[b * QK + i] : 0.0f;
    for (int i = 0; i < 16; ++i) {
      lo[i] = std::fma(wb[i], xb[i], lo[i]);
      hi[i] = std::fma(wb[i + 16], xb[i + 16], hi[i]);
    }
  }
  float s[16];
  for (int i = 0; i < 16; ++i) s[i] = lo[i] + hi[i];
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) s[i] = s[i] + s[i + width];
  return s[0];
}

void rows(const Weight& w, int64_t r0, int64_t r1, const float* X, int64_t T, int64_t ldx, float* Y, int64_t ldy,
          bool accumulate) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = r0; r < r1; ++r) {
      float s = dot_row(w, r, X + t * ldx);
      if (w.bias) s += w.bias[r];
      float* y = Y + t * ldy + r;
      *y = accumulate ? *y + s : s;
    }
}

}  // namespace generic

#if SPECSERVE_X86

// ---- AVX-512 variant ---------------------------------------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")

namespace avx512 {

inline __m512 load_part(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __mmask16 mask_of(int64_t valid) {
  return valid >= 16 ? static_cast<__mmask16>(0xFFFF)
                     : static_cast<__mmask16>(valid <= 0 ? 0 : ((1u << valid) - 1));
}

// Elements [b*32, b*32+16) and [b*32+16, b*32+32) of row `r`, dequantized. Q4_1 looks the 16 nibble
// values up in a table d * [0..15] + m (vpermps ignores an index's bits above the low 4).
template <int64_t KIND>
inline void dequant_block(const Weight& w, int64_t r, int64_t b, __mmask16 ml, __mmask16 mh, __m512& lo, __m512& hi) {
  const int64_t nb = w.cols / QK;
  if constexpr (KIND == kQ4_1) {
    const float* s = w.scales + (r * nb + b) * 2;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(s[0]), iota), _mm512_set1_ps(s[1]));
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.data + (r * nb + b) * 16)));
    lo = _mm512_permutexvar_ps(q, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  } else if constexpr (KIND == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.data) + r * w.cols + b * QK;
    __m512 d = _mm512_set1_ps(w.scales[r * nb + b]);
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))));
  } else {
    const float* src = reinterpret_cast<const float*>(w.data) + r * w.cols + b * QK;
    lo = load_part(src, ml);
    hi = load_part(src + 16, mh);
  }
}

// R rows x TB tokens: Y[t, r0 + r] (+)= sum_k W[r0 + r, k] * X[t, k] (+ bias).
template <int64_t KIND, int R, int TB>
void tile(const Weight& w, int64_t r0, const float* X, int64_t ldx, float* Y, int64_t ldy, bool accumulate) {
  __m512 alo[R][TB], ahi[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) alo[r][t] = ahi[r][t] = _mm512_setzero_ps();
  const int64_t nb = (w.cols + QK - 1) / QK;
  for (int64_t b = 0; b < nb; ++b) {
    __mmask16 ml = 0xFFFF, mh = 0xFFFF;
    if constexpr (KIND == kF32) {
      ml = mask_of(w.cols - b * QK);
      mh = mask_of(w.cols - b * QK - 16);
    }
    __m512 wl[R], wh[R];
    for (int r = 0; r < R; ++r) dequant_block<KIND>(w, r0 + r, b, ml, mh, wl[r], wh[r]);
    for (int t = 0; t < TB; ++t) {
      const float* x = X + t * ldx + b * QK;
      __m512 xl, xh;
      if constexpr (KIND == kF32) {
        xl = load_part(x, ml);
        xh = load_part(x + 16, mh);
      } else {
        xl = _mm512_loadu_ps(x);
        xh = _mm512_loadu_ps(x + 16);
      }
      for (int r = 0; r < R; ++r) {
        alo[r][t] = _mm512_fmadd_ps(wl[r], xl, alo[r][t]);
        ahi[r][t] = _mm512_fmadd_ps(wh[r], xh, ahi[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) {
      float s = _mm512_reduce_add_ps(_mm512_add_ps(alo[r][t], ahi[r][t]));
      if (w.bias) s += w.bias[r0 + r];
      float* y = Y + t * ldy + r0 + r;
      *y = accumulate ? *y + s : s;
    }
}

template <int64_t KIND, int R>
void tile_tokens(const Weight& w, int64_t r0, const float* X, int64_t tb, int64_t ldx, float* Y, int64_t ldy,
                 bool accumulate) {
  switch (tb) {
    case 1: tile<KIND, R, 1>(w, r0, X, ldx, Y, ldy, accumulate); break;
    case 2: tile<KIND, R, 2>(w, r0, X, ldx, Y, ldy, accumulate); break;
    case 3: tile<KIND, R, 3>(w, r0, X, ldx, Y, ldy, accumulate); break;
    case 4: tile<KIND, R, 4>(w, r0, X, ldx, Y, ldy, accumulate); break;
    case 5: tile<KIND, R, 5>(w, r0, X, ldx, Y, ldy, accumulate); break;
    case 6: tile<KIND, R, 6>(w, r0, X, ldx, Y, ldy, accumulate); break;
    case 7: tile<KIND, R, 7>(w, r0, X, ldx, Y, ldy, accumulate); break;
    default: tile<KIND, R, 8>(w, r0, X, ldx, Y, ldy, accumulate); break;
  }
}

// Tokens in tiles (one dequantization of a block serves a whole tile): Q4_1 two rows at a time, up to
// 4 tokens a tile (each x load then feeds two rows); Q8_0 and float32 one row, up to 8 tokens. (Q4_1
// tiles of 6 tokens on two rows measured within the noise of these.)
template <int64_t KIND>
void rows_of(const Weight& w, int64_t r0, int64_t r1, const float* X, int64_t T, int64_t ldx, float* Y, int64_t ldy,
             bool accumulate) {
  constexpr int64_t kTile = KIND == kQ4_1 ? 4 : 8;
  constexpr int R = KIND == kQ4_1 ? 2 : 1;
  for (int64_t t0 = 0; t0 < T; t0 += kTile) {
    const int64_t tb = std::min<int64_t>(kTile, T - t0);
    const float* x = X + t0 * ldx;
    float* y = Y + t0 * ldy;
    int64_t r = r0;
    for (; r + R <= r1; r += R) tile_tokens<KIND, R>(w, r, x, tb, ldx, y, ldy, accumulate);
    for (; r < r1; ++r) tile_tokens<KIND, 1>(w, r, x, tb, ldx, y, ldy, accumulate);
  }
}

void rows(const Weight& w, int64_t r0, int64_t r1, const float* X, int64_t T, int64_t ldx, float* Y, int64_t ldy,
          bool accumulate) {
  switch (w.kind) {
    case kQ4_1: rows_of<kQ4_1>(w, r0, r1, X, T, ldx, Y, ldy, accumulate); break;
    case kQ8_0: rows_of<kQ8_0>(w, r0, r1, X, T, ldx, Y, ldy, accumulate); break;
    default: rows_of<kF32>(w, r0, r1, X, T, ldx, Y, ldy, accumulate); break;
  }
}

// exp(x) for float32 lanes (Cephes' expf polynomial, within about 1 ulp); inputs below -87.3 give 0.
inline __m512 exp16(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-87.3365447504f);
  __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), _mm512_scalef_ps(p, n));
}

}  // namespace avx512

#pragma GCC pop_options

// ---- AVX2 variant (AVX2 + FMA) ------------------------------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace avx2 {

// The sum of 8 lanes in one fixed order: (0+4, 1+5, 2+6, 3+7), then pairs 2 apart, then the last two.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lanes i < valid set (all 8 where valid >= 8, none where valid <= 0), for maskload / maskstore / and.
inline __m256i mask_of(int64_t valid) {
  const int v = static_cast<int>(std::min<int64_t>(8, std::max<int64_t>(0, valid)));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(v), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Elements [b*32 + c*8, b*32 + c*8 + 8) of row `r`, dequantized (c = 0..3); PARTIAL (float32 only): the
// block runs past the row's end, lanes past it read as 0. Q4_1: the nibbles widened to int32, converted
// (exactly) and d * q + m computed with a multiply and an add (two roundings, as gguf-py does).
template <int64_t KIND, bool PARTIAL>
inline __m256 dequant_chunk(const Weight& w, int64_t r, int64_t b, int c) {
  const int64_t nb = w.cols / QK;
  if constexpr (KIND == kQ4_1) {
    const float* s = w.scales + (r * nb + b) * 2;
    const uint8_t* q = w.data + (r * nb + b) * 16 + (c & 1) * 8;
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    v = c < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(v, 4);
    return _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(s[0]), _mm256_cvtepi32_ps(v)), _mm256_set1_ps(s[1]));
  } else if constexpr (KIND == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.data) + r * w.cols + b * QK + c * 8;
    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    return _mm256_mul_ps(_mm256_set1_ps(w.scales[r * nb + b]), _mm256_cvtepi32_ps(v));
  } else {
    const float* src = reinterpret_cast<const float*>(w.data) + r * w.cols + b * QK + c * 8;
    if constexpr (PARTIAL) return _mm256_maskload_ps(src, mask_of(w.cols - b * QK - c * 8));
    return _mm256_loadu_ps(src);
  }
}

// One block of an R rows x TB tokens tile: chunks 0-1 (elements 0-15) into alo, 2-3 (16-31) into ahi.
template <int64_t KIND, int R, int TB, bool PARTIAL>
inline void tile_block(const Weight& w, int64_t r0, int64_t b, const float* X, int64_t ldx, __m256 (&alo)[R][TB],
                       __m256 (&ahi)[R][TB]) {
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    __m256 wc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wc[r] = dequant_chunk<KIND, PARTIAL>(w, r0 + r, b, c);
#pragma GCC unroll 8
    for (int t = 0; t < TB; ++t) {
      const float* x = X + t * ldx + b * QK + c * 8;
      __m256 xc;
      if constexpr (PARTIAL) xc = _mm256_maskload_ps(x, mask_of(w.cols - b * QK - c * 8));
      else xc = _mm256_loadu_ps(x);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if (c < 2) alo[r][t] = _mm256_fmadd_ps(wc[r], xc, alo[r][t]);
        else ahi[r][t] = _mm256_fmadd_ps(wc[r], xc, ahi[r][t]);
      }
    }
  }
}

// R rows x TB tokens: Y[t, r0 + r] (+)= sum_k W[r0 + r, k] * X[t, k] (+ bias).
template <int64_t KIND, int R, int TB>
void tile(const Weight& w, int64_t r0, const float* X, int64_t ldx, float* Y, int64_t ldy, bool accumulate) {
  __m256 alo[R][TB], ahi[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) alo[r][t] = ahi[r][t] = _mm256_setzero_ps();
  const int64_t full = w.cols / QK;
  for (int64_t b = 0; b < full; ++b) tile_block<KIND, R, TB, false>(w, r0, b, X, ldx, alo, ahi);
  if (full * QK < w.cols) tile_block<KIND, R, TB, true>(w, r0, full, X, ldx, alo, ahi);  // float32 only
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) {
      float s = hsum(_mm256_add_ps(alo[r][t], ahi[r][t]));
      if (w.bias) s += w.bias[r0 + r];
      float* y = Y + t * ldy + r0 + r;
      *y = accumulate ? *y + s : s;
    }
}

// One token: Q4_1 two rows a tile (four independent FMA chains), Q8_0 and float32 one row (more rows a
// tile measured slower); more tokens: one row, up to 4 tokens a tile (one dequantization serves them
// all). The tile shape does not change what is computed for a (row, token).
template <int64_t KIND>
void rows_of(const Weight& w, int64_t r0, int64_t r1, const float* X, int64_t T, int64_t ldx, float* Y, int64_t ldy,
             bool accumulate) {
  if (T == 1) {
    constexpr int R = KIND == kQ4_1 ? 2 : 1;
    int64_t r = r0;
    for (; r + R <= r1; r += R) tile<KIND, R, 1>(w, r, X, ldx, Y, ldy, accumulate);
    for (; r < r1; ++r) tile<KIND, 1, 1>(w, r, X, ldx, Y, ldy, accumulate);
    return;
  }
  for (int64_t t0 = 0; t0 < T; t0 += 4) {
    const int64_t tb = std::min<int64_t>(4, T - t0);
    const float* x = X + t0 * ldx;
    float* y = Y + t0 * ldy;
    for (int64_t r = r0; r < r1; ++r) switch (tb) {
        case 1: tile<KIND, 1, 1>(w, r, x, ldx, y, ldy, accumulate); break;
        case 2: tile<KIND, 1, 2>(w, r, x, ldx, y, ldy, accumulate); break;
        case 3: tile<KIND, 1, 3>(w, r, x, ldx, y, ldy, accumulate); break;
        default: tile<KIND, 1, 4>(w, r, x, ldx, y, ldy, accumulate); break;
      }
  }
}

void rows(const Weight& w, int64_t r0, int64_t r1, const float* X, int64_t T, int64_t ldx, float* Y, int64_t ldy,
          bool accumulate) {
  switch (w.kind) {
    case kQ4_1: rows_of<kQ4_1>(w, r0, r1, X, T, ldx, Y, ldy, accumulate); break;
    case kQ8_0: rows_of<kQ8_0>(w, r0, r1, X, T, ldx, Y, ldy, accumulate); break;
    default: rows_of<kF32>(w, r0, r1, X, T, ldx, Y, ldy, accumulate); break;
  }
}

// exp(x) for float32 lanes: exp16's polynomial, 2^n built in the exponent bits; inputs below -87.3 give 0.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504f);
  __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // n is in [-126, 127] after the clamp: 2^n is a normal float, so the product rounds once, as scalef does.
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

}  // namespace avx2

#pragma GCC pop_options

// ---- vector helpers over float arrays (each variant has them) ----------------------------------

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")
namespace avx512 {

// out[i] = exp(x[i] - shift) for i < n; returns their sum (16 lanes in index order, then reduced).
float exp_shift_sum(const float* x, float shift, float* out, int64_t n) {
  __m512 acc = _mm512_setzero_ps(), s = _mm512_set1_ps(shift);
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = mask_of(n - i);
    __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), s));
    e = _mm512_maskz_mov_ps(m, e);
    _mm512_mask_storeu_ps(out + i, m, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = mask_of(n - i);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// y[i] += a * x[i]
void axpy(float a, const float* x, float* y, int64_t n) {
  __m512 va = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = mask_of(n - i);
    __m512 r = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
    _mm512_mask_storeu_ps(y + i, m, r);
  }
}

// out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u
void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = mask_of(n - i);
    __m512 vg = _mm512_maskz_loadu_ps(m, g + i);
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), vg));
    __m512 s = _mm512_div_ps(vg, _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
  }
}

float sum_squares(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 v = _mm512_maskz_loadu_ps(mask_of(n - i), x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

// out[i] = exp(x[i] - shift) for i < n; returns their sum (8 lanes in index order, then reduced).
float exp_shift_sum(const float* x, float shift, float* out, int64_t n) {
  __m256 acc = _mm256_setzero_ps(), s = _mm256_set1_ps(shift);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
    _mm256_storeu_ps(out + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (i < n) {
    __m256i m = mask_of(n - i);
    __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(x + i, m), s)), _mm256_castsi256_ps(m));
    _mm256_maskstore_ps(out + i, m, e);
    acc = _mm256_add_ps(acc, e);
  }
  return hsum(acc);
}

float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  if (i < n) {
    __m256i m = mask_of(n - i);
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m), acc);
  }
  return hsum(acc);
}

// y[i] += a * x[i]
void axpy(float a, const float* x, float* y, int64_t n) {
  __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  if (i < n) {
    __m256i m = mask_of(n - i);
    _mm256_maskstore_ps(y + i, m, _mm256_fmadd_ps(va, _mm256_maskload_ps(x + i, m), _mm256_maskload_ps(y + i, m)));
  }
}

// out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u
void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 8) {
    __m256i m = mask_of(n - i);
    __m256 vg = _mm256_maskload_ps(g + i, m);
    __m256 s = _mm256_div_ps(vg, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), vg))));
    _mm256_maskstore_ps(out + i, m, _mm256_mul_ps(s, _mm256_maskload_ps(u + i, m)));
  }
}

float sum_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    __m256 v = _mm256_maskload_ps(x + i, mask_of(n - i));
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  return hsum(acc);
}

}  // namespace avx2
#pragma GCC pop_options

#endif  // SPECSERVE_X86

namespace generic {

float exp_shift_sum(const float* x, float shift, float* out, int64_t n) {
  float acc[16] = {0};
  for (int64_t i = 0; i < n; ++i) {
    out[i] = std::exp(x[i] - shift);
    acc[i % 16] += out[i];
  }
  float s = 0;
  for (float a : acc) s += a;
  return s;
}

float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {0};
  for (int64_t i = 0; i < n; ++i) acc[i % 16] = std::fma(a[i], b[i], acc[i % 16]);
  float s = 0;
  for (float v : acc) s += v;
  return s;
}

void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

float sum_squares(const float* x, int64_t n) {
  float acc[16] = {0};
  for (int64_t i = 0; i < n; ++i) acc[i % 16] = std::fma(x[i], x[i], acc[i % 16]);
  float s = 0;
  for (float v : acc) s += v;
  return s;
}

}  // namespace generic

// ---- the variant in use ------------------------------------------------------------------------

enum Variant : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kVariants };
const char* const kVariantNames[kVariants] = {"generic", "avx2", "avx512"};

// Whether this CPU runs variant `v`.
bool cpu_runs(int v) {
#if SPECSERVE_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (v == kAvx2) return avx2;
  if (v == kAvx512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#endif
  return v == kGeneric;
}

int best_variant() { return cpu_runs(kAvx512) ? kAvx512 : cpu_runs(kAvx2) ? kAvx2 : kGeneric; }

// The variant at load: SPECSERVE_CPU_KERNELS_VARIANT where this CPU runs it (another value: the best),
// else generic where SPECSERVE_CPU_KERNELS_GENERIC is set (and not "0"), else the best.
int initial_variant() {
  const char* name = std::getenv("SPECSERVE_CPU_KERNELS_VARIANT");
  if (name != nullptr && *name != '\0') {
    for (int v = 0; v < kVariants; ++v)
      if (std::strcmp(name, kVariantNames[v]) == 0 && cpu_runs(v)) return v;
    return best_variant();  // the Python loader logs the fallback
  }
  const char* generic = std::getenv("SPECSERVE_CPU_KERNELS_GENERIC");
  if (generic != nullptr && *generic != '\0' && std::strcmp(generic, "0") != 0) return kGeneric;
  return best_variant();
}

std::atomic<int> g_variant{initial_variant()};

inline int current_variant() { return g_variant.load(std::memory_order_relaxed); }

#if SPECSERVE_X86
#define DISPATCH(fn, ...)                                                         \
  (current_variant() == kAvx512 ? avx512::fn(__VA_ARGS__)                         \
   : current_variant() == kAvx2 ? avx2::fn(__VA_ARGS__) : generic::fn(__VA_ARGS__))
#else
#define DISPATCH(fn, ...) generic::fn(__VA_ARGS__)
#endif

// ---- phase timers (the `profile` operator) ------------------------------------------------------

// Seconds spent in each phase of decoder_layers and the head, summed while profiling is on.
enum Phase { kNorm, kQkv, kRope, kKvWrite, kAttention, kOut, kGateUp, kSiluMul, kDown, kEmbed, kHead, kPhases };
const char* const kPhaseNames[kPhases] = {"rms_norm", "qkv_proj", "rope", "kv_write", "attention", "o_proj",
                                          "gate_up_proj", "silu_mul", "down_proj", "embed", "head"};
std::atomic<bool> g_profiling{false};
double g_phase_s[kPhases] = {0};

struct PhaseTimer {
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  void lap(Phase phase) {
    if (!g_profiling.load(std::memory_order_relaxed)) return;
    auto now = std::chrono::steady_clock::now();
    g_phase_s[phase] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

// ==== the worker pool ===========================================================================
//
// The operators' parallel loops (the matrix products and attention) run their chunks here. A call
// publishes a job (a function over chunk indices and a chunk count); the pool's workers and the calling
// thread take chunk indices from one atomic counter until none is left, and the caller returns once
// every chunk taken is done. Nothing waits for a thread to arrive: a worker that is not running (its
// core busy with another process) takes nothing and is not waited for, and the caller computes what
// nobody took. Which thread computes a chunk changes no value (a chunk's outputs are computed whole by
// the thread that takes it).
// - Threads: torch's intra-op thread count (torch.set_num_threads) at each call, the caller included;
//   workers (std::thread) are started once, when a call first asks for them, and kept.
// - Idle workers (and a caller waiting for chunks taken by workers) sleep on a condition variable at
//   once, leaving the core to other processes; SPECSERVE_CPU_POOL_SPIN_US=n spins n microseconds first
//   (measured on 2 shared cores, docs/lab/cpu_pass.md: no faster than 0, and 200 slower).
// - A call made while another thread's call runs (or from inside a chunk) runs its chunks serially.
// - `set_parallel("openmp")` runs the same loops with at::parallel_for instead (measurements); "pool" is
//   the default.

namespace pool {

using ChunkFn = void (*)(void* ctx, int64_t chunk);

inline void cpu_relax() {
#if SPECSERVE_X86
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

int64_t spin_us() {
  static const int64_t us = [] {
    const char* env = std::getenv("SPECSERVE_CPU_POOL_SPIN_US");
    return env != nullptr && *env != '\0' ? std::max<int64_t>(0, std::atoll(env)) : int64_t{0};
  }();
  return us;
}

class Pool {
 public:
  // Runs fn(ctx, i) for every i in [0, count) on up to `threads` threads (this one included).
  void run(ChunkFn fn, void* ctx, int64_t count, int threads) {
    std::unique_lock<std::mutex> caller(call_mu_, std::try_to_lock);
    if (threads <= 1 || count <= 1 || in_chunk_ || !caller.owns_lock()) {
      for (int64_t i = 0; i < count; ++i) fn(ctx, i);
      return;
    }
    start_workers(threads - 1);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gen = ++gen_;
      job_ = Job{fn, ctx, count, threads - 1, gen};
      done_.store(0, std::memory_order_relaxed);
      next_.store(gen << 32, std::memory_order_release);
      gen_seen_.store(gen, std::memory_order_release);
    }
    wake_.notify_all();
    const int64_t mine = work(job_);
    if (done_.fetch_add(mine, std::memory_order_acq_rel) + mine == count) return;
    // The rest were taken by workers that are running them: wait for those chunks (only those).
    const auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us());
    while (done_.load(std::memory_order_acquire) < count) {
      if (std::chrono::steady_clock::now() < spin_end) {
        cpu_relax();
        continue;
      }
      std::unique_lock<std::mutex> lock(mu_);
      finished_.wait(lock, [&] { return done_.load(std::memory_order_acquire) >= count; });
    }
  }

 private:
  struct Job {
    ChunkFn fn = nullptr;
    void* ctx = nullptr;
    int64_t count = 0;
    int helpers = 0;  // workers 0..helpers-1 join this job
    uint64_t gen = 0;
  };

  // Takes chunks of job `j` (its generation in the counter's high bits) until none is left; returns how many.
  int64_t work(const Job& j) {
    int64_t taken = 0;
    uint64_t v = next_.load(std::memory_order_acquire);
    for (;;) {
      if ((v >> 32) != (j.gen & 0xffffffffu) || static_cast<int64_t>(v & 0xffffffffu) >= j.count) break;
      if (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      in_chunk_ = true;
      j.fn(j.ctx, static_cast<int64_t>(v & 0xffffffffu));
      in_chunk_ = false;
      ++taken;
      v = next_.load(std::memory_order_acquire);
    }
    return taken;
  }

  void start_workers(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    while (static_cast<int>(workers_.size()) < n) {
      const int id = static_cast<int>(workers_.size());
      workers_.emplace_back([this, id] { loop(id); });
      workers_.back().detach();  // they live as long as the process
    }
  }

  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      // Spin a little for the next job, then sleep until one is published.
      const auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us());
      while (gen_seen_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < spin_end)
        cpu_relax();
      Job j;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return gen_ != seen; });
        seen = gen_;
        j = job_;
      }
      if (id >= j.helpers) continue;
      const int64_t taken = work(j);
      if (taken == 0) continue;
      // Whoever finishes the job's last chunks tells the caller (it may be asleep).
      if (done_.fetch_add(taken, std::memory_order_acq_rel) + taken == j.count) {
        std::lock_guard<std::mutex> lock(mu_);
        finished_.notify_all();
      }
    }
  }

  std::mutex call_mu_;  // one call at a time
  std::mutex mu_;  // guards job_, gen_, workers_
  std::condition_variable wake_, finished_;
  std::vector<std::thread> workers_;
  Job job_;
  uint64_t gen_ = 0;
  std::atomic<uint64_t> gen_seen_{0};  // gen_, readable without the lock (the workers' spin)
  std::atomic<uint64_t> next_{0};  // (generation << 32) | next chunk index
  std::atomic<int64_t> done_{0};  // chunks of this job finished (the caller's counted once it has no more)
  static thread_local bool in_chunk_;
};

thread_local bool Pool::in_chunk_ = false;

Pool& instance() {
  static Pool* p = new Pool();  // never destroyed: detached workers use it until the process ends
  return *p;
}

std::atomic<bool> g_openmp{false};

// fn(chunk) for chunk in [0, count), over torch's intra-op threads: by the pool, or by at::parallel_for
// where set_parallel("openmp") chose it.
template <typename F>
void parallel_chunks(int64_t count, const F& fn) {
  if (count <= 0) return;
  if (g_openmp.load(std::memory_order_relaxed)) {
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) fn(i);
    });
    return;
  }
  instance().run([](void* ctx, int64_t i) { (*static_cast<const F*>(ctx))(i); },
                 const_cast<void*>(static_cast<const void*>(&fn)), count, at::get_num_threads());
}

}  // namespace pool

// ==== end of the worker pool ====================================================================

// ---- building blocks ---------------------------------------------------------------------------

// Y[T, rows] (+)= X[T, cols] @ W^T, rows in chunks of 32 over the worker pool (a chunk is one thread's).
void matmul(const Weight& w, const float* X, int64_t T, int64_t ldx, float* Y, int64_t ldy, bool accumulate) {
  const int64_t chunk = 32;
  const int64_t tasks = (w.rows + chunk - 1) / chunk;
  pool::parallel_chunks(tasks, [&](int64_t c) {
    const int64_t r0 = c * chunk, r1 = std::min(w.rows, r0 + chunk);
    DISPATCH(rows, w, r0, r1, X, T, ldx, Y, ldy, accumulate);
  });
}

// out[t] = weight * (x[t] * 1 / sqrt(mean(x[t]^2) + eps)), as Hugging Face's LlamaRMSNorm in float32.
void rms_norm_rows(const float* x, int64_t T, int64_t H, const float* weight, float eps, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * H;
    float* o = out + t * H;
    float var = DISPATCH(sum_squares, xr, H) / static_cast<float>(H);
    float inv = 1.0f / std::sqrt(var + eps);
    for (int64_t i = 0; i < H; ++i) o[i] = weight[i] * (xr[i] * inv);
  }
}

// Rotate-half RoPE in place on `heads` heads of width D at x[t]; cos and signed sin are [T, D].
void rope_rows(float* x, int64_t T, int64_t ld, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  std::vector<float> tmp(D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + t * ld + h * D;
      const float* c = cos + t * D;
      const float* s = sin + t * D;
      for (int64_t i = 0; i < D; ++i) {
        float rotated = i < half ? v[i + half] : v[i - half];
        tmp[i] = v[i] * c[i] + rotated * s[i];
      }
      std::memcpy(v, tmp.data(), D * sizeof(float));
    }
}

// Where a pass's tokens read their keys: a committed prefix through the block table, then extras.
struct KeyLayout {
  const int32_t* tables;  // [B, max_blocks]
  int64_t max_blocks, block_size;
  const int32_t* seq;  // [T] row of tables per token
  const int32_t* prefix;  // [T] leading logical slots each token sees
  const int32_t* extra_off;  // [T + 1] CSR offsets into extra_slots
  const int32_t* extra_slots;  // physical slots of tree ancestors (and the node itself), root first
};

#if SPECSERVE_X86

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")
namespace avx512 {

// Softmax attention of G query heads (q: their rows, D = 16 * ND wide) over the n keys at `slots` of
// one kv head (k, v: that head's column in the cache; `row` floats between slots). Each key and value
// row is loaded once for the G heads; scores: G * n floats of scratch.
template <int ND, int G>
void attend_group(const float* q, float* out, const int64_t* slots, int64_t n, const float* k, const float* v,
                  int64_t row, float scale, float* scores) {
  __m512 qv[G][ND];
  for (int i = 0; i < G; ++i)
    for (int d = 0; d < ND; ++d) qv[i][d] = _mm512_loadu_ps(q + i * ND * 16 + d * 16);
  float mx[G];
  for (int i = 0; i < G; ++i) mx[i] = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = k + slots[j] * row;
    __m512 kv[ND];
    for (int d = 0; d < ND; ++d) kv[d] = _mm512_loadu_ps(kj + d * 16);
    for (int i = 0; i < G; ++i) {
      __m512 acc = _mm512_mul_ps(qv[i][0], kv[0]);
      for (int d = 1; d < ND; ++d) acc = _mm512_fmadd_ps(qv[i][d], kv[d], acc);
      float sc = _mm512_reduce_add_ps(acc) * scale;
      scores[i * n + j] = sc;
      mx[i] = std::max(mx[i], sc);
    }
  }
  __m512 inv[G];
  for (int i = 0; i < G; ++i) inv[i] = _mm512_set1_ps(1.0f / exp_shift_sum(scores + i * n, mx[i], scores + i * n, n));
  __m512 o[G][ND];
  for (int i = 0; i < G; ++i)
    for (int d = 0; d < ND; ++d) o[i][d] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + slots[j] * row;
    __m512 vv[ND];
    for (int d = 0; d < ND; ++d) vv[d] = _mm512_loadu_ps(vj + d * 16);
    for (int i = 0; i < G; ++i) {
      __m512 p = _mm512_set1_ps(scores[i * n + j]);
      for (int d = 0; d < ND; ++d) o[i][d] = _mm512_fmadd_ps(p, vv[d], o[i][d]);
    }
  }
  for (int i = 0; i < G; ++i)
    for (int d = 0; d < ND; ++d) _mm512_storeu_ps(out + i * ND * 16 + d * 16, _mm512_mul_ps(o[i][d], inv[i]));
}

// The heads in chunks of up to 4 (G x ND accumulators stay in registers for ND <= 4; 2 for ND = 8).
template <int ND>
void attend_heads(const float* q, float* out, const int64_t* slots, int64_t n, const float* k, const float* v,
                  int64_t row, int64_t group, float scale, float* scores) {
  constexpr int kMax = ND <= 4 ? 4 : 2;
  for (int64_t i = 0; i < group;) {
    const int64_t g = std::min<int64_t>(kMax, group - i);
    const float* qi = q + i * ND * 16;
    float* oi = out + i * ND * 16;
    switch (g) {
      case 1: attend_group<ND, 1>(qi, oi, slots, n, k, v, row, scale, scores); break;
      case 2: attend_group<ND, 2>(qi, oi, slots, n, k, v, row, scale, scores); break;
      case 3: attend_group<ND, (kMax >= 3 ? 3 : 1)>(qi, oi, slots, n, k, v, row, scale, scores); break;
      default: attend_group<ND, kMax>(qi, oi, slots, n, k, v, row, scale, scores); break;
    }
    i += g;
  }
}

bool attend(const float* q, float* out, const int64_t* slots, int64_t n, const float* k, const float* v, int64_t row,
            int64_t D, int64_t group, float scale, float* scores) {
  switch (D) {
    case 64: attend_heads<4>(q, out, slots, n, k, v, row, group, scale, scores); return true;
    case 128: attend_heads<8>(q, out, slots, n, k, v, row, group, scale, scores); return true;
    case 32: attend_heads<2>(q, out, slots, n, k, v, row, group, scale, scores); return true;
    case 96: attend_heads<6>(q, out, slots, n, k, v, row, group, scale, scores); return true;
    default: return false;
  }
}

}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

// Softmax attention of G query heads (D = 8 * ND wide) over the n keys at `slots` of one kv head, as
// avx512::attend_group with 8-lane vectors: a score is one 8-lane accumulator over the head's chunks,
// reduced by hsum.
template <int ND, int G>
void attend_group(const float* q, float* out, const int64_t* slots, int64_t n, const float* k, const float* v,
                  int64_t row, float scale, float* scores) {
  __m256 qv[G][ND];
  for (int i = 0; i < G; ++i)
    for (int d = 0; d < ND; ++d) qv[i][d] = _mm256_loadu_ps(q + i * ND * 8 + d * 8);
  float mx[G];
  for (int i = 0; i < G; ++i) mx[i] = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = k + slots[j] * row;
    for (int i = 0; i < G; ++i) {
      __m256 acc = _mm256_mul_ps(qv[i][0], _mm256_loadu_ps(kj));
      for (int d = 1; d < ND; ++d) acc = _mm256_fmadd_ps(qv[i][d], _mm256_loadu_ps(kj + d * 8), acc);
      float sc = hsum(acc) * scale;
      scores[i * n + j] = sc;
      mx[i] = std::max(mx[i], sc);
    }
  }
  __m256 inv[G];
  for (int i = 0; i < G; ++i) inv[i] = _mm256_set1_ps(1.0f / exp_shift_sum(scores + i * n, mx[i], scores + i * n, n));
  __m256 o[G][ND];
  for (int i = 0; i < G; ++i)
    for (int d = 0; d < ND; ++d) o[i][d] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + slots[j] * row;
    for (int i = 0; i < G; ++i) {
      __m256 p = _mm256_set1_ps(scores[i * n + j]);
      for (int d = 0; d < ND; ++d) o[i][d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + d * 8), o[i][d]);
    }
  }
  for (int i = 0; i < G; ++i)
    for (int d = 0; d < ND; ++d) _mm256_storeu_ps(out + i * ND * 8 + d * 8, _mm256_mul_ps(o[i][d], inv[i]));
}

// The heads in chunks of up to 2 where a head is 4 vectors or fewer wide, else one at a time (the q and
// output accumulators of a chunk stay in the 16 registers).
template <int ND>
void attend_heads(const float* q, float* out, const int64_t* slots, int64_t n, const float* k, const float* v,
                  int64_t row, int64_t group, float scale, float* scores) {
  constexpr int kMax = ND <= 4 ? 2 : 1;
  for (int64_t i = 0; i < group;) {
    const int64_t g = std::min<int64_t>(kMax, group - i);
    if (g == 2) attend_group<ND, (kMax >= 2 ? 2 : 1)>(q + i * ND * 8, out + i * ND * 8, slots, n, k, v, row, scale, scores);
    else attend_group<ND, 1>(q + i * ND * 8, out + i * ND * 8, slots, n, k, v, row, scale, scores);
    i += g;
  }
}

bool attend(const float* q, float* out, const int64_t* slots, int64_t n, const float* k, const float* v, int64_t row,
            int64_t D, int64_t group, float scale, float* scores) {
  switch (D) {
    case 64: attend_heads<8>(q, out, slots, n, k, v, row, group, scale, scores); return true;
    case 128: attend_heads<16>(q, out, slots, n, k, v, row, group, scale, scores); return true;
    case 32: attend_heads<4>(q, out, slots, n, k, v, row, group, scale, scores); return true;
    case 96: attend_heads<12>(q, out, slots, n, k, v, row, group, scale, scores); return true;
    default: return false;
  }
}

}  // namespace avx2
#pragma GCC pop_options

#endif  // SPECSERVE_X86

namespace generic {

bool attend(const float* q, float* out, const int64_t* slots, int64_t n, const float* k, const float* v, int64_t row,
            int64_t D, int64_t group, float scale, float* scores) {
  for (int64_t i = 0; i < group; ++i) {
    float* s = scores + i * n;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = dot(q + i * D, k + slots[j] * row, D) * scale;
      mx = std::max(mx, s[j]);
    }
    float inv = 1.0f / exp_shift_sum(s, mx, s, n);
    float* o = out + i * D;
    std::fill(o, o + D, 0.0f);
    for (int64_t j = 0; j < n; ++j) axpy(s[j], v + slots[j] * row, o, D);
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
  return true;
}

}  // namespace generic

// Attention of token t's query heads of kv head g; q and out are the token's [H*D] rows; kcache and
// vcache are one layer's head-major K and V ([kv_heads, slots, D]). The keys: the token's committed
// prefix (through its block table), then its extra slots (tree path), in order.
void attend(const float* q, float* out, int64_t t, int64_t g, const KeyLayout& kl, const float* kcache,
            const float* vcache, int64_t slots_total, int64_t D, int64_t group, float scale,
            std::vector<float>& scores, std::vector<int64_t>& slots) {
  const int64_t prefix = kl.prefix[t];
  const int64_t e0 = kl.extra_off[t], e1 = kl.extra_off[t + 1];
  const int64_t n = prefix + (e1 - e0);
  slots.resize(n);
  const int32_t* table = kl.tables + static_cast<int64_t>(kl.seq[t]) * kl.max_blocks;
  for (int64_t j = 0, b = 0; j < prefix; ++b) {  // block by block: no division per key
    const int64_t first = static_cast<int64_t>(table[b]) * kl.block_size;
    for (int64_t i = 0; i < kl.block_size && j < prefix; ++i, ++j) slots[j] = first + i;
  }
  for (int64_t e = e0; e < e1; ++e) slots[prefix + e - e0] = kl.extra_slots[e];
  scores.resize(group * n);
  const float* qg = q + g * group * D;
  float* og = out + g * group * D;
  const float* k = kcache + g * slots_total * D;
  const float* v = vcache + g * slots_total * D;
  bool done = false;
#if SPECSERVE_X86
  const int variant = current_variant();
  if (variant == kAvx512) done = avx512::attend(qg, og, slots.data(), n, k, v, D, D, group, scale, scores.data());
  else if (variant == kAvx2) done = avx2::attend(qg, og, slots.data(), n, k, v, D, D, group, scale, scores.data());
#endif
  if (!done) generic::attend(qg, og, slots.data(), n, k, v, D, D, group, scale, scores.data());
}

// ==== int8 activations ==========================================================================
//
// In int8 mode a product with Q4_1 / Q8_0 blocks quantizes each token's activations per 32-wide block
// as llama.cpp's Q8_1 does: d = max|x| / 127, q = x * (1 / d) rounded half to even, s = d * sum(q);
// a token's values depend on that token alone. Per block it then takes an exact int32 dot product of
// the stored integers with q:  Q4_1: d_w * d_x * sum(nibble * q) + m_w * s_x;  Q8_0: d_w * d_x * sum(w * q).
// Float32 weights keep the float32 path.
//
// The float32 operations behind one (row, token) are fixed, whatever shares the call (batch invariance):
// blocks go in groups of 4 (padded with zero blocks). Q4_1: a group's int32 sums sit in 16 lanes, lane
// 4j + k holding bytes 4k..4k+3 of block j's low and of its high nibbles; p = (d_w, m_w) * (d_x, s_x)
// pairwise (8 floats); lane L gets acc[L] = fma(float(sum[L]), p[2 * (L / 4)], acc[L]) and an 8-lane
// mac += p. Q8_0: two sets of 16 lanes (lane L: bytes 4L..4L+3 of blocks 0-1, then of blocks 2-3);
// p = d_w * d_x (4 floats); acc[L] = fma(float(sumA[L]), p[L / 8], acc[L]), then with sumB and p[2 + L / 8].
// At the end the 16 lanes are reduced as halves (i + 8, i + 4, i + 2, i + 1), and Q4_1 adds
// (mac[1] + mac[3]) + (mac[5] + mac[7]). The AVX-512 VNNI, AVX2 and plain C++ variants do exactly these
// float32 operations on the same exact integers, so they agree bit for bit.
// The panel kinds (Q4_1P, Q8_0P: a lane per row) take another fixed order, per block in turn:
// acc = fma(float(sum), d_w * d_x, acc), and for Q4_1P mac = fma(m_w, s_x, mac); the result acc + mac. Their
// AVX-512 VNNI, AVX2 and plain C++ code agree bit for bit; a panel weight's products differ from the same
// blocks' in the row layout by float32 rounding only.

enum Activations : int64_t { kActF32 = 0, kActInt8 = 1 };

namespace q8 {

constexpr int64_t kGroup = 4;  // blocks a group

// One product's activations, quantized in the layout its weight kind reads (per token, per group):
// - q: 128 int8. Q4_1: bytes 16j + e = q of element e of block j, 64 + 16j + e = element 16 + e;
//   Q8_0: the group's elements in order.
// - s: Q4_1: (d, s) of each block (8 floats); Q8_0: d of each block (4 floats).
// - c (Q8_0): per 4-byte lane, -128 * the lane's sum of q (AVX-512's unsigned x signed product reads
//   w + 128; this takes the 128 * sum back off).
// - panel kinds (`panel`): q in order, 32 per block; s: (d, d * sum(q)) of each block; c: -128 * sum(q)
//   of each block (Q8_0P).
struct Acts {
  int64_t groups = 0, s_width = 0, blocks = 0;
  bool panel = false;
  std::vector<int8_t> q;
  std::vector<float> s;
  std::vector<int32_t> c;
  const int8_t* qt(int64_t t) const { return q.data() + t * groups * 128; }
  const float* st(int64_t t) const { return s.data() + t * groups * s_width; }
  const int32_t* ct(int64_t t) const { return c.data() + t * groups * 32; }
  const int8_t* pq(int64_t t) const { return q.data() + t * blocks * QK; }
  const float* ps(int64_t t) const { return s.data() + t * blocks * 2; }
  const int32_t* pc(int64_t t) const { return c.data() + t * blocks; }
};

void quantize(const float* X, int64_t T, int64_t ldx, int64_t cols, int64_t kind, Acts& a) {
  const int64_t nb = cols / QK;
  a.blocks = nb;
  a.panel = is_panel(kind);
  a.groups = (nb + kGroup - 1) / kGroup;
  a.s_width = kind == kQ4_1 ? 8 : 4;
  if (a.panel) {
    a.q.assign(T * nb * QK, 0);
    a.s.assign(T * nb * 2, 0.0f);
    if (kind == kQ8_0P) a.c.assign(T * nb, 0);
  } else {
    a.q.assign(T * a.groups * 128, 0);
    a.s.assign(T * a.groups * a.s_width, 0.0f);
    if (kind == kQ8_0) a.c.assign(T * a.groups * 32, 0);
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      const float* x = X + t * ldx + b * QK;
      float amax = 0.0f;
      for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t q[QK];
      int32_t sum = 0;
      for (int64_t i = 0; i < QK; ++i) {
        float v = std::nearbyint(x[i] * id);  // half to even (the default rounding mode)
        q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
        sum += q[i];
      }
      if (a.panel) {
        std::memcpy(a.q.data() + (t * nb + b) * QK, q, QK);
        a.s[(t * nb + b) * 2] = d;
        a.s[(t * nb + b) * 2 + 1] = d * static_cast<float>(sum);
        if (kind == kQ8_0P) a.c[t * nb + b] = -128 * sum;
        continue;
      }
      const int64_t g = b / kGroup, j = b % kGroup;
      int8_t* dst = a.q.data() + (t * a.groups + g) * 128;
      float* s = a.s.data() + (t * a.groups + g) * a.s_width;
      if (kind == kQ4_1) {
        std::memcpy(dst + 16 * j, q, 16);
        std::memcpy(dst + 64 + 16 * j, q + 16, 16);
        s[2 * j] = d;
        s[2 * j + 1] = d * static_cast<float>(sum);
      } else {
        std::memcpy(dst + 32 * j, q, 32);
        s[j] = d;
        int32_t* c = a.c.data() + (t * a.groups + g) * 32 + 8 * j;
        for (int i = 0; i < 8; ++i) c[i] = -128 * (q[4 * i] + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3]);
      }
    }
}

// The lanes' reduction and Q4_1's min term, in the fixed order above.
inline float finish(const float* acc, const float* mac, bool q4_1) {
  float s[16];
  std::memcpy(s, acc, sizeof(s));
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) s[i] = s[i] + s[i + width];
  return q4_1 ? s[0] + ((mac[1] + mac[3]) + (mac[5] + mac[7])) : s[0];
}

// Blocks of group g present in a row of nb blocks.
inline int64_t valid_blocks(int64_t nb, int64_t g) { return std::min<int64_t>(kGroup, nb - g * kGroup); }

// Plain C++: one (row, token) at a time.
float dot_row(const Weight& w, int64_t r, const Acts& a, int64_t t) {
  const int64_t nb = w.cols / QK;
  const int8_t* xq = a.qt(t);
  const float* xs = a.st(t);
  float acc[16] = {0}, mac[8] = {0};
  for (int64_t g = 0; g < a.groups; ++g, xq += 128, xs += a.s_width) {
    const int64_t nbv = valid_blocks(nb, g);
    if (w.kind == kQ4_1) {
      int32_t lane[16] = {0};
      for (int64_t j = 0; j < nbv; ++j) {
        const uint8_t* wq = w.data + (r * nb + g * kGroup + j) * 16;
        for (int e = 0; e < 16; ++e)
          lane[4 * j + e / 4] += (wq[e] & 0xF) * xq[16 * j + e] + (wq[e] >> 4) * xq[64 + 16 * j + e];
      }
      float p[8];
      const float* ws = w.scales + (r * nb + g * kGroup) * 2;
      for (int i = 0; i < 8; ++i) {
        p[i] = (i < 2 * nbv ? ws[i] : 0.0f) * xs[i];
        mac[i] = mac[i] + p[i];
      }
      for (int L = 0; L < 16; ++L) acc[L] = std::fma(static_cast<float>(lane[L]), p[2 * (L / 4)], acc[L]);
    } else {
      int32_t lane[32] = {0};
      for (int64_t j = 0; j < nbv; ++j) {
        const int8_t* wq = reinterpret_cast<const int8_t*>(w.data) + r * w.cols + (g * kGroup + j) * QK;
        for (int e = 0; e < 32; ++e) lane[8 * j + e / 4] += wq[e] * xq[32 * j + e];
      }
      float p[4];
      const float* ws = w.scales + r * nb + g * kGroup;
      for (int i = 0; i < 4; ++i) p[i] = (i < nbv ? ws[i] : 0.0f) * xs[i];
      for (int L = 0; L < 16; ++L) acc[L] = std::fma(static_cast<float>(lane[L]), p[L / 8], acc[L]);
      for (int L = 0; L < 16; ++L) acc[L] = std::fma(static_cast<float>(lane[16 + L]), p[2 + L / 8], acc[L]);
    }
  }
  return finish(acc, mac, w.kind == kQ4_1);
}

inline void store(const Weight& w, int64_t r, float s, float* Y, int64_t t, int64_t ldy, bool accumulate) {
  if (w.bias) s += w.bias[r];
  float* y = Y + t * ldy + r;
  *y = accumulate ? *y + s : s;
}

void rows(const Weight& w, int64_t r0, int64_t r1, const Acts& a, int64_t T, float* Y, int64_t ldy, bool accumulate) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = r0; r < r1; ++r) store(w, r, dot_row(w, r, a, t), Y, t, ldy, accumulate);
}

// Panel kinds, plain C++, one (row, token) at a time, in the order every panel code follows: per block in
// turn, its exact int32 sum i, acc = fma(float(i), d_w * d_x, acc) and (Q4_1P) mac = fma(m_w, d_x * sum(q),
// mac); the result acc + mac.
float panel_dot(const Weight& w, int64_t r, const Acts& a, int64_t t) {
  const int64_t nb = w.cols / QK, p = r / PANEL, i = r % PANEL;
  const bool q4 = w.kind == kQ4_1P;
  const int64_t chunks = q4 ? 4 : 8;
  const uint8_t* base = w.data + p * nb * chunks * 64 + i * 4;
  const float* sc = w.scales + p * nb * (q4 ? 2 : 1) * PANEL + i;
  const int8_t* xq = a.pq(t);
  const float* xs = a.ps(t);
  float acc = 0.0f, mac = 0.0f;
  for (int64_t b = 0; b < nb; ++b, xq += QK, xs += 2) {
    int32_t sum = 0;
    const uint8_t* blk = base + b * chunks * 64;
    for (int64_t k = 0; k < chunks; ++k)
      for (int j = 0; j < 4; ++j) {
        const int32_t v = blk[k * 64 + j];
        if (q4)
          sum += (v & 0xF) * xq[4 * k + j] + (v >> 4) * xq[16 + 4 * k + j];
        else
          sum += (v - 128) * xq[4 * k + j];
      }
    if (q4) {
      const float* s = sc + b * 2 * PANEL;
      acc = std::fma(static_cast<float>(sum), s[0] * xs[0], acc);
      mac = std::fma(s[PANEL], xs[1], mac);
    } else {
      acc = std::fma(static_cast<float>(sum), sc[b * PANEL] * xs[0], acc);
    }
  }
  return q4 ? acc + mac : acc;
}

void panel_rows(const Weight& w, int64_t r0, int64_t r1, const Acts& a, int64_t T, float* Y, int64_t ldy,
                bool accumulate) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = r0; r < r1; ++r) store(w, r, panel_dot(w, r, a, t), Y, t, ldy, accumulate);
}

}  // namespace q8

#if SPECSERVE_X86

// ---- int8 x blocks, AVX-512 with VNNI (vpdpbusd) -----------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")
namespace avx512_q8 {

using q8::Acts;

inline float finish(__m512 acc, __m256 mac, bool q4_1) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  float s = _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
  if (!q4_1) return s;
  alignas(32) float m[8];
  _mm256_store_ps(m, mac);
  return s + ((m[1] + m[3]) + (m[5] + m[7]));
}

// R rows x TB tokens (tokens t0.., rows r0..) of a Q4_1 weight.
template <int R, int TB>
void tile_q4_1(const Weight& w, int64_t r0, const Acts& a, int64_t t0, float* Y, int64_t ldy, bool accumulate) {
  const int64_t nb = w.cols / QK;
  __m512 acc[R][TB];
  __m256 mac[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) {
      acc[r][t] = _mm512_setzero_ps();
      mac[r][t] = _mm256_setzero_ps();
    }
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t nbv = q8::valid_blocks(nb, g);
    const __mmask64 mq = nbv == 4 ? ~0ULL : (1ULL << (16 * nbv)) - 1;
    const __mmask8 ms = static_cast<__mmask8>((1u << (2 * nbv)) - 1);
    __m512i lo[R], hi[R];
    __m256 ws[R];
    for (int r = 0; r < R; ++r) {
      const int64_t blk = (r0 + r) * nb + g * q8::kGroup;
      __m512i z = _mm512_maskz_loadu_epi8(mq, w.data + blk * 16);
      lo[r] = _mm512_and_si512(z, low);
      hi[r] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
      ws[r] = _mm256_maskz_loadu_ps(ms, w.scales + blk * 2);
    }
    for (int t = 0; t < TB; ++t) {
      const int8_t* xq = a.qt(t0 + t) + g * 128;
      const __m512i xl = _mm512_loadu_si512(xq), xh = _mm512_loadu_si512(xq + 64);
      const __m256 xs = _mm256_loadu_ps(a.st(t0 + t) + g * 8);
      for (int r = 0; r < R; ++r) {
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], xl);
        s = _mm512_dpbusd_epi32(s, hi[r], xh);
        const __m256 p = _mm256_mul_ps(ws[r], xs);
        mac[r][t] = _mm256_add_ps(mac[r][t], p);
        const __m512 dd = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(p));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dd, acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) q8::store(w, r0 + r, finish(acc[r][t], mac[r][t], true), Y, t0 + t, ldy, accumulate);
}

// R rows x TB tokens of a Q8_0 weight: (w + 128) x q by vpdpbusd, from the lanes' -128 * sum(q).
template <int R, int TB>
void tile_q8_0(const Weight& w, int64_t r0, const Acts& a, int64_t t0, float* Y, int64_t ldy, bool accumulate) {
  const int64_t nb = w.cols / QK;
  __m512 acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i spread_a = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i spread_b = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t nbv = q8::valid_blocks(nb, g);
    const __mmask64 ma = nbv >= 2 ? ~0ULL : 0xFFFFFFFFULL;
    const __mmask64 mb = nbv >= 4 ? ~0ULL : nbv == 3 ? 0xFFFFFFFFULL : 0ULL;
    const __mmask8 ms = static_cast<__mmask8>((1u << nbv) - 1);
    __m512i wa[R], wb[R];
    __m128 ws[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* src = reinterpret_cast<const int8_t*>(w.data) + (r0 + r) * w.cols + g * 128;
      const float* sc = w.scales + (r0 + r) * nb + g * q8::kGroup;
      if (nbv == q8::kGroup) {
        wa[r] = _mm512_xor_si512(_mm512_loadu_si512(src), flip);
        wb[r] = _mm512_xor_si512(_mm512_loadu_si512(src + 64), flip);
        ws[r] = _mm_loadu_ps(sc);
      } else {
        wa[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(ma, src), flip);
        wb[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mb, src + 64), flip);
        ws[r] = _mm_maskz_loadu_ps(ms, sc);
      }
    }
    for (int t = 0; t < TB; ++t) {
      const int8_t* xq = a.qt(t0 + t) + g * 128;
      const int32_t* c = a.ct(t0 + t) + g * 32;
      const __m512i xa = _mm512_loadu_si512(xq), xb = _mm512_loadu_si512(xq + 64);
      const __m512i ca = _mm512_loadu_si512(c), cb = _mm512_loadu_si512(c + 16);
      const __m128 xd = _mm_loadu_ps(a.st(t0 + t) + g * 4);
      for (int r = 0; r < R; ++r) {
        const __m512i sa = _mm512_dpbusd_epi32(ca, wa[r], xa);
        const __m512i sb = _mm512_dpbusd_epi32(cb, wb[r], xb);
        const __m512 p = _mm512_castps128_ps512(_mm_mul_ps(ws[r], xd));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sa), _mm512_permutexvar_ps(spread_a, p), acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sb), _mm512_permutexvar_ps(spread_b, p), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) q8::store(w, r0 + r, finish(acc[r][t], _mm256_setzero_ps(), false), Y, t0 + t, ldy, accumulate);
}

template <int R, int TB>
void tile(const Weight& w, int64_t r0, const Acts& a, int64_t t0, float* Y, int64_t ldy, bool accumulate) {
  if (w.kind == kQ4_1)
    tile_q4_1<R, TB>(w, r0, a, t0, Y, ldy, accumulate);
  else
    tile_q8_0<R, TB>(w, r0, a, t0, Y, ldy, accumulate);
}

template <int R>
void tile_tokens(const Weight& w, int64_t r0, const Acts& a, int64_t t0, int64_t tb, float* Y, int64_t ldy,
                 bool accumulate) {
  switch (tb) {
    case 1: tile<R, 1>(w, r0, a, t0, Y, ldy, accumulate); break;
    case 2: tile<R, 2>(w, r0, a, t0, Y, ldy, accumulate); break;
    case 3: tile<R, 3>(w, r0, a, t0, Y, ldy, accumulate); break;
    case 4: tile<R, 4>(w, r0, a, t0, Y, ldy, accumulate); break;
    case 5: tile<R, 5>(w, r0, a, t0, Y, ldy, accumulate); break;
    case 6: tile<R, 6>(w, r0, a, t0, Y, ldy, accumulate); break;
    case 7: tile<R, 7>(w, r0, a, t0, Y, ldy, accumulate); break;
    default: tile<R, 8>(w, r0, a, t0, Y, ldy, accumulate); break;
  }
}

// Tokens in tiles of up to 8 (a weight group's unpacking serves the whole tile), one row at a time
// (two rows at a time measured up to 1.8x slower where the weights stream from memory).
void rows(const Weight& w, int64_t r0, int64_t r1, const Acts& a, int64_t T, float* Y, int64_t ldy, bool accumulate) {
  constexpr int64_t kTile = 8;
  for (int64_t t0 = 0; t0 < T; t0 += kTile) {
    const int64_t tb = std::min<int64_t>(kTile, T - t0);
    for (int64_t r = r0; r < r1; ++r) tile_tokens<1>(w, r, a, t0, tb, Y, ldy, accumulate);
  }
}

// ---- panel kinds: 16 rows a register, one lane per row ----

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Stores 16 rows' sums of token t (panel p): + bias, then into or onto Y.
inline void panel_store(const Weight& w, int64_t p, __m512 s, float* Y, int64_t t, int64_t ldy, bool accumulate) {
  if (w.bias) s = _mm512_add_ps(s, _mm512_loadu_ps(w.bias + p * PANEL));
  float* y = Y + t * ldy + p * PANEL;
  _mm512_storeu_ps(y, accumulate ? _mm512_add_ps(_mm512_loadu_ps(y), s) : s);
}

// Panel p of a Q4_1P weight times TB tokens (t0..): a block's nibbles unpacked once for the tile; per token
// 8 vpdpbusd on the 16 rows at once, then the block's scale product and min term.
template <int TB>
void panel_q4_1(const Weight& w, int64_t p, const Acts& a, int64_t t0, float* Y, int64_t ldy, bool accumulate) {
  const int64_t nb = w.cols / QK;
  __m512 acc[TB], mac[TB];
  for (int t = 0; t < TB; ++t) acc[t] = mac[t] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* base = w.data + p * nb * 256;
  const float* sc = w.scales + p * nb * 2 * PANEL;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i lo[4], hi[4];
    for (int k = 0; k < 4; ++k) {
      const __m512i z = _mm512_loadu_si512(base + (b * 4 + k) * 64);
      lo[k] = _mm512_and_si512(z, low);
      hi[k] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
    }
    const __m512 dw = _mm512_loadu_ps(sc + b * 2 * PANEL), mw = _mm512_loadu_ps(sc + b * 2 * PANEL + PANEL);
    for (int t = 0; t < TB; ++t) {
      const int8_t* xq = a.pq(t0 + t) + b * QK;
      const float* xs = a.ps(t0 + t) + b * 2;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], bcast4(xq));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], bcast4(xq + 16));
      for (int k = 1; k < 4; ++k) {
        s0 = _mm512_dpbusd_epi32(s0, lo[k], bcast4(xq + 4 * k));
        s1 = _mm512_dpbusd_epi32(s1, hi[k], bcast4(xq + 16 + 4 * k));
      }
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[t] = _mm512_fmadd_ps(sum, _mm512_mul_ps(dw, _mm512_set1_ps(xs[0])), acc[t]);
      mac[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[1]), mac[t]);
    }
  }
  for (int t = 0; t < TB; ++t) panel_store(w, p, _mm512_add_ps(acc[t], mac[t]), Y, t0 + t, ldy, accumulate);
}

// Panel p of a Q8_0P weight times TB tokens: (w + 128) x q by vpdpbusd from -128 * sum(q).
template <int TB>
void panel_q8_0(const Weight& w, int64_t p, const Acts& a, int64_t t0, float* Y, int64_t ldy, bool accumulate) {
  const int64_t nb = w.cols / QK;
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  const uint8_t* base = w.data + p * nb * 512;
  const float* sc = w.scales + p * nb * PANEL;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i wv[8];
    for (int k = 0; k < 8; ++k) wv[k] = _mm512_loadu_si512(base + (b * 8 + k) * 64);
    const __m512 dw = _mm512_loadu_ps(sc + b * PANEL);
    for (int t = 0; t < TB; ++t) {
      const int8_t* xq = a.pq(t0 + t) + b * QK;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_set1_epi32(a.pc(t0 + t)[b]), wv[0], bcast4(xq));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[1], bcast4(xq + 4));
      for (int k = 2; k < 8; k += 2) {
        s0 = _mm512_dpbusd_epi32(s0, wv[k], bcast4(xq + 4 * k));
        s1 = _mm512_dpbusd_epi32(s1, wv[k + 1], bcast4(xq + 4 * k + 4));
      }
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[t] = _mm512_fmadd_ps(sum, _mm512_mul_ps(dw, _mm512_set1_ps(a.ps(t0 + t)[b * 2])), acc[t]);
    }
  }
  for (int t = 0; t < TB; ++t) panel_store(w, p, acc[t], Y, t0 + t, ldy, accumulate);
}

template <int TB>
void panel_tile(const Weight& w, int64_t p, const Acts& a, int64_t t0, float* Y, int64_t ldy, bool accumulate) {
  if (w.kind == kQ4_1P)
    panel_q4_1<TB>(w, p, a, t0, Y, ldy, accumulate);
  else
    panel_q8_0<TB>(w, p, a, t0, Y, ldy, accumulate);
}

// Rows r0..r1 (whole panels) in token tiles of up to kPanelTile.
constexpr int64_t kPanelTile = 4;
void panel_rows(const Weight& w, int64_t r0, int64_t r1, const Acts& a, int64_t T, float* Y, int64_t ldy,
                bool accumulate) {
  for (int64_t t0 = 0; t0 < T; t0 += kPanelTile) {
    const int64_t tb = std::min<int64_t>(kPanelTile, T - t0);
    for (int64_t p = r0 / PANEL; p < r1 / PANEL; ++p) {
      switch (tb) {
        case 1: panel_tile<1>(w, p, a, t0, Y, ldy, accumulate); break;
        case 2: panel_tile<2>(w, p, a, t0, Y, ldy, accumulate); break;
        case 3: panel_tile<3>(w, p, a, t0, Y, ldy, accumulate); break;
        default: panel_tile<kPanelTile>(w, p, a, t0, Y, ldy, accumulate); break;
      }
    }
  }
}

}  // namespace avx512_q8
#pragma GCC pop_options

// ---- int8 x blocks, AVX2 (vpmaddubsw + vpmaddwd) -----------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2_q8 {

using q8::Acts;

inline float finish(__m256 acc0, __m256 acc1, __m256 mac, bool q4_1) {
  __m256 a = _mm256_add_ps(acc0, acc1);
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  float s = _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
  if (!q4_1) return s;
  alignas(32) float m[8];
  _mm256_store_ps(m, mac);
  return s + ((m[1] + m[3]) + (m[5] + m[7]));
}

// int32 sums of 4-byte lanes of u8 x s8 (no int16 saturation for these ranges: |pair| <= 2 * 255 * 127
// never occurs; Q4_1 pairs reach 2 * 15 * 127, Q8_0's sign trick 2 * 128 * 127).
inline __m256i lanes(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }

// The first `n` 4-byte lanes of p (the rest zero), without reading past them.
inline __m256i load_lanes(const void* p, int n) {
  return _mm256_maskload_epi32(static_cast<const int*>(p), avx2::mask_of(n));
}
inline __m256 load_floats(const float* p, int n) {
  return _mm256_castsi256_ps(load_lanes(p, n));
}

// Row r of a Q4_1 weight times TB tokens (t0..), its groups unpacked once for them: a row's last group may
// hold fewer than 4 blocks; the missing ones count as zero blocks, read by masked loads from nowhere.
template <int TB>
void q4_1_tile(const Weight& w, int64_t r, const Acts& a, int64_t t0, float* out) {
  const int64_t nb = w.cols / QK;
  __m256 acc0[TB], acc1[TB], mac[TB];
  for (int t = 0; t < TB; ++t) acc0[t] = acc1[t] = mac[t] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i spread0 = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2), spread1 = _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6);
  for (int64_t g = 0; g < a.groups; ++g) {
    const int nbv = static_cast<int>(q8::valid_blocks(nb, g));
    const int64_t blk = r * nb + g * q8::kGroup;
    const uint8_t* wq = w.data + blk * 16;
    const float* ws = w.scales + blk * 2;
    __m256i z0, z1;
    __m256 wsv;
    if (nbv == q8::kGroup) {
      z0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));
      z1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 32));
      wsv = _mm256_loadu_ps(ws);
    } else {
      z0 = load_lanes(wq, std::min(8, 4 * nbv));
      z1 = nbv > 2 ? load_lanes(wq + 32, 4 * nbv - 8) : _mm256_setzero_si256();
      wsv = load_floats(ws, 2 * nbv);
    }
    const __m256i l0 = _mm256_and_si256(z0, low), h0 = _mm256_and_si256(_mm256_srli_epi16(z0, 4), low);
    const __m256i l1 = _mm256_and_si256(z1, low), h1 = _mm256_and_si256(_mm256_srli_epi16(z1, 4), low);
    for (int t = 0; t < TB; ++t) {
      const int8_t* xq = a.qt(t0 + t) + g * 128;
      auto x = [&](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * i)); };
      const __m256i s0 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(l0, x(0)), _mm256_maddubs_epi16(h0, x(2))), ones);
      const __m256i s1 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(l1, x(1)), _mm256_maddubs_epi16(h1, x(3))), ones);
      const __m256 p = _mm256_mul_ps(wsv, _mm256_loadu_ps(a.st(t0 + t) + g * 8));
      mac[t] = _mm256_add_ps(mac[t], p);
      acc0[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_permutevar8x32_ps(p, spread0), acc0[t]);
      acc1[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_permutevar8x32_ps(p, spread1), acc1[t]);
    }
  }
  for (int t = 0; t < TB; ++t) out[t] = finish(acc0[t], acc1[t], mac[t], true);
}

// Row r of a Q8_0 weight times TB tokens, |w| x sign(x, w) by vpmaddubsw, |w| taken once for them; a missing
// block of a row's last group would add fma(0, 0, acc) = acc, so it is skipped.
template <int TB>
void q8_0_tile(const Weight& w, int64_t r, const Acts& a, int64_t t0, float* out) {
  const int64_t nb = w.cols / QK;
  __m256 acc[TB][2];
  for (int t = 0; t < TB; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < a.groups; ++g) {
    const int nbv = static_cast<int>(q8::valid_blocks(nb, g));
    const uint8_t* wq = w.data + r * w.cols + g * 128;
    const float* ws = w.scales + r * nb + g * q8::kGroup;
    const __m256 wsv = nbv == q8::kGroup ? _mm256_castps128_ps256(_mm_loadu_ps(ws)) : load_floats(ws, nbv);
    __m256 p[TB];
    for (int t = 0; t < TB; ++t) p[t] = _mm256_mul_ps(wsv, _mm256_castps128_ps256(_mm_loadu_ps(a.st(t0 + t) + g * 4)));
    for (int j = 0; j < q8::kGroup; ++j) {
      if (j >= nbv) break;
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 32 * j));
      const __m256i wa = _mm256_sign_epi8(wv, wv);
      for (int t = 0; t < TB; ++t) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qt(t0 + t) + g * 128 + 32 * j));
        const __m256i s = lanes(wa, _mm256_sign_epi8(xv, wv));
        acc[t][j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_permutevar8x32_ps(p[t], _mm256_set1_epi32(j)), acc[t][j & 1]);
      }
    }
  }
  for (int t = 0; t < TB; ++t) out[t] = finish(acc[t][0], acc[t][1], _mm256_setzero_ps(), false);
}

template <int TB>
void tile(const Weight& w, int64_t r, const Acts& a, int64_t t0, float* Y, int64_t ldy, bool accumulate) {
  float out[TB];
  if (w.kind == kQ4_1)
    q4_1_tile<TB>(w, r, a, t0, out);
  else
    q8_0_tile<TB>(w, r, a, t0, out);
  for (int t = 0; t < TB; ++t) q8::store(w, r, out[t], Y, t0 + t, ldy, accumulate);
}

// Tokens in pairs (4 a tile spill registers: slower), a last odd token alone.
void rows(const Weight& w, int64_t r0, int64_t r1, const Acts& a, int64_t T, float* Y, int64_t ldy, bool accumulate) {
  int64_t t0 = 0;
  for (; t0 + 2 <= T; t0 += 2)
    for (int64_t r = r0; r < r1; ++r) tile<2>(w, r, a, t0, Y, ldy, accumulate);
  if (t0 < T)
    for (int64_t r = r0; r < r1; ++r) tile<1>(w, r, a, t0, Y, ldy, accumulate);
}

// ---- panel kinds: 8 rows a register (half a panel), one lane per row ----

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Stores 8 rows' sums (half h of panel p) of token t: + bias, then into or onto Y.
inline void half_store(const Weight& w, int64_t row0, __m256 s, float* Y, int64_t t, int64_t ldy, bool accumulate) {
  if (w.bias) s = _mm256_add_ps(s, _mm256_loadu_ps(w.bias + row0));
  float* y = Y + t * ldy + row0;
  _mm256_storeu_ps(y, accumulate ? _mm256_add_ps(_mm256_loadu_ps(y), s) : s);
}

// Half h of panel p of a Q4_1P weight times TB tokens: per block and token 8 vpmaddubsw summed in int16 (8 x 2 x
// 15 x 127 fits), one vpmaddwd, then the block's scale product and min term.
template <int TB>
void half_q4_1(const Weight& w, int64_t p, int h, const Acts& a, int64_t t0, float* Y, int64_t ldy, bool accumulate) {
  const int64_t nb = w.cols / QK;
  __m256 acc[TB], mac[TB];
  for (int t = 0; t < TB; ++t) acc[t] = mac[t] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* base = w.data + p * nb * 256 + h * 32;
  const float* sc = w.scales + p * nb * 2 * PANEL + h * 8;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i lo[4], hi[4];
    for (int k = 0; k < 4; ++k) {
      const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + (b * 4 + k) * 64));
      lo[k] = _mm256_and_si256(z, low);
      hi[k] = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
    }
    const __m256 dw = _mm256_loadu_ps(sc + b * 2 * PANEL), mw = _mm256_loadu_ps(sc + b * 2 * PANEL + PANEL);
    for (int t = 0; t < TB; ++t) {
      const int8_t* xq = a.pq(t0 + t) + b * QK;
      const float* xs = a.ps(t0 + t) + b * 2;
      __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], bcast4(xq)), _mm256_maddubs_epi16(hi[0], bcast4(xq + 16)));
      for (int k = 1; k < 4; ++k)
        s16 = _mm256_add_epi16(s16, _mm256_add_epi16(_mm256_maddubs_epi16(lo[k], bcast4(xq + 4 * k)),
                                                      _mm256_maddubs_epi16(hi[k], bcast4(xq + 16 + 4 * k))));
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
      acc[t] = _mm256_fmadd_ps(sum, _mm256_mul_ps(dw, _mm256_set1_ps(xs[0])), acc[t]);
      mac[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[1]), mac[t]);
    }
  }
  for (int t = 0; t < TB; ++t)
    half_store(w, p * PANEL + h * 8, _mm256_add_ps(acc[t], mac[t]), Y, t0 + t, ldy, accumulate);
}

// Half h of panel p of a Q8_0P weight times TB tokens: |w| x sign(q, w) by vpmaddubsw (|w| and w taken once for
// the tile from the stored w + 128), one vpmaddwd a 4-byte step.
template <int TB>
void half_q8_0(const Weight& w, int64_t p, int h, const Acts& a, int64_t t0, float* Y, int64_t ldy, bool accumulate) {
  const int64_t nb = w.cols / QK;
  __m256 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const uint8_t* base = w.data + p * nb * 512 + h * 32;
  const float* sc = w.scales + p * nb * PANEL + h * 8;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i sum[TB];
    for (int t = 0; t < TB; ++t) sum[t] = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
      const __m256i wv = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + (b * 8 + k) * 64)), flip);
      const __m256i aw = _mm256_sign_epi8(wv, wv);
      for (int t = 0; t < TB; ++t) {
        const __m256i xv = bcast4(a.pq(t0 + t) + b * QK + 4 * k);
        sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones));
      }
    }
    const __m256 dw = _mm256_loadu_ps(sc + b * PANEL);
    for (int t = 0; t < TB; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(dw, _mm256_set1_ps(a.ps(t0 + t)[b * 2])), acc[t]);
  }
  for (int t = 0; t < TB; ++t) half_store(w, p * PANEL + h * 8, acc[t], Y, t0 + t, ldy, accumulate);
}

// Rows r0..r1 (whole panels) by halves, tokens in tiles (Q4_1P: 2, its unpacked block takes 8 registers of 16;
// Q8_0P: 4).
void panel_rows(const Weight& w, int64_t r0, int64_t r1, const Acts& a, int64_t T, float* Y, int64_t ldy,
                bool accumulate) {
  const bool q4 = w.kind == kQ4_1P;
  const int64_t tile = q4 ? 2 : 4;
  for (int64_t t0 = 0; t0 < T; t0 += tile) {
    const int64_t tb = std::min<int64_t>(tile, T - t0);
    for (int64_t p = r0 / PANEL; p < r1 / PANEL; ++p)
      for (int h = 0; h < 2; ++h) {
        if (q4) {
          if (tb == 2) half_q4_1<2>(w, p, h, a, t0, Y, ldy, accumulate);
          else half_q4_1<1>(w, p, h, a, t0, Y, ldy, accumulate);
        } else {
          switch (tb) {
            case 1: half_q8_0<1>(w, p, h, a, t0, Y, ldy, accumulate); break;
            case 2: half_q8_0<2>(w, p, h, a, t0, Y, ldy, accumulate); break;
            case 3: half_q8_0<3>(w, p, h, a, t0, Y, ldy, accumulate); break;
            default: half_q8_0<4>(w, p, h, a, t0, Y, ldy, accumulate); break;
          }
        }
      }
  }
}

}  // namespace avx2_q8
#pragma GCC pop_options

#endif  // SPECSERVE_X86

namespace q8 {

enum class Variant { kGeneric, kAvx2, kAvx512Vnni };

// The int8 code in use, following the operators' variant: with "avx512", AVX-512 VNNI where the CPU has it
// (else the AVX2 code); with "avx2", AVX2; with "generic", plain C++. SPECSERVE_CPU_INT8_VARIANT=avx2 /
// generic picks a lesser one (tests, measurements).
Variant variant() {
#if SPECSERVE_X86
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  static const std::string want = [] {
    const char* env = std::getenv("SPECSERVE_CPU_INT8_VARIANT");
    return std::string(env ? env : "");
  }();
  const int ops = current_variant();
  if (ops == kGeneric || want == "generic") return Variant::kGeneric;
  return ops == kAvx512 && vnni && want != "avx2" ? Variant::kAvx512Vnni : Variant::kAvx2;
#else
  return Variant::kGeneric;
#endif
}

std::string variant_name() {
  switch (variant()) {
    case Variant::kAvx512Vnni: return "avx512_vnni";
    case Variant::kAvx2: return "avx2";
    default: return "generic";
  }
}

// Y[T, rows] (+)= X[T, cols] @ W^T with X quantized per token per block (scratch: `a`); rows split over
// the worker pool as matmul splits them.
void matmul(const Weight& w, const float* X, int64_t T, int64_t ldx, float* Y, int64_t ldy, bool accumulate, Acts& a) {
  quantize(X, T, ldx, w.cols, w.kind, a);
  const int64_t chunk = 32;
  const int64_t tasks = (w.rows + chunk - 1) / chunk;
  const Variant v = variant();
  pool::parallel_chunks(tasks, [&](int64_t c) {
    const int64_t r0 = c * chunk, r1 = std::min(w.rows, r0 + chunk);
    if (a.panel) {
#if SPECSERVE_X86
      if (v == Variant::kAvx512Vnni) return avx512_q8::panel_rows(w, r0, r1, a, T, Y, ldy, accumulate);
      if (v == Variant::kAvx2) return avx2_q8::panel_rows(w, r0, r1, a, T, Y, ldy, accumulate);
#endif
      return panel_rows(w, r0, r1, a, T, Y, ldy, accumulate);
    }
#if SPECSERVE_X86
    if (v == Variant::kAvx512Vnni)
      avx512_q8::rows(w, r0, r1, a, T, Y, ldy, accumulate);
    else if (v == Variant::kAvx2)
      avx2_q8::rows(w, r0, r1, a, T, Y, ldy, accumulate);
    else
#endif
      rows(w, r0, r1, a, T, Y, ldy, accumulate);
  });
}

}  // namespace q8

// A product under activation mode `act`: int8 for Q4_1 / Q8_0 weights in kActInt8, else float32.
void matmul_as(const Weight& w, const float* X, int64_t T, int64_t ldx, float* Y, int64_t ldy, bool accumulate,
               int64_t act, q8::Acts& scratch) {
  TORCH_CHECK(act == kActF32 || act == kActInt8, "unknown activation mode ", act, " (0: float32, 1: int8)");
  TORCH_CHECK(act == kActInt8 || !is_panel(w.kind), "a panel weight (kind ", w.kind, ") runs on int8 activations only");
  if (act == kActInt8 && w.kind != kF32)
    q8::matmul(w, X, T, ldx, Y, ldy, accumulate, scratch);
  else
    matmul(w, X, T, ldx, Y, ldy, accumulate);
}

// ==== end of int8 activations ===================================================================

// ---- operators ---------------------------------------------------------------------------------

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t kind, int64_t cols,
                  const c10::optional<at::Tensor>& bias, int64_t activations) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols && x.scalar_type() == at::kFloat, "x must be float32 [T, cols]");
  at::Tensor xc = x.contiguous();
  Weight w = make_weight(weight, scales, kind, cols, bias);
  at::Tensor y = at::empty({x.size(0), w.rows}, x.options());
  PhaseTimer timer;
  q8::Acts scratch;
  matmul_as(w, xc.data_ptr<float>(), x.size(0), cols, y.data_ptr<float>(), w.rows, false, activations, scratch);
  timer.lap(kHead);  // the model calls `linear` for its head only
  return y;
}

at::Tensor embed(const at::Tensor& ids, const at::Tensor& weight, const at::Tensor& scales, int64_t kind, int64_t cols) {
  Weight w = make_weight(weight, scales, kind, cols, c10::nullopt);
  TORCH_CHECK(!is_panel(kind), "embed reads weights in the row layout, not panels (kind ", kind, ")");
  at::Tensor idc = ids.to(at::kLong).contiguous();
  const int64_t T = idc.numel();
  at::Tensor out = at::empty({T, cols}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* id = idc.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  PhaseTimer timer;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < w.rows, "token id ", id[t], " outside the embedding's ", w.rows, " rows");
    float block[QK];
    for (int64_t b = 0; b * QK < cols; ++b) {
      generic::dequant_block(w, id[t], b, block);
      std::memcpy(o + t * cols + b * QK, block, std::min<int64_t>(QK, cols - b * QK) * sizeof(float));
    }
  }
  timer.lap(kEmbed);
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t H = x.size(-1);
  rms_norm_rows(xc.data_ptr<float>(), xc.numel() / H, H, weight.contiguous().data_ptr<float>(),
                static_cast<float>(eps), out.data_ptr<float>());
  return out;
}

// The decoder layers of a Llama-family model over one pass, x [T, H] updated in place; activations:
// kActF32 or kActInt8 (the products with Q4_1 / Q8_0 weights on int8 activations).
// layers: per layer 14 tensors: input norm, then (data, scales, bias) of qkv and o, post norm, then
// (data, scales, bias) of gate_up and down; an empty tensor: no scales (float32) or no bias.
// kinds: per layer 4 weight kinds (qkv, o, gate_up, down).
void decoder_layers(const at::Tensor& x, at::TensorList layers, at::IntArrayRef kinds, const at::Tensor& cos,
                    const at::Tensor& sin, const at::Tensor& kv, const at::Tensor& slot_mapping,
                    const at::Tensor& tables, const at::Tensor& seq, const at::Tensor& prefix,
                    const at::Tensor& extra_off, const at::Tensor& extra_slots, int64_t block_size,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, int64_t activations) {
  const int64_t L = static_cast<int64_t>(layers.size()) / 14;
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == L * 14 && static_cast<int64_t>(kinds.size()) == L * 4,
              "decoder_layers takes 14 tensors and 4 kinds per layer");
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() == 2, "x must be contiguous float32 [T, H]");
  TORCH_CHECK(kv.is_contiguous() && kv.scalar_type() == at::kFloat && kv.dim() == 5 && kv.size(0) >= L,
              "kv must be contiguous float32 [layers, 2, kv_heads, slots, head_dim]");
  for (const at::Tensor* t : {&tables, &seq, &prefix, &extra_off, &extra_slots})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kInt, "key layout tensors must be contiguous int32");
  const int64_t T = x.size(0), H = x.size(1), D = head_dim, NH = num_heads, KVH = num_kv_heads;
  const int64_t qsize = NH * D, kvsize = KVH * D, group = NH / KVH, slots_total = kv.size(3);
  TORCH_CHECK(kv.size(2) == KVH && kv.size(4) == D, "kv must be [layers, 2, kv_heads, slots, head_dim] (head-major)");
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const KeyLayout kl{tables.data_ptr<int32_t>(), tables.size(1), block_size, seq.data_ptr<int32_t>(),
                     prefix.data_ptr<int32_t>(), extra_off.data_ptr<int32_t>(), extra_slots.data_ptr<int32_t>()};
  const int64_t* slot_map = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot_map[t] >= 0 && slot_map[t] < slots_total, "slot ", slot_map[t], " outside the KV cache");
  float* X = x.data_ptr<float>();
  const float* C = cos.data_ptr<float>();
  const float* S = sin.data_ptr<float>();
  std::vector<float> h(T * H), attn(T * qsize);
  std::vector<float> qkv, gu, act;
  q8::Acts scratch;
  PhaseTimer timer;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* p = &layers[l * 14];
    const int64_t* k = &kinds[l * 4];
    Weight wqkv = make_weight(p[1], p[2], k[0], H, p[3]);
    Weight wo = make_weight(p[4], p[5], k[1], qsize, p[6]);
    Weight wgu = make_weight(p[8], p[9], k[2], H, p[10]);
    const int64_t I = wgu.rows / 2;
    Weight wd = make_weight(p[11], p[12], k[3], I, p[13]);
    TORCH_CHECK(wqkv.rows == qsize + 2 * kvsize && wo.rows == H && wd.rows == H, "layer ", l, " has unexpected shapes");
    qkv.resize(T * wqkv.rows);
    gu.resize(T * wgu.rows);
    act.resize(T * I);
    const int64_t ldqkv = wqkv.rows;
    // attention block
    timer.lap(kNorm);  // the buffers' sizing above counts as norm time (it is next to nothing)
    rms_norm_rows(X, T, H, p[0].data_ptr<float>(), static_cast<float>(eps), h.data());
    timer.lap(kNorm);
    matmul_as(wqkv, h.data(), T, H, qkv.data(), ldqkv, false, activations, scratch);
    timer.lap(kQkv);
    rope_rows(qkv.data(), T, ldqkv, NH + KVH, D, C, S);  // q and k heads are adjacent in each row
    timer.lap(kRope);
    float* kc = kv.data_ptr<float>() + (l * 2 + 0) * slots_total * kvsize;
    float* vc = kv.data_ptr<float>() + (l * 2 + 1) * slots_total * kvsize;
    for (int64_t t = 0; t < T; ++t)  // head-major: head h of slot s at (h * slots + s) * D
      for (int64_t h = 0; h < KVH; ++h) {
        const float* row = qkv.data() + t * ldqkv + qsize + h * D;
        std::memcpy(kc + (h * slots_total + slot_map[t]) * D, row, D * sizeof(float));
        std::memcpy(vc + (h * slots_total + slot_map[t]) * D, row + kvsize, D * sizeof(float));
      }
    timer.lap(kKvWrite);
    pool::parallel_chunks(T * KVH, [&](int64_t item) {  // one (token, kv head) a chunk
      thread_local std::vector<float> scores;
      thread_local std::vector<int64_t> slots;
      const int64_t t = item / KVH, g = item % KVH;
      attend(qkv.data() + t * ldqkv, attn.data() + t * qsize, t, g, kl, kc, vc, slots_total, D, group, scale, scores,
             slots);
    });
    timer.lap(kAttention);
    matmul_as(wo, attn.data(), T, qsize, X, H, true, activations, scratch);
    timer.lap(kOut);
    // MLP block
    rms_norm_rows(X, T, H, p[7].data_ptr<float>(), static_cast<float>(eps), h.data());
    timer.lap(kNorm);
    matmul_as(wgu, h.data(), T, H, gu.data(), wgu.rows, false, activations, scratch);
    timer.lap(kGateUp);
    for (int64_t t = 0; t < T; ++t)
      DISPATCH(silu_mul, gu.data() + t * wgu.rows, gu.data() + t * wgu.rows + I, act.data() + t * I, I);
    timer.lap(kSiluMul);
    matmul_as(wd, act.data(), T, I, X, H, true, activations, scratch);
    timer.lap(kDown);
  }
}

std::string variant() { return kVariantNames[current_variant()]; }

// The variants this CPU runs, best last.
std::vector<std::string> variants() {
  std::vector<std::string> names;
  for (int v = 0; v < kVariants; ++v)
    if (cpu_runs(v)) names.emplace_back(kVariantNames[v]);
  return names;
}

// Runs `name` from now on in this process (an error where it is unknown or this CPU lacks it); returns the
// variant that ran before.
std::string set_variant(const std::string& name) {
  for (int v = 0; v < kVariants; ++v)
    if (name == kVariantNames[v]) {
      TORCH_CHECK(cpu_runs(v), "this CPU cannot run the ", name, " CPU kernels");
      return kVariantNames[g_variant.exchange(v)];
    }
  TORCH_CHECK(false, "unknown CPU kernel variant '", name, "' (avx512, avx2 or generic)");
  return {};
}

// Runs the operators' parallel loops on "pool" (the worker pool) or "openmp" (at::parallel_for) from now on;
// returns the one used before.
std::string set_parallel(const std::string& name) {
  TORCH_CHECK(name == "pool" || name == "openmp", "unknown parallel mode '", name, "' (pool or openmp)");
  return pool::g_openmp.exchange(name == "openmp") ? "openmp" : "pool";
}

// Turns the phase timers on (clearing them) or off; returns "phase seconds" lines of what they summed.
std::string profile(bool on) {
  std::string report;
  for (int i = 0; i < kPhases; ++i) report += std::string(kPhaseNames[i]) + " " + std::to_string(g_phase_s[i]) + "\n";
  if (on)
    for (double& v : g_phase_s) v = 0;
  g_profiling.store(on);
  return report;
}

}  // namespace

TORCH_LIBRARY(specserve_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor scales, int kind, int cols, Tensor? bias=None, int activations=0) "
        "-> Tensor", &linear);
  m.def("embed(Tensor ids, Tensor weight, Tensor scales, int kind, int cols) -> Tensor", &embed);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("decoder_layers(Tensor(a!) x, Tensor[] layers, int[] kinds, Tensor cos, Tensor sin, Tensor(b!) kv, "
        "Tensor slot_mapping, Tensor tables, Tensor seq, Tensor prefix, Tensor extra_off, Tensor extra_slots, "
        "int block_size, int num_heads, int num_kv_heads, int head_dim, float eps, int activations=0) -> ()",
        &decoder_layers);
  m.def("variant() -> str", &variant);
  m.def("variants() -> str[]", &variants);
  m.def("set_variant(str name) -> str", &set_variant);
  m.def("profile(bool on) -> str", &profile);
  m.def("set_parallel(str name) -> str", &set_parallel);
  m.def("int8_variant() -> str", &q8::variant_name);
}
