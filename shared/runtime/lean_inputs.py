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


def build_lean_inputs(
    entries: Sequence[Entry],
    starts: Sequence[int],
    blocks: BlockManager,
    prior_parents: Mapping[int, Sequence[int]] | None = None,
) -> LeanInputs:
    """starts[i]: slots of entry i's request before this pass (its new slots are allocated);
    prior_parents[i]: a DraftNodes entry's pending nodes from earlier passes (as in batch.build_inputs)."""
    bs = blocks.block_size
    tables = [blocks.block_table(e.request_id) for e in entries]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq: list[int] = []
    prefix: list[int] = []
    extra_off: list[int] = [0]
    extra: list[int] = []
    logits_indices: list[int] = []
    logits_splits: list[int] = []
    for i, (entry, start, table) in enumerate(zip(entries, starts, tables)):
        n = len(entry.tokens)
        logits_at = entry_logits_at(entry)
        logits_indices.extend(len(input_ids) + j for j in logits_at)
        logits_splits.append(len(logits_at))
        input_ids.extend(entry.tokens)
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        seq.extend([i] * n)
        if isinstance(entry, DraftNodes) or (isinstance(entry, Tree) and n > 1):
            prior = list((prior_parents or {}).get(i, ())) if isinstance(entry, DraftNodes) else []
            whole = prior + list(entry.parents)
            base = start - len(prior)
            depth, paths = depths(whole), _ancestors(whole)
            for node in range(len(prior), len(whole)):
                positions.append(base + depth[node])
                prefix.append(base)
                extra.extend(table[(base + a) // bs] * bs + (base + a) % bs for a in paths[node])
                extra_off.append(len(extra))
        else:  # a chunk, or a one-node tree (a plain decode)
            positions.extend(range(start, start + n))
            prefix.extend(range(start + 1, start + n + 1))
            extra_off.extend([len(extra)] * n)
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    int32, int64 = torch.int32, torch.int64
    return LeanInputs(
        input_ids=torch.tensor(input_ids, dtype=int64),
        positions=torch.tensor(positions, dtype=int64),
        logits_indices=torch.tensor(logits_indices, dtype=int64),
        logits_splits=logits_splits,
        keys=KeyLayout(
            slot_mapping=torch.tensor(slots, dtype=int64),
            tables=torch.tensor(padded, dtype=int32),
            seq=torch.tensor(seq, dtype=int32),
            prefix=torch.tensor(prefix, dtype=int32),
            extra_off=torch.tensor(extra_off, dtype=int32),
            extra_slots=torch.tensor(extra, dtype=int32),
            block_size=bs,
        ),
    )
