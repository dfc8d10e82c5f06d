"""Per-request records and the run summary, with the metrics defined as the papers and vLLM define them.

- TPOT (as `vllm bench serve`): (latency - TTFT) / (completion_tokens - 1), completion_tokens from
  the usage chunk (a speculative server sends several tokens per chunk, so chunks are not tokens).
- SLO attainment (`attainment`, as SLOs-Serve counts it): the share of requests that met their SLO, that
  is both its TTFT (send to the first token) and its TPOT within their targets. A request that failed
  counts as missed; one with fewer than 2 tokens has no TPOT to miss. Beside it, `tpot_attainment`
  (AdaServe §5's TPOT SLO attainment, TTFT ignored) and `ttft_attainment` (TPOT ignored).
- Goodput (AdaServe §5, with the SLO met as above): output tokens per second of the requests that met
  their SLO, over the run's duration (first send to last completion).
- Tokens per step: the mean, over every verify step of every request, of the tokens it emitted
  (1 + accepted draft tokens), from the `specserve` extension of the responses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec


class RequestRecord(msgspec.Struct, kw_only=True):
    """One request as the load generator saw it (one JSONL line)."""

    index: int  # order of arrival in the run
    category: str  # SLO class sent as service_tier
    workload: str  # prompt set
    prompt_id: str
    slo_tpot_ms: float  # the TPOT target the request was judged by, ms
    slo_ttft_ms: float  # the TTFT target, ms
    scheduled_s: float  # planned send time, s from the start of the run
    sent_s: float  # actual send time, s from the start of the run
    max_tokens: int
    status: int = 0  # HTTP status (0: no response)
    status_ms: float | None = None  # send -> the response's status line (for a 503: how fast it was refused), ms
    retry_after_s: float | None = None  # the Retry-After header of a refusal, s (None: none sent)
    error: str | None = None  # why it failed, if it did
    ttft_ms: float | None = None  # send -> first chunk with a token, ms
    latency_ms: float | None = None  # send -> last token-bearing chunk, ms
    tpot_ms: float | None = None  # (latency - ttft) / (completion_tokens - 1), ms
    itl_ms: list[float] = []  # gaps between token-bearing chunks, ms
    prompt_tokens: int = 0  # from usage
    completion_tokens: int = 0  # from usage
    finish_reason: str | None = None
    steps: int = 0  # verify steps the server ran for it (from the specserve extension)
    step_tokens: int = 0  # tokens those steps emitted (1 + accepted per step)
    server_tpot_ms: float | None = None  # the server's own TPOT measure (specserve extension), ms
    best_effort: bool = False  # served in the best-effort tier (no SLO applied; specserve extension)

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def tpot_met(self) -> bool:
        """Within its TPOT SLO; failures miss; fewer than 2 tokens (no TPOT) meet it."""
        if not self.ok:
            return False
        return self.tpot_ms is None or self.tpot_ms <= self.slo_tpot_ms

    @property
    def ttft_met(self) -> bool:
        return self.ok and self.ttft_ms is not None and self.ttft_ms <= self.slo_ttft_ms

    @property
    def slo_met(self) -> bool:
        """Its SLO met: both its TTFT and its TPOT within their targets."""
        return self.tpot_met and self.ttft_met


def vllm_tpot_ms(ttft_ms: float, latency_ms: float, completion_tokens: int) -> float | None:
    """`vllm bench serve`'s TPOT; None with fewer than 2 output tokens."""
    if completion_tokens < 2:
        return None
    return (latency_ms - ttft_ms) / (completion_tokens - 1)


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default; None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize_records(records: list[RequestRecord], duration_s: float) -> dict:
    """The request-side metrics of one run (or of one category's records, over the run's duration)."""
    done = [r for r in records if r.ok]
    met = [r for r in records if r.slo_met]
    ttfts = [r.ttft_ms for r in done if r.ttft_ms is not None]
    tpots = [r.tpot_ms for r in done if r.tpot_ms is not None]
    lats = [r.latency_ms for r in done if r.latency_ms is not None]
    steps = sum(r.steps for r in done)
    return {
        "requests": len(records),
        "completed": len(done),
        "errors": len(records) - len(done),
        "refused": sum(r.status == 503 for r in records),  # 503: refused at once (admission, or a full queue)
        "best_effort": sum(r.best_effort for r in done),
        # attainment among the requests admitted with an SLO (neither refused nor served best effort)
        "admitted_attainment": _ratio(sum(r.slo_met for r in done if not r.best_effort),
                                      sum(not r.best_effort for r in done)),
        "admitted_tpot_attainment": _ratio(sum(r.tpot_met for r in done if not r.best_effort),
                                           sum(not r.best_effort for r in done)),
        "admitted_ttft_attainment": _ratio(sum(r.ttft_met for r in done if not r.best_effort),
                                           sum(not r.best_effort for r in done)),
        "attainment": _ratio(len(met), len(records)),  # both SLOs
        "tpot_attainment": _ratio(sum(r.tpot_met for r in records), len(records)),
        "ttft_attainment": _ratio(sum(r.ttft_met for r in records), len(records)),
        "goodput_tok_s": _ratio(sum(r.completion_tokens for r in met), duration_s),
        "throughput_tok_s": _ratio(sum(r.completion_tokens for r in done), duration_s),
        "request_throughput": _ratio(len(done), duration_s),
        "output_tokens": sum(r.completion_tokens for r in done),
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "tpot_p50_ms": percentile(tpots, 50),
        "tpot_p99_ms": percentile(tpots, 99),
        "tpot_mean_ms": sum(tpots) / len(tpots) if tpots else None,
        "e2e_p50_ms": percentile(lats, 50),
        "e2e_p99_ms": percentile(lats, 99),
        "tokens_per_step": _ratio(sum(r.step_tokens for r in done), steps),
    }


def summarize(records: list[RequestRecord], duration_s: float, server: dict | None = None) -> dict:
    """The whole run: overall metrics, the same per category, and the server-side iteration split."""
    out = summarize_records(records, duration_s)
    out["duration_s"] = duration_s
    cats = list(dict.fromkeys(r.category for r in records))
    out["categories"] = {c: summarize_records([r for r in records if r.category == c], duration_s) | {
        "slo_tpot_ms": next(r.slo_tpot_ms for r in records if r.category == c)} for c in cats}
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or f"HTTP {r.status}")[:120]
            errors[key] = errors.get(key, 0) + 1
    out["error_kinds"] = errors
    if server is not None:
        out.update(server)
    return out
