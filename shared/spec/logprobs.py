"""Log-probabilities of tokens under the target's raw next-token distribution (vLLM v1's "raw" logprobs).

`score` takes the logits rows the target computed at some positions and the token that follows each
position, and returns each token's log-probability with the `top` most likely tokens of its row:
log_softmax of the raw logits in float32, before temperature, top-p or top-k, so a token's logprob
is the same whatever the request's sampling parameters. Under speculation a token's row is the
verification pass's row at the tree node that emitted it, which the kernels compute the same
whatever shares the pass: the logprobs are the same under every speculation policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # the most ranked tokens a request may ask for per position (vLLM's max_logprobs)


@dataclass(slots=True)
class Scored:
    """Per position: the logprob of its token, and its row's most likely tokens, most likely first."""

    logprobs: torch.Tensor  # [n] float32
    top_ids: torch.Tensor  # [n, k] int32
    top_logprobs: torch.Tensor  # [n, k] float32

    @property
    def width(self) -> int:
        return int(self.top_ids.shape[1])


def score(logits: torch.Tensor, tokens: Sequence[int], top: int) -> Scored:
    """logits [n, V] (row i: the target's logits at the position before tokens[i]); top: ranked tokens
    per row (at most V). Results on the CPU. Rows that are not logits (the simulated target's: one
    true token per row, an integer tensor) give each token a certain logprob of 0 and itself as the
    only ranked token."""
    n = len(tokens)
    ids = torch.as_tensor(list(tokens), dtype=torch.int64)
    if not logits.is_floating_point():
        width = min(top, 1)
        return Scored(torch.zeros(n), ids.to(torch.int32).reshape(n, 1)[:, :width].clone(), torch.zeros(n, width))
    rows = torch.log_softmax(logits.detach().reshape(n, -1).float(), dim=-1)
    chosen = rows.gather(1, ids.to(rows.device).reshape(n, 1)).reshape(n)
    width = min(top, rows.shape[1])
    values, indices = torch.topk(rows, width, dim=-1) if width else (rows[:, :0], rows[:, :0].long())
    return Scored(chosen.cpu(), indices.to(torch.int32).cpu(), values.cpu())


def concat(parts: Sequence[Scored]) -> Scored:
    """Rows of several `Scored` of one width, in order."""
    return Scored(torch.cat([p.logprobs for p in parts]), torch.cat([p.top_ids for p in parts]),
                  torch.cat([p.top_logprobs for p in parts]))


__all__ = ["MAX_LOGPROBS", "Scored", "concat", "score"]
