"""Prefix caching as the engine sees it: what each replica's prefix cache is expected to hold of a request,
and the mirror of it (backends/prefix.py) kept up to date from what the passes do.

- Before pricing: `expected(r, replica)` is the tokens of the request's context a replica holds (its
  leading full blocks in the mirror), its last token always left to compute (the first output token needs
  its logits). The snapshot gives every waiting request's figure per replica (`WaitingView.cached`), so
  that SLO admission and the router price it at its uncached prompt only and the router can send it where
  its history is (`sched/routing.py`).
- At admission the request keeps its replica's figure (`GenRequest.cached`): its first prompt chunk
  covers those tokens and the planned ones after them; the target takes what it really holds from its
  cache and computes the rest (`StepResult.num_cached`, counted in vLLM's `prefix_cache_queries` /
  `prefix_cache_hits`).
- The mirror learns the blocks a request fills: its prompt as chunks come back (a chunk that found less
  than expected computed the rest, which the replica holds now), its output when it leaves the replica.

Nothing is expected while the passes return features (an EAGLE draft reads every prompt token's, and the
target computes them all), nor for a request that asks for prompt logprobs (every prompt row is computed).
"""

from __future__ import annotations

from specserve.gateway.backends.pool import ServicePool, TargetReplica
from specserve.gateway.engine.request import GenRequest
from specserve.gateway.obs.metrics import GatewayMetrics

PRICED_WAITING = 64  # waiting requests (in order) whose cached prompt is looked up for each plan


class PrefixCaches:
    def __init__(self, pool: ServicePool, metrics: GatewayMetrics):
        self.pool, self.metrics = pool, metrics

    def _usable(self, replica: TargetReplica) -> bool:
        draft = self.pool.draft
        return (replica.prefix.enabled and len(replica.prefix) > 0 and replica.block_size == self.pool.block_size
                and not (draft is not None and draft.reads_features))

    def usable(self) -> list[bool]:
        """Per replica, by index: whether its prefix cache is priced now (enabled, holding something, at the
        gateway's block size, and no draft that reads features)."""
        return [self._usable(t) for t in self.pool.targets]

    def expected(self, r: GenRequest, replica: TargetReplica) -> int:
        """Tokens of the request's context the replica is expected to hold in its prefix cache."""
        if not self._usable(replica) or r.prefill_sampling.prompt_logprobs:  # (those need every prompt row)
            return 0
        return self._held(r, replica)

    def per_replica(self, r: GenRequest, usable: list[bool] | None = None) -> tuple[int, ...]:
        """`expected` on every replica, by index (empty when no replica has anything cached). `usable`: what
        `usable()` said, for a snapshot that asks for many requests."""
        usable = self.usable() if usable is None else usable
        if not any(usable):
            return ()
        if r.prefill_sampling.prompt_logprobs:
            return (0,) * len(usable)
        return tuple(self._held(r, t) if ok else 0 for t, ok in zip(self.pool.targets, usable))

    @staticmethod
    def _held(r: GenRequest, replica: TargetReplica) -> int:
        bs = replica.block_size
        return replica.prefix.match(r.keys(bs, len(r.context) - 1)) * bs

    def admitted(self, r: GenRequest, replica: TargetReplica) -> None:
        """Bound to the replica: its first chunk starts from what the replica is expected to hold there."""
        r.cached = self.expected(r, replica)
        if r.cached:
            replica.prefix.insert(r.keys(replica.block_size, r.cached))  # used again: most recently used

    def chunk_done(self, r: GenRequest, replica: TargetReplica, start: int, end: int, num_cached: int) -> None:
        """A prompt chunk of tokens `start` to `end` came back, `num_cached` of them from the replica's cache:
        the counters, and the mirror learns the chunk's whole blocks (the replica keeps what it computed)."""
        if not replica.prefix.enabled:
            return
        if not r.resuming:  # (a preempted request's prompt is served already)
            r.cached_tokens += num_cached
        self.metrics.on_prefix_cache(end - start, num_cached)  # every prompt token is queried once, in its chunk
        if replica.block_size == self.pool.block_size:
            replica.prefix.insert(r.keys(replica.block_size, end))

    def released(self, r: GenRequest, replica: TargetReplica) -> None:
        """The request left the replica: the blocks of every committed token but the newest stay in its cache
        (tail first, so the mirror drops a sequence's tail before its head, as the replica evicts)."""
        if not replica.prefix.enabled or replica.block_size != self.pool.block_size:
            return
        held = r.committed - 1 if r.output and not r.resuming else r.prefilled  # the KV it had there
        replica.prefix.insert(reversed(r.keys(replica.block_size, held)))

    def trim(self, replica: TargetReplica, cached_blocks: int) -> None:
        """After a pass: the replica holds `cached_blocks` cached blocks; the mirror keeps at most as many."""
        replica.prefix.trim(cached_blocks)


__all__ = ["PRICED_WAITING", "PrefixCaches"]
