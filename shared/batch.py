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

from specserve.shared.attention import AttentionMetadata
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


def build_inputs(
    entries: Sequence[Entry],
    starts: Sequence[int],
    blocks: BlockManager,
    windows: set[int | None],
    device: torch.device,
) -> ModelInputs:
    """starts[i]: committed tokens of entry i's request before this pass; its slots are allocated."""
    batch = len(entries)
    lengths = [len(e.tokens) for e in entries]
    max_q = max(lengths)
    kv_lens = [s + n for s, n in zip(starts, lengths)]
    max_kv = max(kv_lens)

    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[torch.Tensor] = []
    offsets = torch.arange(blocks.block_size, dtype=torch.int64)
    query_dest: list[int] = []
    logits_indices: list[int] = []
    logits_splits: list[int] = []
    slot_table = torch.zeros(batch, max_kv, dtype=torch.int64)
    key_pos = torch.arange(max_kv).repeat(batch, 1)
    query_pos = torch.zeros(batch, max_q, dtype=torch.int64)
    mask = torch.zeros(batch, max_q, max_kv, dtype=torch.bool)

    for b, (entry, start) in enumerate(zip(entries, starts)):
        n = lengths[b]
        pos = entry_positions(entry, start)
        rows = len(input_ids)
        logits_at = entry_logits_at(entry)
        logits_indices.extend(rows + i for i in logits_at)
        logits_splits.append(len(logits_at))
        input_ids.extend(entry.tokens)
        positions.extend(pos)
        query_dest.extend(b * max_q + j for j in range(n))
        table = torch.tensor(blocks.block_table(entry.request_id), dtype=torch.int64)
        slots = (table[:, None] * blocks.block_size + offsets).flatten()[: start + n]
        slot_table[b, : start + n] = slots
        slot_mapping.append(slots[start:])
        pos_t = torch.tensor(pos, dtype=torch.int64)
        key_pos[b, start : start + n] = pos_t
        query_pos[b, :n] = pos_t
        mask[b, :n, :start] = True
        own = ancestor_mask(entry.parents) if isinstance(entry, Tree) else torch.ones(n, n, dtype=torch.bool).tril()
        mask[b, :n, start : start + n] = own

    masks: dict[int | None, torch.Tensor] = {}
    for window in windows:
        m = mask
        if window is not None:
            m = mask & ((query_pos[:, :, None] - key_pos[:, None, :]) < window)
        # Padding query rows attend to key 0 so softmax stays finite; their output is dropped.
        for b, n in enumerate(lengths):
            m[b, n:, 0] = True
        masks[window] = m[:, None].to(device)

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ModelInputs(
        input_ids=t(input_ids),
        positions=t(positions),
        logits_indices=t(logits_indices),
        logits_splits=logits_splits,
        attention=AttentionMetadata(
            slot_mapping=torch.cat(slot_mapping).to(device),
            slot_table=slot_table.to(device),
            query_dest=t(query_dest),
            batch_size=batch,
            max_q=max_q,
            masks=masks,
        ),
    )
