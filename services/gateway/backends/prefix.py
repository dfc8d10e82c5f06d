"""`PrefixMirror`: what one target replica's prefix cache holds, as the gateway can tell without asking.

A target keeps its requests' full KV blocks of committed tokens in a prefix cache, keyed by the hash of
each block's tokens and of every token before them (shared/runtime/block_hash.py), evicting the least
recently used when it needs the room (shared/runtime/block_manager.py). The gateway sees every token it
sends, so it keeps the same keys per replica, as SGLang's router keeps an approximate radix tree of each
worker's cache: the keys of the blocks a replica's requests filled (their prompt as it is prefilled, their
output when they end), least recently used first, trimmed to the count the replica reports after each
pass (`ForwardReply.cached_blocks`; its own LRU evicts in about the same order). It is an estimate for
pricing and routing only: the target takes from its cache whatever it really holds and computes the rest
(which it then holds), so a wrong guess costs time, never correctness. A replica that (re)connects starts
with an empty mirror.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixMirror:
    def __init__(self) -> None:
        self.enabled = False  # the replica keeps a prefix cache (its Stats say so), with the gateway's block size
        self._keys: OrderedDict[bytes, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of a sequence with these keys the replica holds."""
        held = self._keys
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def insert(self, keys: Iterable[bytes]) -> None:
        """Blocks the replica has cached or used now: held, most recently used (the last key most of all)."""
        held = self._keys
        for key in keys:
            held[key] = None
            held.move_to_end(key)

    def trim(self, count: int) -> None:
        """Keep at most `count` keys, dropping the least recently used (the replica holds that many)."""
        held = self._keys
        while len(held) > max(count, 0):
            held.popitem(last=False)

    def reset(self, enabled: bool) -> None:
        """A (re)connected replica: nothing known of its cache; `enabled` when it keeps one."""
        self.enabled = enabled
        self._keys.clear()


__all__ = ["PrefixMirror"]
