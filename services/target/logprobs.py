"""The logprobs a target call returns, for the requests that asked (SamplingSpec.logprobs, prompt_logprobs).

A request that asked keeps a `LogprobState`. Per entry of a call, `CallLogprobs.add` scores
(shared/spec/logprobs.py) the rows its pass already computed: a verified tree's rows at its accepted
path's nodes, each for the token emitted there; a prompt's last chunk's last row, for its first
token (not for a resume token, which was emitted before). With prompt logprobs a chunk asks for the
logits at every one of its tokens (`every_row`): row i scores token i + 1, and the chunk's last row
is kept until the next chunk, whose first token it scores. `payload` gives them in result order, as
ForwardReply describes. Requests that did not ask cost nothing: no state, no rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specserve.shared.spec.logprobs import MAX_LOGPROBS, Scored, concat, score
from specserve.shared.wire.messages import PrefillEntry, SamplingSpec, VerifyEntry


@dataclass(slots=True)
class LogprobState:
    top: int  # ranked tokens per position
    prompt: bool  # the prompt tokens' logprobs too
    pending: torch.Tensor | None = None  # the logits row at the previous chunk's last token

    @classmethod
    def of(cls, spec: SamplingSpec) -> LogprobState | None:
        return None if spec.logprobs is None else cls(spec.logprobs, spec.prompt_logprobs)


def check_spec(spec: SamplingSpec) -> str | None:
    """Why a request's logprob fields are refused, or None."""
    if spec.logprobs is not None and not 0 <= spec.logprobs <= MAX_LOGPROBS:
        return f"logprobs must be in 0..{MAX_LOGPROBS}, got {spec.logprobs}"
    if spec.prompt_logprobs and spec.logprobs is None:
        return "prompt_logprobs needs logprobs"
    return None


def every_row(state: LogprobState | None) -> bool:
    """Whether a prompt chunk of this request needs the logits at every one of its tokens."""
    return state is not None and state.prompt


@dataclass(slots=True)
class CallLogprobs:
    rows: dict[int, tuple[Scored | None, Scored | None]] = field(default_factory=dict)  # by result index

    def add(self, index: int, state: LogprobState | None, message: PrefillEntry | VerifyEntry,
            chunk_tokens: Sequence[int], logits: torch.Tensor, emitted: list[int], path: list[int] | None) -> None:
        """One accepted entry: `logits` its rows of the pass, `emitted` its emitted tokens, `path` a tree's
        accepted nodes (None for a prompt chunk)."""
        if state is None:
            return
        if path is not None:
            self.rows[index] = (None, score(logits[path], emitted, state.top))
            return
        assert isinstance(message, PrefillEntry)
        prompt = None
        if state.prompt:
            rows, follow = logits[:-1], list(chunk_tokens[1:])
            if message.start > 0 and state.pending is not None:
                rows, follow = torch.cat([state.pending[None], rows]), [chunk_tokens[0], *follow]
            state.pending = None if message.last else logits[-1].clone()
            prompt = score(rows, follow, state.top) if follow else None
        out = None
        if emitted and message.resume_token is None:
            out = score(logits[-1:], emitted, state.top)
        if prompt is not None or out is not None:
            self.rows[index] = (prompt, out)

    def fields(self, index: int) -> tuple[int, int, int]:
        """Result `index`'s StepResult fields: num_prompt_logprobs, num_logprobs, top_logprobs."""
        prompt, out = self.rows.get(index, (None, None))
        width = prompt.width if prompt is not None else out.width if out is not None else 0
        return (0 if prompt is None else len(prompt.logprobs), 0 if out is None else len(out.logprobs), width)

    def payload(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """"logprobs", "top_ids" and "top_logprobs" of the results `indices`, in that order (nothing when
        none has rows)."""
        parts = [s for index in indices for s in self.rows.get(index, ()) if s is not None]
        if not parts:
            return {}
        rows = concat([Scored(p.logprobs, p.top_ids.reshape(-1), p.top_logprobs.reshape(-1)) for p in parts])
        out = {"logprobs": rows.logprobs.float()}
        if rows.top_ids.numel():
            out["top_ids"], out["top_logprobs"] = rows.top_ids.to(torch.int32), rows.top_logprobs.float()
        return out


__all__ = ["CallLogprobs", "LogprobState", "check_spec", "every_row"]
