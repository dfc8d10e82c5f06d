"""`TokenLogprobs`: the logprobs of consecutive token positions, as the gateway carries them.

The target returns them as flat payload tensors of its ForwardReply ("logprobs", "top_ids",
"top_logprobs"; shared/wire/messages.py, StepResult); `cut` turns those into one `TokenLogprobs` per
result, which then travel unchanged from the engine to the HTTP side (and over the front ends' link:
a msgspec Struct, encoded as arrays).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from specserve.shared.wire.messages import StepResult


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Per position: the logprob of its token, and the most likely tokens there, most likely first."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def __len__(self) -> int:
        return len(self.logprobs)

    def head(self, n: int) -> TokenLogprobs:
        """The first n positions."""
        return TokenLogprobs(self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n])

    def tail(self, start: int) -> TokenLogprobs:
        """The positions from `start` on."""
        return TokenLogprobs(self.logprobs[start:], self.top_ids[start:], self.top_logprobs[start:])

    def extend(self, other: TokenLogprobs) -> None:
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs


def cut(payload: dict[str, torch.Tensor],
        results: Sequence[StepResult]) -> list[tuple[TokenLogprobs | None, TokenLogprobs | None]]:
    """Per result, (its prompt positions' logprobs, its emitted tokens' logprobs); None where it has none."""
    out: list[tuple[TokenLogprobs | None, TokenLogprobs | None]] = []
    if "logprobs" not in payload:
        return [(None, None)] * len(results)
    chosen: list[float] = payload["logprobs"].tolist()
    ids: list[int] = payload["top_ids"].tolist() if "top_ids" in payload else []
    values: list[float] = payload["top_logprobs"].tolist() if "top_logprobs" in payload else []
    row = flat = 0
    for r in results:
        parts: list[TokenLogprobs | None] = []
        for n in (r.num_prompt_logprobs, r.num_logprobs):
            if not n:
                parts.append(None)
                continue
            k = r.top_logprobs
            parts.append(TokenLogprobs(chosen[row:row + n],
                                       [ids[flat + i * k: flat + (i + 1) * k] for i in range(n)],
                                       [values[flat + i * k: flat + (i + 1) * k] for i in range(n)]))
            row, flat = row + n, flat + n * k
        out.append((parts[0], parts[1]))
    return out


__all__ = ["TokenLogprobs", "cut"]
