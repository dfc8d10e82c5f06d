"""EagleHead: an EAGLE-style draft, one decoder layer that reads the target's own features.

Entry i of a request pairs the target's feature at position i (its final norm's output, what its LM
head reads) with the committed token at position i + 1: `fc([embed(x_{i+1}); f_i])`. The layer, with
causal attention over the earlier entries, predicts the feature at i + 1; the target's LM head,
restricted to the head's draft vocabulary, turns that prediction into logits for position i + 2.
A tree node's entry pairs its parent's predicted feature with its own token, so speculation past
the first token runs on the head's own predictions.

The token embedding and the LM head are the target's (loaded from its weights, never saved here);
the head saves only its layer, its input projection and its vocabulary (target token ids).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from specserve.shared.runtime import kernels
from specserve.shared.runtime.kernels import KIND_Q8_0
from specserve.shared.runtime.model_config import ModelConfig
from specserve.shared.runtime.model_store import PACKED, unpack
from specserve.shared.runtime.quant import float_rows, int8_rows
from specserve.shared.runtime.rope import RotaryEmbedding, apply_rotary

WEIGHTS = "eagle.safetensors"
CONFIG = "eagle.json"
FROZEN = ("embed.weight", "head.weight")  # the target's, loaded from its weights


class QuantLinear(nn.Module):
    """A bias-free linear over a weight as the compiled CPU operators store it (q8_0): at one token a
    draft step reads its weights once, so a quarter of float32's bytes is most of its time."""

    data: torch.Tensor  # buffers (register_buffer below)
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        from specserve.shared.runtime.quant import quantize

        stored = quantize(weight.detach().float(), KIND_Q8_0)
        self.register_buffer("data", stored.data, persistent=False)
        self.register_buffer("scales", stored.scales, persistent=False)
        self.in_features, self.out_features = stored.cols, stored.rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        out: torch.Tensor = torch.ops.specserve_cpu.linear(flat, self.data, self.scales, KIND_Q8_0, self.in_features,
                                                           None)
        return out.reshape(*x.shape[:-1], self.out_features)


LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "head")


