"""The prefix cache's key: one chain hash per full KV block (vLLM's scheme).

Block i of a sequence is keyed by sha256(key of block i-1 + its `block_size` token ids as little-endian
int32), block 0's parent being `ROOT`. A key therefore names a block's tokens *and every token before
them*: two sequences share block i's key exactly when their first (i + 1) x block_size tokens are equal,
and the KV of those slots is then the same (a token's K and V depend only on its position and the tokens
before it). A partial block has no key. SHA-256, not Python's `hash`: a collision would hand one
request another's KV, and a cryptographic hash keeps crafted collisions out of reach.

The target and draft services key their block pools with it (block_manager.py), and the gateway keys
its per-replica mirror of what each target caches with the same function.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

ROOT = b""  # the parent key of a sequence's first block


def chain(tokens: Sequence[int], block_size: int, parent: bytes = ROOT) -> Iterator[bytes]:
    """The keys of the full blocks of `tokens` in order, the first one's parent being `parent` (lazily:
    a caller that stops at the first unknown key hashes no further)."""
    full = len(tokens) // block_size
    if full == 0:
        return
    data = np.asarray(tokens[: full * block_size], dtype="<i4").tobytes()
    step = 4 * block_size
    for i in range(full):
        parent = hashlib.sha256(parent + data[i * step: (i + 1) * step]).digest()
        yield parent


def block_hashes(tokens: Sequence[int], block_size: int, parent: bytes = ROOT) -> list[bytes]:
    """Every full block's key (see `chain`)."""
    return list(chain(tokens, block_size, parent))


__all__ = ["ROOT", "block_hashes", "chain"]
