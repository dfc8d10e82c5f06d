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


def _array(values: list[int], dtype: type[np.integer]) -> torch.Tensor:
    """A 1-D CPU tensor of Python ints through NumPy (several times faster than `torch.tensor` on a list)."""
    return torch.from_numpy(np.array(values, dtype=dtype))


def build_lean_inputs(
    entries: Sequence[Entry],
    starts: Sequence[int],
    blocks: BlockManager,
    prior_parents: Mapping[int, Sequence[int]] | None = None,
) -> LeanInputs:
    """starts[i]: slots of entry i's request before this pass (its new slots are allocated);
    prior_parents[i]: a DraftNodes entry's pending nodes from earlier passes (as in batch.build_inputs).
    Per token the loop notes logical slots (its own, and a tree node's path); the physical slots are read
    from the batch's block tables in one array operation."""
    bs = blocks.block_size
    tables = blocks.block_tables([e.request_id for e in entries])
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
    return LeanInputs(
        input_ids=_array(input_ids, i64),
        positions=_array(positions, i64),
        logits_indices=_array(logits_indices, i64),
        logits_splits=logits_splits,
        keys=KeyLayout(
            slot_mapping=torch.from_numpy(_physical(tables, seq, logical, bs).astype(i64)),
            tables=torch.from_numpy(tables),
            seq=_array(seq, i32),
            prefix=_array(prefix, i32),
            extra_off=_array(extra_off, i32),
            extra_slots=torch.from_numpy(_physical(tables, extra_seq, extra, bs)),
            block_size=bs,
        ),
    )


def decode_lean_inputs(tables: np.ndarray, starts: Sequence[int], tokens: Sequence[int], block_size: int) -> LeanInputs:
    """`build_lean_inputs` of one-token entries that ask for their logits (a batch of plain decodes), in array
    operations: entry i's token `tokens[i]` at logical slot `starts[i]` of the request at row i of `tables`."""
    n = len(starts)
    at = np.array(starts, dtype=np.int64)
    rows = np.arange(n, dtype=np.int64)
    slots = tables[rows, at // block_size].astype(np.int64) * block_size + at % block_size
    return LeanInputs(
        input_ids=_array(list(tokens), np.int64),
        positions=torch.from_numpy(at),
        logits_indices=torch.from_numpy(rows),
        logits_splits=[1] * n,
        keys=KeyLayout(
            slot_mapping=torch.from_numpy(slots),
            tables=torch.from_numpy(tables),
            seq=torch.from_numpy(rows.astype(np.int32)),
            prefix=torch.from_numpy((at + 1).astype(np.int32)),
            extra_off=torch.zeros(n + 1, dtype=torch.int32),
            extra_slots=torch.zeros(0, dtype=torch.int32),
            block_size=block_size,
        ),
    )


def _physical(tables: np.ndarray, rows: list[int], logical: list[int], block_size: int) -> np.ndarray:
    """int32 physical slots of logical slots `logical` of the requests at rows `rows` of `tables`."""
    at = np.array(logical, dtype=np.int32)
    return tables[np.array(rows, dtype=np.intp), at // block_size] * block_size + at % block_size
