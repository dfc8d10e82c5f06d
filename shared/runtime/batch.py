"""What one forward pass runs: a ragged batch of chunks and token trees, and its tensor inputs.

A `Chunk` appends tokens to a request's sequence with causal attention and commits them: a prefill
chunk (a later chunk attends to the earlier ones through the KV cache) or a single decode token.
A `Tree` is speculative: its root is the request's last committed token, each node sees the
committed context plus its own ancestors, and its KV stays pending until the runner commits the
accepted root-to-node path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from specserve.shared.runtime.attention import AttentionGroup, AttentionMetadata
from specserve.shared.runtime.block_manager import BlockManager
from specserve.shared.spec.token_tree import ancestor_mask, depths, validate_forest, validate_tree


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


@dataclass(slots=True)
class DraftNodes:
    """Speculative nodes added to the request's pending node set (the draft's beam search).

    Unlike a Tree, there is no root: the committed context holds every committed token, and
    parents[i] is -1 for a child of that context, else the index of an earlier pending node, counting
    the nodes of earlier DraftNodes passes first (so one beam layer per pass grows one forest).
    Each node sees the committed context and its own ancestors. The nodes stay pending until the
    runner discards them.
    """

    request_id: str
    tokens: list[int]  # node tokens of this pass
    parents: list[int]  # per node: -1, or the index of an earlier node in the whole pending forest
    logits_at: Sequence[int] | None = None  # indices into tokens whose logits are returned; None = all


Entry = Chunk | Tree | DraftNodes


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: position of each token in its sequence
    logits_indices: torch.Tensor  # [N] int64: rows of the flattened batch whose logits are returned
    logits_splits: list[int]  # how many of those rows belong to each entry, in entry order
    attention: AttentionMetadata


def entry_logits_at(entry: Entry) -> list[int]:
    if isinstance(entry, Tree | DraftNodes) and entry.logits_at is None:
        return list(range(len(entry.tokens)))
    return list(entry.logits_at or ())


def validate_entry(entry: Entry, vocab_size: int, prior_nodes: int = 0) -> None:
    """prior_nodes: for DraftNodes, how many pending nodes of the request earlier passes added."""
    if not entry.tokens:
        raise ValueError(f"{entry.request_id}: an entry needs at least one token")
    if isinstance(entry, Tree):
        validate_tree(entry.tokens, entry.parents)
    elif isinstance(entry, DraftNodes):
        validate_forest(entry.parents, len(entry.tokens), prior_nodes)
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


@dataclass(slots=True)
class _TreeShape:
    """Where a multi-node tree or a DraftNodes pass sits in its request's slots."""

    base: int  # committed tokens: the slot (and position) of the first tree node
    prior: int  # pending nodes from earlier passes, in slots base .. base + prior
    mask: torch.Tensor  # [new, prior + new] bool: which tree nodes each new node sees
    depth: torch.Tensor  # [prior + new] int64: depth of every tree node (position = base + depth)


def _tree_shapes(
    entries: Sequence[Entry], starts: Sequence[int], prior_parents: Mapping[int, Sequence[int]]
) -> dict[int, _TreeShape]:
    shapes = {}
    for i, entry in enumerate(entries):
        if isinstance(entry, Tree) and len(entry.tokens) > 1:
            shapes[i] = _TreeShape(starts[i], 0, ancestor_mask(entry.parents), torch.tensor(depths(entry.parents)))
        elif isinstance(entry, DraftNodes):
            prior = list(prior_parents.get(i, ()))
            whole = prior + list(entry.parents)
            mask = ancestor_mask(whole)[len(prior) :]
            shapes[i] = _TreeShape(starts[i] - len(prior), len(prior), mask, torch.tensor(depths(whole)))
    return shapes


