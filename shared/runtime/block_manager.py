"""Paged-KV block allocator: fixed-size blocks, per-request block tables, an exact free count, and an
automatic prefix cache.

The block manager only does bookkeeping (which physical block holds which request's slots); the
tensors live in `kv_cache.KVCache`. A request's slots are numbered 0..num_slots-1 in the order of
its sequence; slot s lives in physical block `table[s // block_size]` at offset `s % block_size`.

**Prefix cache** (vLLM's automatic prefix caching): `cache` gives a request's full blocks of committed
tokens a key (block_hash.py: the hash of the block's tokens and of every token before them). A keyed
block is immutable and may be shared: `adopt` gives a request the cached blocks of the longest cached
prefix of its next tokens, each block counting its holders (a reference count). When its last holder
lets it go, a keyed block is not freed but kept, evictable, in least-recently-used order; an allocation
that finds no plain free block evicts the least recently used one (its key is forgotten). A request
frees its blocks tail first, so a sequence's last blocks are evicted before its first ones (a prefix is
useful without its tail, a tail never without its prefix). Evictable blocks count as free: they are
allocatable at once (`num_free_blocks`; `num_evictable_blocks` says how many of them hold a cached block).

Only the caller decides what is keyed (the runner keys committed tokens only), and a request never
writes into a keyed block: `adopt` takes whole blocks, so its own writes start in a new block, and
`truncate` into a keyed block forgets the key when the request is its only holder (it may write there
again) and refuses when the block is shared.

**Block tables as one array** (`block_tables`): every request's table is also a row of one int32 NumPy
array, kept up to date as blocks are taken and let go, so a pass reads the tables of its batch with one
indexing operation instead of converting each request's list.

NOTE: every mutating call either succeeds completely or raises before changing anything, so an
`OutOfBlocks` error leaves the manager exactly as it was and the caller can act (preempt, queue,
refuse) without cleaning up.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from specserve.shared.runtime.block_hash import ROOT, chain


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
    row: int = 0  # its row of the manager's table array
    hashes: list[bytes] = field(default_factory=list)  # the keys of its leading full blocks that `cache` keyed


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO free list of blocks holding nothing: recently freed blocks are reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks  # requests holding each block
        self._key_of: dict[int, bytes] = {}  # block -> its prefix-cache key (keyed blocks only)
        self._block_of: dict[bytes, int] = {}  # key -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed, held by nobody; least recently used first
        self._requests: dict[str, _Allocation] = {}
        self._tables = np.zeros((16, 8), dtype=np.int32)  # row r: the blocks of the request holding row r, then 0s
        self._spare_rows = list(range(15, -1, -1))
        self.evictions = 0  # cached blocks evicted since start

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: plain free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a prefix-cache key, held by requests or evictable."""
        return len(self._block_of)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no request holds (counted in `num_free_blocks`)."""
        return len(self._evictable)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def num_slots(self, request_id: str) -> int:
        return self._get(request_id).num_slots

    def block_table(self, request_id: str) -> list[int]:
        return list(self._get(request_id).blocks)

    def block_keys(self, request_id: str) -> list[bytes]:
        """The keys of the request's leading full blocks that `cache` (or `adopt`) keyed."""
        return list(self._get(request_id).hashes)

    def block_tables(self, request_ids: Sequence[str]) -> np.ndarray:
        """The requests' block tables as rows of one int32 array [len(request_ids), the longest table's length],
        each padded with 0 (a copy)."""
        allocs = [self._get(rid) for rid in request_ids]
        width = max((len(a.blocks) for a in allocs), default=0)
        return self._tables[[a.row for a in allocs], :width]

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
        self._new(request_id)

    def append_slots(self, counts: Mapping[str, int]) -> None:
        """Grow each request by counts[request_id] slots, atomically across all of them.

        Requests not yet known are added. Raises OutOfBlocks (changing nothing) when the free
        blocks (evictable cached ones included) cannot cover the whole batch.
        """
        needed = 0
        for rid, n in counts.items():
            if n < 0:
                raise ValueError(f"negative slot count {n} for {rid!r}")
            needed += self.extra_blocks_for(rid, n)
        if needed > self.num_free_blocks:
            raise OutOfBlocks(needed, self.num_free_blocks, list(counts))
        for rid, n in counts.items():
            alloc = self._requests.get(rid) or self._new(rid)
            alloc.num_slots += n
            had = len(alloc.blocks)
            for _ in range(self.blocks_needed(alloc.num_slots) - had):
                alloc.blocks.append(self._take())
            self._write_row(alloc, had)

    def append_one(self, request_ids: Sequence[str]) -> list[int]:
        """`append_slots` of one slot for each of the requests (known ones, each named once): returns each one's
        slot count before. A request whose blocks are full takes a new one; OutOfBlocks (changing nothing) when
        the free blocks cannot cover them all."""
        allocs = [self._get(rid) for rid in request_ids]
        starts = [a.num_slots for a in allocs]
        full = self._full(allocs)
        if len(full) > self.num_free_blocks:
            raise OutOfBlocks(len(full), self.num_free_blocks, list(request_ids))
        for a in allocs:
            a.num_slots += 1
        for a in full:
            a.blocks.append(self._take())
            self._write_row(a, len(a.blocks) - 1)
        return starts

    def new_blocks_for_one(self, request_ids: Sequence[str]) -> int:
        """Blocks that `append_one(request_ids)` would take."""
        return len(self._full([self._get(rid) for rid in request_ids]))

    def truncate(self, request_id: str, num_slots: int) -> None:
        """Shrink the request to its first `num_slots` slots and let go of the blocks past them. A kept
        block cut part way that is keyed loses its key (the request writes there again); a shared one
        cannot be cut (ValueError, nothing changed)."""
        alloc = self._get(request_id)
        if not 0 <= num_slots <= alloc.num_slots:
            raise ValueError(f"cannot truncate {request_id!r} from {alloc.num_slots} to {num_slots} slots")
        keep = self.blocks_needed(num_slots)
        cut = alloc.blocks[keep - 1] if num_slots % self.block_size else None  # the last kept block, partial now
        if cut is not None and cut in self._key_of and self._refs[cut] > 1:
            raise ValueError(f"cannot truncate {request_id!r} to {num_slots} slots: block {cut} is a shared "
                             "cached block")
        alloc.num_slots = num_slots
        if len(alloc.blocks) > keep:
            self._tables[alloc.row, keep:len(alloc.blocks)] = 0
        while len(alloc.blocks) > keep:
            self._drop(alloc.blocks.pop())
        del alloc.hashes[num_slots // self.block_size:]
        if cut is not None and cut in self._key_of:
            del self._block_of[self._key_of.pop(cut)]

    def free(self, request_id: str) -> None:
        alloc = self._requests.pop(request_id, None)
        if alloc is None:
            raise UnknownRequest(request_id)
        for block in reversed(alloc.blocks):  # tail first: the least recently used among them
            self._drop(block)
        self._tables[alloc.row, :len(alloc.blocks)] = 0
        self._spare_rows.append(alloc.row)

    # ---- the prefix cache ----------------------------------------------------------------
    def cache(self, request_id: str, tokens: Sequence[int], num_tokens: int) -> int:
        """Key the request's full blocks among its first `num_tokens` slots (`tokens[s]`: slot s's token),
        beyond those keyed already; returns how many blocks entered the cache. A block whose key another
        block holds stays out of the cache (the request keeps its own copy; the chain goes on)."""
        alloc = self._get(request_id)
        bs, have = self.block_size, len(alloc.hashes)
        full = min(num_tokens, alloc.num_slots, len(tokens)) // bs
        if full <= have:
            return 0
        added = 0
        parent = alloc.hashes[-1] if have else ROOT
        for i, key in enumerate(chain(tokens[have * bs: full * bs], bs, parent), start=have):
            alloc.hashes.append(key)
            block = alloc.blocks[i]
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key], self._key_of[block] = block, key
                added += 1
        return added

    def cached_tokens(self, tokens: Sequence[int], parent: bytes = ROOT) -> int:
        """How many leading tokens of `tokens` (a whole number of blocks) the cache holds."""
        n = 0
        for key in chain(tokens, self.block_size, parent):
            if key not in self._block_of:
                break
            n += self.block_size
        return n

    def adopt(self, request_id: str, tokens: Sequence[int], limit: int) -> int:
        """Give the request the cached blocks of the longest cached prefix of `tokens`, its next tokens (at
        most `limit` of them): a new request, or one whose slots fill whole keyed blocks (else nothing is
        taken). Returns the tokens it now holds from the cache, a whole number of blocks."""
        alloc = self._requests.get(request_id)
        bs = self.block_size
        if alloc is not None and (alloc.num_slots % bs or len(alloc.hashes) * bs != alloc.num_slots):
            return 0
        parent = alloc.hashes[-1] if alloc is not None and alloc.hashes else ROOT
        found: list[tuple[bytes, int]] = []
        for key in chain(tokens[: max(0, min(limit, len(tokens)))], bs, parent):
            block = self._block_of.get(key)
            if block is None:
                break
            found.append((key, block))
        if not found:
            return 0
        alloc = self._requests.get(request_id) or self._new(request_id)
        had = len(alloc.blocks)
        for key, block in found:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            alloc.blocks.append(block)
            alloc.hashes.append(key)
        alloc.num_slots += len(found) * bs
        self._write_row(alloc, had)
        return len(found) * bs

    # ---- internals -----------------------------------------------------------------------
    def _new(self, request_id: str) -> _Allocation:
        """A request's empty allocation, with a row of the table array (which grows by doubling)."""
        if not self._spare_rows:
            rows = len(self._tables)
            self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)])
            self._spare_rows = list(range(2 * rows - 1, rows - 1, -1))
        alloc = self._requests[request_id] = _Allocation(row=self._spare_rows.pop())
        return alloc

    def _write_row(self, alloc: _Allocation, start: int) -> None:
        """Copy the request's blocks from index `start` on into its row (the array widens by doubling)."""
        n = len(alloc.blocks)
        if n > self._tables.shape[1]:
            width = max(n, 2 * self._tables.shape[1])
            self._tables = np.pad(self._tables, ((0, 0), (0, width - self._tables.shape[1])))
        if n > start:
            self._tables[alloc.row, start:n] = alloc.blocks[start:]

    def _full(self, allocs: list[_Allocation]) -> list[_Allocation]:
        """The allocations whose blocks are full (their next slot takes a new block)."""
        bs = self.block_size
        return [a for a in allocs if a.num_slots == len(a.blocks) * bs]

    def _take(self) -> int:
        """One block for a new slot: a plain free one, else the least recently used cached one (evicted)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.evictions += 1
        self._refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        """One holder lets the block go: with none left it is free, or evictable (most recently used) if cached."""
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _get(self, request_id: str) -> _Allocation:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequest(request_id) from None

    def check_invariants(self) -> None:
        """Every block is free, evictable or held; a held block's count is its holders; keys are consistent;
        counts match slots."""
        holders = [0] * self.num_blocks
        for rid, a in self._requests.items():
            assert len(a.blocks) == self.blocks_needed(a.num_slots), f"{rid}: blocks do not match slots"
            assert len(set(a.blocks)) == len(a.blocks), f"{rid}: a block twice in one table"
            assert len(a.hashes) <= a.num_slots // self.block_size, f"{rid}: a key past its full blocks"
            for b in a.blocks:
                holders[b] += 1
            assert self._tables[a.row, :len(a.blocks)].tolist() == a.blocks, f"{rid}: its table row disagrees"
            assert not self._tables[a.row, len(a.blocks):].any(), f"{rid}: its table row is not 0 past its blocks"
        rows = sorted([a.row for a in self._requests.values()] + self._spare_rows)
        assert rows == list(range(len(self._tables))), "a table row lost or held twice"
        assert not self._tables[self._spare_rows].any(), "a spare table row is not 0"
        assert holders == self._refs, "reference counts do not match the tables"
        held = {b for b, n in enumerate(holders) if n}
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block twice in the free list"
        assert not (free & evictable) and not (free & held) and not (evictable & held), "block double-owned"
        assert len(free) + len(evictable) + len(held) == self.num_blocks, "block leaked"
        assert evictable <= self._key_of.keys() and not (free & self._key_of.keys()), "cache state mismatch"
        assert {k: b for b, k in self._key_of.items()} == self._block_of, "keys and blocks disagree"
