"""Commit: a target pass's outputs into the requests, and their tokens to the HTTP handlers.

Per output: an error ends the request (an `out_of_blocks` one is retried up to `MAX_OUT_OF_BLOCKS`
iterations first); a prompt chunk that was not the last only advances `prefilled`; the last chunk and a
verified tree emit their tokens, cut at a stop id (an EOS id, dropped; one of the request's stop_token_ids,
kept; neither before min_tokens), at max_tokens and where the request's grammar ends (its stop token).
The features a pass returned are written into the request's FeatureLog by position. Logprobs follow
their tokens (cut with them); a prompt's logprobs are kept by position until its first token carries
them (a prompt chunk prefilled again after a preemption does not send its positions twice). A
prompt chunk's tokens taken from the target's prefix cache are counted and taught to the mirror of it
(prefix.py).
"""

from __future__ import annotations

import logging

from specserve.gateway.engine import ahead
from specserve.gateway.engine.request import GenRequest, Tokens
from specserve.gateway.engine.table import RequestTable
from specserve.gateway.obs.metrics import GatewayMetrics
from specserve.gateway.perf.record import RequestStep
from specserve.shared.spec.feature_log import FeatureLog
from specserve.shared.wire.logprobs import TokenLogprobs
from specserve.shared.wire.service_client import StepOutput

log = logging.getLogger("specserve.gateway")
MAX_OUT_OF_BLOCKS = 200  # iterations a request may be refused for KV room before it is ended


class Commit:
    def __init__(self, table: RequestTable, metrics: GatewayMetrics):
        self.table, self.metrics = table, metrics

    def outputs(self, outputs: list[StepOutput], prefill_len: dict[str, int], steps: dict[str, RequestStep],
                now: float, step: int) -> None:
        """One replica's outputs of iteration `step`; `steps`: the record's entry per request in the pass."""
        for out in outputs:
            r = self.table.requests.get(out.rid)
            entry = steps.get(out.rid)
            if r is None or r.finish_reason is not None or entry is None:
                continue  # aborted while the call ran; released next iteration
            if not ahead.settle(r, out.step, out.error is None):
                continue  # sent a step ahead on a state that did not come true (engine/ahead.py)
            if out.error is not None:
                entry.error = out.error.code
                if out.error.code == "out_of_blocks":
                    r.out_of_blocks += 1  # retried next iteration, but not forever
                    if r.out_of_blocks <= MAX_OUT_OF_BLOCKS:
                        continue
                self.metrics.on_error(out.error.code)
                self.table.finish(r, "error", f"{out.error.code}: {out.error.message}")
                continue
            entry.emitted = len(out.tokens)
            if out.features is not None:  # at the chunk's start, or at the verified tree's root
                r.features = r.features or FeatureLog()
                r.features.write(r.committed - 1 if entry.verified else r.prefilled, out.features)
            if out.prompt_logprobs is not None and not entry.verified:
                keep_prompt_logprobs(r, r.prefilled, out.prompt_logprobs)
            if not entry.verified and r.replica is not None:  # a prompt chunk: what it found in the prefix cache
                entry.prompt_tokens = prefill_len[out.rid] - out.num_cached
                self.table.prefix.chunk_done(r, self.table.pool.targets[r.replica], r.prefilled,
                                             r.prefilled + prefill_len[out.rid], out.num_cached)
            if entry.verified:
                entry.accepted = out.num_accepted
                r.accepted.append(out.num_accepted)
                r.verified.append((step, entry.verified))
            elif not out.tokens:  # a prompt chunk that was not the last
                r.prefilled += prefill_len[out.rid]
                continue
            elif r.resuming:  # its KV is rebuilt; the token it returned is the one it had
                r.resuming, r.prefilled, entry.emitted = False, len(r.prompt), 0
                continue
            else:
                r.prefilled = len(r.prompt)
                self.metrics.on_first_token(now - r.arrival)
            self.emit(r, out.tokens, now, out.logprobs)
            ahead.resolve(r, out.step)  # an entry sent ahead on a guess of this output: what it verifies

    def emit(self, r: GenRequest, tokens: list[int], now: float, logprobs: TokenLogprobs | None = None) -> None:
        """New tokens to the request and its handler, up to a stop id or max_tokens (which end it), with their
        logprobs; the first carry the prompt's, if it asked."""
        first = not r.output
        keep: list[int] = []
        reason: str | None = None
        for t in tokens:
            if t in r.stop_ids and len(r.output) + len(keep) >= r.sampling.min_tokens:
                reason = "stop"
                break
            if r.grammar is not None:  # structured output: the grammar follows every token, and ends the output
                reason = _grammar_end(r, t)
                if reason is not None:
                    break
            keep.append(t)
            if len(r.output) + len(keep) >= r.max_tokens:
                reason = "length"
                break
            if t in r.stop_kept and len(r.output) + len(keep) > r.sampling.min_tokens:
                reason = "stop"
                break
        if not first and keep:
            self.metrics.on_tokens(len(keep), now - r.token_times[-1])
        if first:  # the draft has seen nothing yet: its first call carries the prompt too
            r.draft_unsent = list(r.prompt)
        r.output.extend(keep)
        r.token_times.extend([now] * len(keep))
        r.draft_unsent.extend(keep)
        prompt_logprobs = r.prompt_logprobs if first else None
        if r.final_only:  # (it asked for no logprobs)
            r.held.extend(keep)
        elif keep or prompt_logprobs is not None:
            r.events.put_nowait(Tokens(keep, None if logprobs is None else logprobs.head(len(keep)), prompt_logprobs))
        if first:
            r.prompt_logprobs = None
        if reason is not None:
            self.table.finish(r, reason)


def _grammar_end(r: GenRequest, token: int) -> str | None:
    """Advance the request's grammar by an emitted token: "stop" where the token is its stop token (the output
    is complete; the token is not part of it), or where the grammar does not allow it: the target had no
    token to choose that both the grammar and the request's other fields allow (a grammar at a dead end, or
    one that allows only its end or a stop token id that min_tokens forbids), so the output ends with what
    the grammar allowed and the token is dropped; else None."""
    assert r.grammar is not None
    if not r.grammar.accept(token):
        if not r.grammar.dead_end():
            log.warning("request %s: token %d is outside its grammar (min_tokens or stop_token_ids left its mask "
                        "nothing to choose?); its output ends there", r.rid, token)
        return "stop"
    return "stop" if r.grammar.terminated else None


def keep_prompt_logprobs(r: GenRequest, start: int, rows: TokenLogprobs) -> None:
    """A prompt chunk's logprobs (from position max(start, 1) on) into the request's, the positions it has
    already left out."""
    have = r.prompt_logprobs
    if have is None:
        have = r.prompt_logprobs = TokenLogprobs([], [], [])
    skip = len(have) + 1 - max(start, 1)  # the first position it lacks is len(have) + 1
    if skip >= 0:
        have.extend(rows.tail(skip))


__all__ = ["MAX_OUT_OF_BLOCKS", "Commit", "keep_prompt_logprobs"]
