"""Sampling parameters and the target distribution they define over next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 or negative: no top-k limit
    seed: int | None = None  # per-request seed; None draws from torch's global generator

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self) -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator().manual_seed(self.seed)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] (float32, on CPU) after temperature, top-k and top-p."""
    logits = logits.detach().to("cpu", torch.float32)
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
