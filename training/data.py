"""Token streams for training and evaluation, and the random windows training draws from them."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from training.corpus import SourceFile
from training.tokenizer import EOT, chat_text


def chat_sample(f: SourceFile, rng: random.Random) -> str | None:
    """A chat-formatted snippet of a file: the user sends some lines, the assistant continues them."""
    lines = f.text.splitlines(keepends=True)
    if len(lines) < 12:
        return None
    head, tail = rng.randint(3, 20), rng.randint(3, 20)
    start = rng.randrange(0, max(1, len(lines) - head - tail))
    user = "".join(lines[start:start + head])
    reply = "".join(lines[start + head:start + head + tail])
    return chat_text(user, reply)


def encode_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """All texts as one uint16 stream, each followed by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([eot], dtype=np.uint16))
    return np.concatenate(parts)


def build_streams(tok: Tokenizer, files: list[SourceFile], seed: int, out_dir: Path) -> dict[str, int]:
    """Write train.npy (training files plus chat snippets of them) and heldout.npy; return token counts."""
    rng = random.Random(seed)
    train = [f for f in files if not f.held_out]
    held = [f for f in files if f.held_out]
    chats = [s for f in train if (s := chat_sample(f, rng)) is not None]
    chat_ids = encode_stream(tok, chats)
    train_ids = np.concatenate([encode_stream(tok, [f.text for f in train]), chat_ids])
    held_ids = encode_stream(tok, [f.text for f in held])
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / "train.npy", train_ids)
    np.save(out_dir / "heldout.npy", held_ids)
    return {"train_files": len(train), "heldout_files": len(held), "train_tokens": int(train_ids.size),
            "chat_snippets": len(chats), "chat_tokens": int(chat_ids.size), "heldout_tokens": int(held_ids.size)}


def random_windows(stream: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
    """batch_size windows of seq_len + 1 tokens. The draw depends only on (seed, step), so runs resume exactly."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, stream.size - seq_len - 1, size=batch_size)
    return torch.from_numpy(np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int64))


def fixed_windows(stream: np.ndarray, seq_len: int, count: int) -> torch.Tensor:
    """The first `count` non-overlapping windows of seq_len + 1 tokens, for evaluation."""
    count = min(count, (stream.size - 1) // seq_len)
    return torch.from_numpy(
        np.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(count)]).astype(np.int64))
