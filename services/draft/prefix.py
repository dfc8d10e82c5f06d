"""The draft's prefix cache (`--no-prefix-caching` turns it off): the model draft's KV pool keys its
blocks of committed tokens (shared/runtime/block_manager.py) as the target's does.

Before a call's catch-up, a request whose KV fills whole cached blocks (a new one holds none) takes the
cached blocks of its next committed tokens instead of computing them, less the newest committed token,
whose logits the beam's root needs. After the catch-up, its full blocks of committed tokens (the newest
one's block excluded: a call with nothing new re-runs that token) enter the cache. Assumed tokens
(drafting ahead) and beam nodes never do. The n-gram and EAGLE drafts keep no block pool and no cache.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypedDict

from specserve.shared.runtime.runner import ModelRunner
from specserve.shared.wire.messages import ErrorInfo, SpeculateEntry


class Synced(Protocol):
    tokens: list[int]  # every committed token received (then the assumed ones, during a call)
    synced: int  # leading tokens whose KV is in the pool


def take_cached(enabled: bool, runner: ModelRunner, requests: Mapping[str, Synced],
                entries: Sequence[SpeculateEntry], failed: dict[str, ErrorInfo],
                failure: Callable[[str, str, Exception], ErrorInfo]) -> int:
    """With the cache `enabled`, each entry's next committed tokens from the cache where it holds them;
    returns the tokens taken. A request whose lookup raises goes to `failed` (with `failure`'s error)."""
    taken = 0
    for entry in entries if enabled else ():
        try:
            req = requests[entry.rid]
            limit = min(entry.num_committed, len(req.tokens)) - 1 - req.synced  # the newest one computed
            if limit < runner.blocks.block_size:
                continue
            got = runner.adopt_prefix(entry.rid, req.tokens[req.synced:], limit)
            req.synced += got
            taken += got
        except Exception as exc:
            failed[entry.rid] = failure(entry.rid, "the prefix cache lookup", exc)
    return taken


def cache_committed(enabled: bool, runner: ModelRunner, requests: Mapping[str, Synced],
                    entries: Sequence[SpeculateEntry]) -> None:
    """With the cache `enabled`, key the entries' full blocks of committed tokens, the newest one's excluded."""
    for entry in entries if enabled else ():
        req = requests.get(entry.rid)
        if req is not None and runner.has_request(entry.rid):
            runner.cache_prefix(entry.rid, min(req.synced, entry.num_committed - 1))


class CacheStats(TypedDict):
    prefix_caching: bool
    cached_blocks: int
    evictable_blocks: int


def cache_stats(runner: object, enabled: bool) -> CacheStats:
    """The prefix cache's fields of the draft's Stats reply: none while its pool is offloaded, or for a
    draft that keeps no block pool."""
    pool = runner.blocks if isinstance(runner, ModelRunner) else None
    return CacheStats(prefix_caching=enabled and pool is not None,
                      cached_blocks=pool.num_cached_blocks if pool is not None else 0,
                      evictable_blocks=pool.num_evictable_blocks if pool is not None else 0)


__all__ = ["cache_committed", "cache_stats", "take_cached"]