class EagleHead(nn.Module):
    vocab: torch.Tensor  # a buffer (register_buffer below): the draft vocabulary's target token ids

    def __init__(self, target: ModelConfig, intermediate_size: int, vocab: torch.Tensor):
        super().__init__()
        h, self.heads, self.kv_heads, self.head_dim = (target.hidden_size, target.num_heads, target.num_kv_heads,
                                                       target.head_dim)
        self.target_config, self.intermediate_size, self.hidden_size = target, intermediate_size, h
        self.register_buffer("vocab", vocab.to(torch.int64))
        self.embed = nn.Embedding(target.vocab_size, h)
        self.head = nn.Linear(h, len(vocab), bias=False)
        for frozen in (self.embed, self.head):
            frozen.weight.requires_grad_(False)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.attn_norm = nn.RMSNorm(h, eps=target.rms_norm_eps)
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=target.rms_norm_eps)
        self.gate_proj = nn.Linear(h, intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, h, bias=False)
        self.rope = RotaryEmbedding(target)
        self.scale = self.head_dim ** -0.5

    # ---- the pieces of one pass: inputs, q/k/v, the rest of the layer, logits ---------------------
    def inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """features [..., H] and tokens [...] -> the layer's input stream [..., H]."""
        x: torch.Tensor = self.fc(torch.cat((self.embed(tokens).to(features.dtype), features), dim=-1))
        return x

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H], positions [N] -> q [N, heads, d], k and v [N, kv_heads, d], RoPE applied."""
        n = x.shape[0]
        a = self.attn_norm(x)
        q = self.q_proj(a).view(n, self.heads, self.head_dim)
        k = self.k_proj(a).view(n, self.kv_heads, self.head_dim)
        v = self.v_proj(a).view(n, self.kv_heads, self.head_dim)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention ([N, heads * d]) and the MLP: the predicted feature."""
        projected: torch.Tensor = self.o_proj(attn)
        h = x + projected
        m = self.mlp_norm(h)
        mlp: torch.Tensor = self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))
        return h + mlp

    def to_cpu_kernels(self) -> bool:
        """Run every linear, the head's rows included, as q8_0 through the compiled CPU operators (float32
        on CPU only; the head then serves, it no longer trains). False, changing nothing, where they are
        not built."""
        if self.attn_norm.weight.device.type != "cpu" or self.attn_norm.weight.dtype != torch.float32 \
                or not kernels.load():
            return False
        for name in LINEARS:
            setattr(self, name, QuantLinear(getattr(self, name).weight))
        return True

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Predicted features [..., H] -> float32 logits over the draft vocabulary [..., V']."""
        logits: torch.Tensor = self.head(predicted)
        return logits.float()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [N, heads, d] over keys k, v [M, kv_heads, d]; mask [N, M] bool (True: may attend) or None."""
        groups = self.heads // self.kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q, k) * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask[None], float("-inf"))
        out = torch.einsum("hnm,mhd->nhd", scores.float().softmax(-1).to(v.dtype), v)
        return out.reshape(q.shape[0], -1)

    # ---- saving and loading -----------------------------------------------------------------------
    def trained_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k not in FROZEN}

    def save(self, out: Path, target: str, int8: bool = False) -> None:
        """The trained tensors and eagle.json (`target`: the target model's name or directory). int8: each
        matrix as int8 rows with a float32 scale per row (symmetric; a quarter of the float32 bytes)."""
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.float() if v.is_floating_point() else v for k, v in self.trained_state().items()}
        if int8:
            state = int8_rows(state)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS))
        (out / CONFIG).write_text(json.dumps({"target": target, "intermediate_size": self.intermediate_size,
                                              "draft_vocab_size": len(self.vocab)}, indent=1) + "\n")

    def load_target(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """The target's embedding [V, H] and LM head [V, H] (its rows for the draft vocabulary are kept)."""
        with torch.no_grad():
            self.embed.weight.copy_(embed)
            self.head.weight.copy_(lm_head[self.vocab])


def is_eagle_dir(path: str | Path) -> bool:
    weights = Path(path) / WEIGHTS
    return weights.is_file() or weights.with_name(WEIGHTS + PACKED).is_file()


def weights_file(path: str | Path) -> Path:
    """The head's eagle.safetensors, written out first from eagle.safetensors.xz where the directory holds
    that (the bundled head is committed compressed, shared/runtime/model_store.py) and it is missing or older."""
    weights = Path(path) / WEIGHTS
    if (packed := weights.with_name(WEIGHTS + PACKED)).is_file():
        unpack(packed)
    return weights


def target_of(path: str | Path) -> str:
    """The target model (name or directory) a saved head was trained on."""
    return str(json.loads((Path(path) / CONFIG).read_text())["target"])


def target_parts(target_dir: str | Path) -> tuple[ModelConfig, torch.Tensor, torch.Tensor]:
    """The target's config, embedding [V, H] and LM head [V, H] (float32; the embedding where the head is
    tied), read from its config.json and model.safetensors (only those two tensors)."""
    with safe_open(str(Path(target_dir) / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
        lm_head = f.get_tensor("lm_head.weight").float() if "lm_head.weight" in f.keys() else embed
    return ModelConfig.from_dir(target_dir), embed, lm_head


def load_for_target(path: str | Path, target_dir: str | Path, dtype: torch.dtype = torch.float32) -> EagleHead:
    """A saved head over the target in `target_dir` (`target_parts`)."""
    return load_head(Path(path), *target_parts(target_dir), dtype)


def load_head(path: Path, target: ModelConfig, embed: torch.Tensor, lm_head: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> EagleHead:
    """A saved head (`path`) over the target's config, embedding and LM head."""
    meta = json.loads((Path(path) / CONFIG).read_text())
    state = float_rows(load_file(str(weights_file(path))))
    head = EagleHead(target, meta["intermediate_size"], state["vocab"])
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or set(missing) - set(FROZEN):
        raise ValueError(f"{path}: not an EAGLE head of this shape (missing {missing}, unexpected {unexpected})")
    head.load_target(embed, lm_head)
    return head.to(dtype).eval()
