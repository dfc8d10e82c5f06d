"""The inputs of a pass that reads its keys token by token: per token, which KV slots it reads.

The compiled CPU pass (`LeanModel`) and the torch pass's Triton attention on CUDA
(`kernels/triton_attention.py`) both take this key layout.

Each new token reads a prefix of its request's committed slots (through the request's block table)
and then, for a tree node, the slots of its ancestors and itself, root first. A chunk token at
position p reads the prefix 0..p. A tree node at depth d reads the committed context and its d + 1
path nodes, in the order in which a token decoded alone at that position reads its prefix: so the
node's attention, and its logits, equal those of the same token decoded alone (batch invariance).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.shared.runtime.attention import KeyLayout
from specserve.shared.runtime.batch import DraftNodes, Entry, Tree, entry_logits_at
from specserve.shared.runtime.block_manager import BlockManager
from specserve.shared.spec.token_tree import depths


@dataclass(slots=True)
class LeanInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [N] int64 rows whose logits are returned
    logits_splits: list[int]  # rows of logits per entry, in entry order
    keys: KeyLayout


def _ancestors(parents: Sequence[int]) -> list[list[int]]:
    """Per node, its path from its root to itself (forests too: a parent of -1 is a root)."""
    out: list[list[int]] = []
    for i, parent in enumerate(parents):
        out.append((out[parent] if parent >= 0 else []) + [i])
    return out


@dataclass(slots=True)
class Decodes:
    """A batch of plain decodes beside a pass's entries: request `request_ids[i]` reads `tokens[i]` at its logical
    slot `starts[i]` (allocated) and asks for its logits; the same inputs as one-token chunks, built by array
    operations."""

    request_ids: Sequence[str]
    starts: Sequence[int]
    tokens: Sequence[int]


def build_lean_inputs(
    entries: Sequence[Entry],
    starts: Sequence[int],
    blocks: BlockManager,
    prior_parents: Mapping[int, Sequence[int]] | None = None,
    decodes: Decodes | None = None,
) -> LeanInputs:
    """starts[i]: slots of entry i's request before this pass (its new slots are allocated);
    prior_parents[i]: a DraftNodes entry's pending nodes from earlier passes (as in batch.build_inputs);
    decodes: plain decodes after the entries (their tokens, logits rows and table rows follow the entries').
    Per token the loop notes logical slots (its own, and a tree node's path); the physical slots are read
    from the batch's block tables in one array operation."""
    bs = blocks.block_size
    decode_ids = decodes.request_ids if decodes is not None else ()
    tables = blocks.block_tables([*(e.request_id for e in entries), *decode_ids])
    input_ids: list[int] = []
    positions: list[int] = []
    logical: list[int] = []  # per token: its logical slot in its request
    seq: list[int] = []
    prefix: list[int] = []
    extra_off: list[int] = [0]
    extra: list[int] = []  # per path node: its logical slot (its request: extra_seq)
    extra_seq: list[int] = []
    logits_indices: list[int] = []
    logits_splits: list[int] = []
    for i, (entry, start) in enumerate(zip(entries, starts)):
        tokens = entry.tokens
        n, row = len(tokens), len(input_ids)
        if n == 1 and not isinstance(entry, DraftNodes):  # a plain decode, or a one-token chunk
            asked = entry.logits_at is None or bool(entry.logits_at)  # (validate_entry: only row 0 can be asked)
            if asked:
                logits_indices.append(row)
            logits_splits.append(1 if asked else 0)
            input_ids.append(tokens[0])
            logical.append(start)
            seq.append(i)
            positions.append(start)
            prefix.append(start + 1)
            extra_off.append(len(extra))
            continue
        logits_at = entry_logits_at(entry)
        logits_indices.extend(row + j for j in logits_at)
        logits_splits.append(len(logits_at))
        input_ids.extend(tokens)
        logical.extend(range(start, start + n))
        seq.extend([i] * n)
        if isinstance(entry, DraftNodes | Tree):
            prior = list((prior_parents or {}).get(i, ())) if isinstance(entry, DraftNodes) else []
            whole = prior + list(entry.parents)
            base = start - len(prior)
            depth, paths = depths(whole), _ancestors(whole)
            for node in range(len(prior), len(whole)):
                positions.append(base + depth[node])
                prefix.append(base)
                extra.extend(base + a for a in paths[node])
                extra_off.append(len(extra))
            extra_seq.extend([i] * (len(extra) - len(extra_seq)))
        else:  # a chunk
            positions.extend(range(start, start + n))
            prefix.extend(range(start + 1, start + n + 1))
            extra_off.extend([len(extra)] * n)
    i32, i64 = np.int32, np.int64
    n, at = len(decode_ids), np.array(decodes.starts if decodes is not None else (), dtype=i64)
    ids = np.concatenate([np.array(input_ids, dtype=i64), np.array(decodes.tokens if decodes is not None else (),
                                                                    dtype=i64)])
    pos = np.concatenate([np.array(positions, dtype=i64), at])
    chosen = np.concatenate([np.array(logits_indices, dtype=i64), np.arange(len(input_ids), len(ids), dtype=i64)])
    logits_splits += [1] * n
    rows_of = np.concatenate([np.array(seq, dtype=i32), np.arange(len(entries), len(entries) + n, dtype=i32)])
    slots_of = np.concatenate([np.array(logical, dtype=i64), at])
    reads = np.concatenate([np.array(prefix, dtype=i64), at + 1]).astype(i32)
    offsets = np.concatenate([np.array(extra_off, dtype=i32), np.full(n, len(extra), dtype=i32)])
    return LeanInputs(
        input_ids=torch.from_numpy(ids),
        positions=torch.from_numpy(pos),
        logits_indices=torch.from_numpy(chosen),
        logits_splits=logits_splits,
        keys=KeyLayout(
            slot_mapping=torch.from_numpy(_physical(tables, rows_of, slots_of, bs).astype(i64)),
            tables=torch.from_numpy(tables),
            seq=torch.from_numpy(rows_of),
            prefix=torch.from_numpy(reads),
            extra_off=torch.from_numpy(offsets),
            extra_slots=torch.from_numpy(_physical(tables, np.array(extra_seq, dtype=i32), np.array(extra, dtype=i64),
                                                   bs).astype(i32)),
            block_size=bs,
        ),
    )


def _physical(tables: np.ndarray, rows: np.ndarray, logical: np.ndarray, block_size: int) -> np.ndarray:
    """Physical slots of logical slots `logical` of the requests at rows `rows` of `tables`."""
    slots: np.ndarray = tables[rows.astype(np.intp), logical // block_size] * block_size + logical % block_size
    return slots
