"""Sampling parameters and the target distribution they define over next tokens.

`probabilities` is total over what `SamplingParams` accepts: for any finite temperature >= 0, any
top_p in (0, 1], any integer top_k, any min_p in [0, 1] and any logits without NaN (+-inf and huge or
tiny values included) every row it returns is finite, non-negative, sums to 1 and keeps a most likely
token. The penalties that depend on the tokens so far (repetition, presence, frequency, min_tokens)
are applied to the logits before it, by shared/spec/penalties.py.
This matters because one request's parameters must never make a batched call fail: a temperature
of 1e-38 would otherwise divide the logits into inf - inf = NaN, and a top_p of 1e-300 round to 0
in float32 and mask every token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SEED_MIN, SEED_END = -(2**63), 2**64  # torch.Generator.manual_seed's range: [SEED_MIN, SEED_END)
PENALTY_LIMIT = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's and vLLM's range)
MAX_REDRAWS = 8  # sample(): redraws of a zero-probability token before falling back to the argmax


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy (argmax); any finite value > 0 samples
    top_p: float = 1.0  # nucleus mass in (0, 1]; the most likely token is always kept
    top_k: int = 0  # 0, negative or >= the vocabulary: no top-k limit
    seed: int | None = None  # per-request seed in [-2**63, 2**64); None draws from torch's global generator
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p x the most likely one (after temperature)
    # vLLM's penalties (shared/spec/penalties.py), on the logits before temperature; neutral by default
    repetition_penalty: float = 1.0  # > 0: a token seen in prompt or output: logit / r if positive, else x r
    presence_penalty: float = 0.0  # subtracted from the logit of a token the output holds
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    min_tokens: int = 0  # output tokens before any of stop_ids may be drawn
    stop_ids: tuple[int, ...] = ()  # the ids min_tokens holds back (EOS and the request's stop ids)

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_MIN <= self.seed < SEED_END):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, name) <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not all(isinstance(t, int) for t in self.stop_ids):
            raise ValueError(f"stop_ids must be integers, got {self.stop_ids!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (a repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def holds_stops(self) -> bool:
        """Whether min_tokens holds stop ids back at the start of the output."""
        return self.min_tokens > 0 and bool(self.stop_ids)

    def make_generator(self) -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator().manual_seed(self.seed)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first index of its largest value; a NaN counts as the largest, as in torch). A
    float32 tensor on the CPU goes through NumPy's vectorized argmax (the same indices; why:
    docs/lab/step_overhead.md); others through torch."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        chosen: list[int] = logits.detach().numpy().argmax(-1).tolist()
        return chosen
    on_device: list[int] = logits.argmax(-1).tolist()
    return on_device


def greedy_rows(logits: Sequence[torch.Tensor], whole: torch.Tensor | None = None) -> list[list[int]]:
    """`greedy_tokens` of each tensor, with one read back for all of them: on a GPU the argmaxes stay on the
    device until a single copy to the host (one synchronization a call, not one a tensor); float32 on the
    CPU goes through NumPy as in `greedy_tokens`. whole: the 2-D tensor all of them are row blocks of (a
    pass's logits before they were split by entry); where they hold at least half its rows, its argmax is
    taken in one call and each tensor's rows read from it."""
    if not logits:
        return []
    if whole is not None and whole.is_contiguous() and 2 * sum(t.shape[0] for t in logits) >= whole.shape[0]:
        flat, base, width = greedy_tokens(whole), whole.storage_offset(), whole.shape[1]
        out = []
        for t in logits:
            at = (t.storage_offset() - base) // width
            out.append(flat[at:at + t.shape[0]])
        return out
    if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in logits):
        return [greedy_tokens(t) for t in logits]
    flat = torch.cat([t.argmax(-1).reshape(-1) for t in logits]).tolist()
    out, at = [], 0
    for t in logits:
        n = t.shape[0]
        out.append(flat[at:at + n])
        at += n
    return out


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] (float32, on CPU) after temperature, min_p, top-k and top-p.

    Computed in float64, with the largest logit of each row subtracted before the division by the
    temperature, so every row has a 0 entry and the rest are <= 0 or -inf (exp never overflows, the
    softmax's sum is >= 1). A row whose largest logit is +inf spreads its mass over its +inf entries;
    a row of only -inf is uniform. min_p (vLLM's order: after the temperature, before top-k) drops the
    tokens whose probability is below min_p x the largest one's, i.e. whose shifted, scaled logit is
    below log(min_p); top-k keeps ties with the k-th value; top-p keeps the smallest prefix of the sorted
    tokens whose mass reaches top_p, and at least the first.
    """
    if params.is_greedy:
        logits = logits.detach().to("cpu")
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    x = logits.detach().to("cpu", torch.float64)
    top = x.amax(-1, keepdim=True)
    shifted = x - top  # <= 0, and 0 exactly (only) at the largest logits, for rows whose largest is finite
    if not bool(torch.isfinite(top).all()):
        neg_inf = torch.full_like(x, float("-inf"))
        zero = torch.zeros_like(x)
        shifted = torch.where(torch.isposinf(top), torch.where(torch.isposinf(x), zero, neg_inf), shifted)
        shifted = torch.where(torch.isneginf(top), zero, shifted)
    x = shifted / params.temperature  # 0 stays 0 for any temperature > 0; the rest may become -inf
    if params.min_p > 0:  # p / p_max = exp(x): the largest entries (0) are never dropped
        x = x.masked_fill(x < math.log(params.min_p), float("-inf"))
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))  # a row's largest entry (0) is never below its k-th
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1:
        # Tokens in order of their logits, not of their rounded probabilities: with a huge temperature
        # the largest logits can round to one probability, and the first token must be a largest one.
        order = shifted.sort(dim=-1, descending=True, stable=True).indices
        sorted_probs = probs.gather(-1, order)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        drop = before >= params.top_p
        drop[..., 0] = False  # the most likely token stays, however small top_p is
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs.to(torch.float32)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token from a [V] distribution (non-negative, finite, not all zero).

    torch.multinomial draws argmax(p / Exponential(1)); should the exponential ever be 0, a token of
    probability 0 could win (0 / 0 is NaN, which argmax takes). Such a draw is redrawn, a few times at
    most, then the most likely token is taken. Ordinary draws consume the generator exactly as before.
    """
    for _ in range(MAX_REDRAWS):
        token = int(torch.multinomial(probs, 1, generator=generator).item())
        if probs[token] > 0:
            return token
    return int(probs.argmax().item())
