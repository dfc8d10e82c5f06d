"""Allowed-token bitmasks (structured output): packed rows and their application to logits.

A row is int32 [ceil(V / 32)]: token t is allowed where bit (t % 32) of word t // 32 is set, the
layout xgrammar fills (`GrammarMatcher.fill_next_token_bitmask`). The gateway computes the rows; the
target applies them here with torch alone, so it needs no grammar library. A row that allows no
token of the vocabulary leaves its logits as they are: it is the row of a node after the grammar's
end (a stop token), whose output the gateway drops, and a row of only -inf would be a distribution
of nothing.
"""

from __future__ import annotations

import torch

BITS = 32


def words_for(vocab_size: int) -> int:
    """Words per row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + BITS - 1) // BITS


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [N, W] -> bool [N, vocab_size]: True where the token is allowed."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # an arithmetic shift: & 1 still reads the bit
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [N, V] -> int32 [N, ceil(V / 32)] (tests and hand-built masks)."""
    n, vocab = allowed.shape
    padded = torch.zeros(n, words_for(vocab) * BITS, dtype=torch.int64)
    padded[:, :vocab] = allowed.to(torch.int64)
    weights = torch.tensor([1 << i for i in range(BITS)], dtype=torch.int64)
    words = (padded.reshape(n, -1, BITS) * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with every token a row does not allow set to -inf (a new tensor); rows that allow
    no token are left as they are."""
    if logits.dim() != 2:  # e.g. a simulated target's true tokens: it has no distribution to mask
        raise ValueError(f"masks apply to logits [N, V], got a tensor of shape {list(logits.shape)}")
    allowed = unpack(bitmask.to(logits.device), logits.shape[-1])
    if allowed.shape[0] != logits.shape[0]:
        raise ValueError(f"{allowed.shape[0]} mask rows for {logits.shape[0]} logits rows")
    allowed |= ~allowed.any(-1, keepdim=True)
    return logits.masked_fill(~allowed, float("-inf"))


__all__ = ["apply", "pack", "unpack", "words_for"]


def apply_last(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Structured output: the logits with what the grammar forbids at -inf, so it is never chosen; the mask
    rows apply to the last rows (a prompt chunk's one row to its last token, whose logits choose the first
    output token, where the chunk's other rows are there for prompt logprobs). Logprobs read the logits as
    the model gave them."""
    if len(rows) == len(logits):
        return apply(logits, rows)
    out = logits.clone()
    out[-len(rows):] = apply(logits[-len(rows):], rows)
    return out