def build_inputs(
    entries: Sequence[Entry],
    starts: Sequence[int],
    blocks: BlockManager,
    windows: set[int | None],
    device: torch.device,
    prior_parents: Mapping[int, Sequence[int]] | None = None,
) -> ModelInputs:
    """starts[i]: slots of entry i's request before this pass (its new slots are allocated).

    prior_parents[i]: for a DraftNodes entry, the parents of its request's pending nodes from
    earlier passes (they occupy the last of those slots).

    Everything but the token lists and the tree masks is computed with batched tensor ops: the
    per-entry Python work is what limits large batches of single decode tokens. The lean cases
    (`_plain_inputs`) are built from Python ints instead, with no mask or a key-length one.
    """
    plain = _plain_inputs(entries, starts, blocks, windows, device)
    if plain is not None:
        return plain
    lengths = [len(e.tokens) for e in entries]
    n = torch.tensor(lengths, dtype=torch.int64)
    start = torch.tensor(starts, dtype=torch.int64)
    row_start = torch.cumsum(n, 0) - n
    entry_of_row = torch.repeat_interleave(torch.arange(len(entries)), n)  # [T]
    offset = torch.arange(int(n.sum())) - row_start[entry_of_row]  # index of each row in its entry

    tables = [blocks.block_table(e.request_id) for e in entries]
    max_blocks = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
    logical = start[entry_of_row] + offset  # logical slot of each new token
    bs = blocks.block_size
    slot_mapping = block_table[entry_of_row, logical // bs] * bs + logical % bs

    # Positions: context + index for chunks, context + depth for tree nodes.
    positions = logical.clone()
    # A one-node tree (a plain decode) attends and is positioned exactly like a one-token chunk.
    shapes = _tree_shapes(entries, starts, prior_parents or {})
    first_rows = row_start.tolist()
    for i, shape in shapes.items():
        positions[first_rows[i] : first_rows[i] + lengths[i]] = shape.base + shape.depth[shape.prior :]

    input_ids: list[int] = []
    logits_indices: list[int] = []
    logits_splits: list[int] = []
    for entry, first_row in zip(entries, first_rows):
        logits_at = entry_logits_at(entry)
        logits_indices.extend(first_row + i for i in logits_at)
        logits_splits.append(len(logits_at))
        input_ids.extend(entry.tokens)

    layout = _Layout(entries, lengths, starts, n, start, row_start, block_table, tables, shapes, bs)
    groups = [_group(layout, members, windows, device) for members in attention_groups(lengths)]
    return ModelInputs(
        input_ids=_tensor(input_ids, device),
        positions=positions.to(device),
        logits_indices=_tensor(logits_indices, device),
        logits_splits=logits_splits,
        attention=AttentionMetadata(slot_mapping=slot_mapping.to(device), groups=groups),
    )


def _plain_inputs(
    entries: Sequence[Entry], starts: Sequence[int], blocks: BlockManager, windows: set[int | None],
    device: torch.device,
) -> ModelInputs | None:
    """The inputs of a pass that needs no tree mask, or None when it does not qualify.

    Qualify: single-token decodes (one-token chunks or one-node trees) of any number of requests,
    each attending over its whole context (a mask only cuts each one's keys at its own length, and at
    a sliding window), or a lone request's first chunk (`is_causal`, no mask, if no window cuts it).
    A lone decode inside every window has no mask at all: its keys are cut to its length.
    """
    if any(isinstance(e, DraftNodes) or (isinstance(e, Tree) and len(e.tokens) > 1) for e in entries):
        return None
    lengths = [len(e.tokens) for e in entries]
    kv_lens = [s + n for s, n in zip(starts, lengths)]  # keys each entry sees: its context and itself
    lone, decodes = len(entries) == 1, max(lengths) == 1
    in_window = all(w is None or max(kv_lens) <= w for w in windows)  # no window cuts any query's keys
    if not decodes and not (lone and starts[0] == 0 and in_window):
        return None
    bs = blocks.block_size
    tables = [blocks.block_table(e.request_id) for e in entries]
    max_blocks = max(len(t) for t in tables)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    logits_splits: list[int] = []
    for entry, start, n, table in zip(entries, starts, lengths, tables):
        logits_at = entry_logits_at(entry)
        logits_indices.extend(len(input_ids) + i for i in logits_at)
        logits_splits.append(len(logits_at))
        input_ids.extend(entry.tokens)
        positions.extend(range(start, start + n))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
    block_table = _tensor([t + [0] * (max_blocks - len(t)) for t in tables], device)
    batch, max_q = len(entries), lengths[0] if lone else 1
    query_dest = torch.arange(batch * max_q, device=device)  # no padding: every entry has max_q queries
    if lone and in_window:
        group = AttentionGroup(None, block_table, query_dest, 1, max_q, {}, kv_len=kv_lens[0], causal=max_q > 1)
    else:
        key = torch.arange(max_blocks * bs, device=device)
        kv_len = _tensor(kv_lens, device)[:, None]
        visible = key < kv_len  # [B, max_kv]: the entry's context and its own token
        masks = {w: (visible if w is None else visible & (key >= kv_len - w))[:, None, None] for w in windows}
        group = AttentionGroup(None, block_table, query_dest, batch, 1, masks)
    return ModelInputs(
        input_ids=_tensor(input_ids, device),
        positions=_tensor(positions, device),
        logits_indices=_tensor(logits_indices, device),
        logits_splits=logits_splits,
        attention=AttentionMetadata(slot_mapping=_tensor(slots, device), groups=[group]),
    )


@dataclass(slots=True)
class _Layout:
    """Per-entry facts of one batch, shared by its attention groups."""

    entries: Sequence[Entry]
    lengths: list[int]  # new tokens per entry
    starts: Sequence[int]  # committed tokens per entry before this pass
    n: torch.Tensor  # [B] lengths as a tensor
    start: torch.Tensor  # [B] starts as a tensor
    row_start: torch.Tensor  # [B] first row of each entry in the flat batch
    block_table: torch.Tensor  # [B, max_blocks] padded with block 0
    tables: list[list[int]]  # unpadded block tables
    trees: dict[int, _TreeShape]  # entry index -> its tree's layout (multi-node trees and DraftNodes)
    block_size: int


def _group(layout: _Layout, members: list[int], windows: set[int | None], device: torch.device) -> AttentionGroup:
    """Padded attention inputs and masks for the entries `members` (in entry order)."""
    idx = torch.tensor(members, dtype=torch.int64)
    n, start = layout.n[idx], layout.start[idx]
    batch = len(members)
    max_q = max(layout.lengths[i] for i in members)
    max_blocks = max(len(layout.tables[i]) for i in members)
    max_kv = max_blocks * layout.block_size  # keys are gathered whole blocks at a time

    # Query j of entry b sees key k when k is committed context (k < start), or k is one of its
    # own new tokens that precedes it (chunk: causal) or is its ancestor (tree, set below).
    key = torch.arange(max_kv)[None, None, :]
    query = torch.arange(max_q)[None, :, None]
    rel = key - start[:, None, None]  # key index relative to the entry's first new token
    real_query = query < n[:, None, None]
    mask = real_query & (rel <= query)  # rel < 0 is context; 0 <= rel <= query is causal
    trees = [(b, i) for b, i in enumerate(members) if i in layout.trees]
    for b, i in trees:
        shape, k = layout.trees[i], layout.lengths[i]
        mask[b, :k, shape.base : shape.base + shape.prior + k] = shape.mask

    masks: dict[int | None, torch.Tensor] = {}
    for window in windows:
        m = mask if window is None else mask & (_distance(layout, trees, start, batch, max_q, max_kv) < window)
        # Padding query rows attend to key 0 so softmax stays finite; their output is dropped.
        m[:, :, 0] |= ~real_query[:, :, 0]
        masks[window] = m[:, None].to(device)

    whole_batch = batch == len(layout.entries)  # then the rows are 0..T-1 in order
    entry_of_row = torch.repeat_interleave(torch.arange(batch), n)
    offset = torch.arange(int(n.sum())) - (torch.cumsum(n, 0) - n)[entry_of_row]
    return AttentionGroup(
        rows=None if whole_batch else (layout.row_start[idx][entry_of_row] + offset).to(device),
        block_table=layout.block_table[idx, :max_blocks].to(device),
        query_dest=(entry_of_row * max_q + offset).to(device),
        batch_size=batch,
        max_q=max_q,
        masks=masks,
    )


def _distance(
    layout: _Layout, trees: list[tuple[int, int]], start: torch.Tensor, batch: int, max_q: int, max_kv: int
) -> torch.Tensor:
    """[Bg, max_q, max_kv] query position minus key position (for sliding windows)."""
    key_pos = torch.arange(max_kv).repeat(batch, 1)
    query_pos = start[:, None] + torch.arange(max_q)[None, :]
    for b, i in trees:
        shape, k = layout.trees[i], layout.lengths[i]
        s = shape.base
        key_pos[b, s : s + shape.prior + k] = s + shape.depth
        query_pos[b, :k] = s + shape.depth[shape.prior :]
    return query_pos[:, :, None] - key_pos[:, None, :]


def _tensor(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
