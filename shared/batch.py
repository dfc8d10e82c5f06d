"""What one forward pass runs: a ragged batch of chunks and token trees, and its tensor inputs.

A `Chunk` appends tokens to a request's sequence with causal attention and commits them: a prefill
chunk (a later chunk attends to the earlier ones through the KV cache) or a single decode token.
A `Tree` is speculative: its root is the request's last committed token, each node sees the
committed context plus its own ancestors, and its KV stays pending until the runner commits the
accepted root-to-node path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.shared.attention import AttentionGroup, AttentionMetadata
from specserve.shared.block_manager import BlockManager
from specserve.shared.token_tree import ancestor_mask, depths, validate_tree


@dataclass(slots=True)
class Chunk:
    request_id: str
    tokens: list[int]  # token ids appended and committed
    logits_at: Sequence[int] = ()  # indices into tokens whose next-token logits are returned


@dataclass(slots=True)
class Tree:
    request_id: str
    tokens: list[int]  # node 0 is the root (the last committed token)
    parents: list[int]  # parent node index per node; -1 for the root
    logits_at: Sequence[int] | None = None  # node indices whose logits are returned; None = all


Entry = Chunk | Tree


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: position of each token in its sequence
    logits_indices: torch.Tensor  # [N] int64: rows of the flattened batch whose logits are returned
    logits_splits: list[int]  # how many of those rows belong to each entry, in entry order
    attention: AttentionMetadata


def entry_positions(entry: Entry, start: int) -> list[int]:
    if isinstance(entry, Tree):
        return [start + d for d in depths(entry.parents)]
    return list(range(start, start + len(entry.tokens)))


def entry_logits_at(entry: Entry) -> list[int]:
    if isinstance(entry, Tree) and entry.logits_at is None:
        return list(range(len(entry.tokens)))
    return list(entry.logits_at or ())


def validate_entry(entry: Entry, vocab_size: int) -> None:
    if not entry.tokens:
        raise ValueError(f"{entry.request_id}: an entry needs at least one token")
    if isinstance(entry, Tree):
        validate_tree(entry.tokens, entry.parents)
    bad = [t for t in entry.tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{entry.request_id}: token id(s) {bad[:4]} outside the vocabulary 0..{vocab_size - 1}")
    n = len(entry.tokens)
    bad_idx = [i for i in entry_logits_at(entry) if not 0 <= i < n]
    if bad_idx:
        raise ValueError(f"{entry.request_id}: logits_at {bad_idx[:4]} outside 0..{n - 1}")


# Queries up to this long share one padded attention group whatever the others' lengths.
SMALL_QUERY = 8


def attention_groups(lengths: Sequence[int]) -> list[list[int]]:
    """Split entries into groups whose padded query work stays within 2x their real tokens.

    One padded SDPA call costs about batch * max_q * max_kv, so a 128-token prefill chunk padded
    together with 100 decode tokens would cost 100x its share. Entries are taken longest first;
    a group keeps taking entries while its padding is cheap. Entry order is kept inside a group.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in order:
        n = lengths[i]
        if current:
            max_q = lengths[current[0]]
            if max_q > SMALL_QUERY and max_q * (len(current) + 1) > 2 * (real + n):
                groups.append(sorted(current))
                current, real = [], 0
        current.append(i)
        real += n
    groups.append(sorted(current))
    return groups


def build_inputs(
    entries: Sequence[Entry],
    starts: Sequence[int],
    blocks: BlockManager,
    windows: set[int | None],
    device: torch.device,
) -> ModelInputs:
    """starts[i]: committed tokens of entry i's request before this pass; its slots are allocated."""
    lengths = [len(e.tokens) for e in entries]
    offsets = torch.arange(blocks.block_size, dtype=torch.int64)
    input_ids: list[int] = []
    positions: list[list[int]] = []
    tables: list[torch.Tensor] = []  # each entry's block table
    slots: list[torch.Tensor] = []  # physical slots of each entry's whole sequence
    row_starts: list[int] = []
    logits_indices: list[int] = []
    logits_splits: list[int] = []
    for entry, start in zip(entries, starts):
        row_starts.append(len(input_ids))
        logits_at = entry_logits_at(entry)
        logits_indices.extend(len(input_ids) + i for i in logits_at)
        logits_splits.append(len(logits_at))
        input_ids.extend(entry.tokens)
        positions.append(entry_positions(entry, start))
        table = torch.tensor(blocks.block_table(entry.request_id), dtype=torch.int64)
        tables.append(table)
        slots.append((table[:, None] * blocks.block_size + offsets).flatten()[: start + len(entry.tokens)])

    groups = []
    for members in attention_groups(lengths):
        batch = len(members)
        max_q = max(lengths[i] for i in members)
        max_blocks = max(len(tables[i]) for i in members)
        max_kv = max_blocks * blocks.block_size  # keys are gathered whole blocks at a time
        block_table = torch.zeros(batch, max_blocks, dtype=torch.int64)
        key_pos = torch.arange(max_kv).repeat(batch, 1)
        query_pos = torch.zeros(batch, max_q, dtype=torch.int64)
        mask = torch.zeros(batch, max_q, max_kv, dtype=torch.bool)
        rows: list[int] = []
        query_dest: list[int] = []
        for b, i in enumerate(members):
            entry, start, n = entries[i], starts[i], lengths[i]
            rows.extend(range(row_starts[i], row_starts[i] + n))
            query_dest.extend(range(b * max_q, b * max_q + n))
            block_table[b, : len(tables[i])] = tables[i]
            pos = torch.tensor(positions[i], dtype=torch.int64)
            key_pos[b, start : start + n] = pos
            query_pos[b, :n] = pos
            mask[b, :n, :start] = True
            own = ancestor_mask(entry.parents) if isinstance(entry, Tree) else torch.ones(n, n, dtype=torch.bool).tril()
            mask[b, :n, start : start + n] = own
        masks: dict[int | None, torch.Tensor] = {}
        for window in windows:
            m = mask if window is None else mask & ((query_pos[:, :, None] - key_pos[:, None, :]) < window)
            # Padding query rows attend to key 0 so softmax stays finite; their output is dropped.
            for b, i in enumerate(members):
                m[b, lengths[i] :, 0] = True
            masks[window] = m[:, None].to(device)
        whole_batch = len(members) == len(entries)  # then rows are 0..T-1 in order
        groups.append(
            AttentionGroup(
                rows=None if whole_batch else _tensor(rows, device),
                block_table=block_table.to(device),
                query_dest=_tensor(query_dest, device),
                batch_size=batch,
                max_q=max_q,
                masks=masks,
            )
        )

    return ModelInputs(
        input_ids=_tensor(input_ids, device),
        positions=_tensor([p for pos in positions for p in pos], device),
        logits_indices=_tensor(logits_indices, device),
        logits_splits=logits_splits,
        attention=AttentionMetadata(
            slot_mapping=torch.cat([s[start:] for s, start in zip(slots, starts)]).to(device),
            groups=groups,
        ),
    )


def _tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
