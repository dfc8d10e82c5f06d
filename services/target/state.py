"""A request's state in the target service between calls, and the sampling parameters it decodes with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.shared.spec.penalties import TokenHistory
from specserve.shared.spec.sampling import SamplingParams
from specserve.shared.wire.messages import SamplingSpec
from specserve.target.logprobs import LogprobState


def params_of(spec: SamplingSpec) -> SamplingParams:
    """A request's sampling parameters (ValueError for values the sampler does not take)."""
    stops = tuple(dict.fromkeys([*spec.stop_token_ids, *spec.eos_ids])) if spec.min_tokens > 0 else ()
    return SamplingParams(spec.temperature, spec.top_p, spec.top_k, spec.seed, spec.min_p, spec.repetition_penalty,
                          spec.presence_penalty, spec.frequency_penalty, spec.min_tokens, stops)


@dataclass(slots=True)
class TargetRequest:
    """A request's state in the target between calls."""

    params: SamplingParams
    generator: torch.Generator | None
    prefilled: int = 0  # prompt tokens in the KV cache
    committed: int = 0  # prompt + output tokens once decoding (the KV holds committed - 1)
    last_token: int = -1  # the newest committed token: the next tree's root
    last_step: int = -1
    history: TokenHistory | None = None  # with penalties or min_tokens: its tokens as they read them
    logprobs: LogprobState | None = None  # only for a request that asked for logprobs
    plain: bool = False  # greedy, no history, no logprobs: its decodes skip the per-entry layers (_plain_decodes)

    @property
    def decoding(self) -> bool:
        return self.committed > 0
