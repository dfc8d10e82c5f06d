"""Paged-KV block allocator: fixed-size blocks, per-request block tables, an exact free count.

The block manager only does bookkeeping (which physical block holds which request's slots); the
tensors live in `kv_cache.KVCache`. A request's slots are numbered 0..num_slots-1 in the order of
its sequence; slot s lives in physical block `table[s // block_size]` at offset `s % block_size`.

NOTE: every mutating call either succeeds completely or raises before changing anything, so an
`OutOfBlocks` error leaves the manager exactly as it was and the caller can act (preempt, queue,
refuse) without cleaning up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks for the requested slots. Nothing was allocated."""

    def __init__(self, needed: int, free: int, request_ids: list[str] | None = None):
        self.needed = needed  # blocks
        self.free = free  # blocks
        self.request_ids = request_ids or []
        super().__init__(f"out of KV blocks: need {needed}, {free} free (requests {self.request_ids})")


class UnknownRequest(KeyError):
    """The request id has no KV state here."""


@dataclass(slots=True)
class _Allocation:
    num_slots: int = 0
    blocks: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO free list: recently freed blocks are reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._requests: dict[str, _Allocation] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def num_slots(self, request_id: str) -> int:
        return self._get(request_id).num_slots

    def block_table(self, request_id: str) -> list[int]:
        return list(self._get(request_id).blocks)

    def blocks_needed(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def extra_blocks_for(self, request_id: str, extra_slots: int) -> int:
        """Blocks that appending `extra_slots` to the request would allocate (request may be new)."""
        alloc = self._requests.get(request_id)
        have_slots = alloc.num_slots if alloc else 0
        have_blocks = len(alloc.blocks) if alloc else 0
        return max(0, self.blocks_needed(have_slots + extra_slots) - have_blocks)

    def physical_slots(self, request_id: str, start: int, count: int) -> list[int]:
        """Physical slot indices (block * block_size + offset) of logical slots start..start+count-1."""
        alloc = self._get(request_id)
        if start < 0 or start + count > alloc.num_slots:
            raise IndexError(f"slots {start}..{start + count} outside 0..{alloc.num_slots} of {request_id}")
        bs, blocks = self.block_size, alloc.blocks
        return [blocks[s // bs] * bs + s % bs for s in range(start, start + count)]

    # ---- mutations -----------------------------------------------------------------------
    def add(self, request_id: str) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already has KV state")
        self._requests[request_id] = _Allocation()

    def append_slots(self, counts: Mapping[str, int]) -> None:
        """Grow each request by counts[request_id] slots, atomically across all of them.

        Requests not yet known are added. Raises OutOfBlocks (changing nothing) when the free
        blocks cannot cover the whole batch.
        """
        needed = 0
        for rid, n in counts.items():
            if n < 0:
                raise ValueError(f"negative slot count {n} for {rid!r}")
            needed += self.extra_blocks_for(rid, n)
        if needed > len(self._free):
            raise OutOfBlocks(needed, len(self._free), list(counts))
        for rid, n in counts.items():
            alloc = self._requests.setdefault(rid, _Allocation())
            alloc.num_slots += n
            for _ in range(self.blocks_needed(alloc.num_slots) - len(alloc.blocks)):
                alloc.blocks.append(self._free.pop())

    def truncate(self, request_id: str, num_slots: int) -> None:
        """Shrink the request to its first `num_slots` slots and free the blocks past them."""
        alloc = self._get(request_id)
        if not 0 <= num_slots <= alloc.num_slots:
            raise ValueError(f"cannot truncate {request_id!r} from {alloc.num_slots} to {num_slots} slots")
        alloc.num_slots = num_slots
        keep = self.blocks_needed(num_slots)
        while len(alloc.blocks) > keep:
            self._free.append(alloc.blocks.pop())

    def free(self, request_id: str) -> None:
        alloc = self._requests.pop(request_id, None)
        if alloc is None:
            raise UnknownRequest(request_id)
        self._free.extend(reversed(alloc.blocks))

    def _get(self, request_id: str) -> _Allocation:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequest(request_id) from None

    def check_invariants(self) -> None:
        """Every block is either free or owned by exactly one request; counts match slots."""
        owned = [b for a in self._requests.values() for b in a.blocks]
        everything = owned + self._free
        assert len(everything) == self.num_blocks == len(set(everything)), "block leaked or double-owned"
        for rid, a in self._requests.items():
            assert len(a.blocks) == self.blocks_needed(a.num_slots), f"{rid}: blocks do not match slots"
