"""The simulated "true continuation": what the target would emit next, from real text.

Both simulated services derive it from the committed tokens alone, with no shared state: the next
token after a sequence is one of the tokens that follow its last two tokens somewhere in a corpus
of real text (the workload prompts, tokenized with the target's tokenizer), picked by a hash of
those two tokens, the position and the preset's seed. The output is therefore real text, token
pairs as they occur in the corpus (the detokenizer and stop strings see ordinary text), it is
reproducible, and the target and the draft agree on it token for token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

_MASK = (1 << 64) - 1


def _mix(*values: int) -> int:
    """splitmix64 over the values: a fast, well-spread deterministic hash."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 29
    return h


class TruthText:
    def __init__(self, streams: Iterable[Sequence[int]], seed: int = 0):
        self.seed = seed
        self.pairs: dict[tuple[int, int], list[int]] = {}
        self.singles: dict[int, list[int]] = {}
        self.tokens: list[int] = []
        for stream in streams:
            stream = list(stream)
            self.tokens += stream
            for a, b, c in zip(stream, stream[1:], stream[2:]):
                self.pairs.setdefault((a, b), []).append(c)
            for a, b in zip(stream, stream[1:]):
                self.singles.setdefault(a, []).append(b)
        if len(self.tokens) < 3:
            raise ValueError("the simulation's text corpus has fewer than 3 tokens")

    def next_token(self, prev2: int, prev1: int, pos: int) -> int:
        """The true token at sequence position `pos` after ... prev2, prev1 (prev2 = -1 if none)."""
        h = _mix(self.seed, prev2, prev1, pos)
        followers = self.pairs.get((prev2, prev1)) or self.singles.get(prev1)
        if followers:
            return followers[h % len(followers)]
        return self.tokens[h % len(self.tokens)]

    def continuation(self, seq: Sequence[int], count: int) -> list[int]:
        """The next `count` true tokens after the committed tokens `seq`."""
        prev2 = seq[-2] if len(seq) >= 2 else -1
        prev1 = seq[-1] if seq else -1
        out = []
        for pos in range(len(seq), len(seq) + count):
            token = self.next_token(prev2, prev1, pos)
            out.append(token)
            prev2, prev1 = prev1, token
        return out

    def alternatives(self, prev2: int, prev1: int, pos: int, exclude: int, count: int) -> list[int]:
        """`count` distinct plausible tokens other than `exclude` (the draft's wrong guesses):
        other followers of the context first, then tokens from the corpus."""
        out: list[int] = []
        seen = {exclude}
        pools = [self.pairs.get((prev2, prev1), []), self.singles.get(prev1, [])]
        h = _mix(self.seed + 1, prev2, prev1, pos)
        for pool in pools:
            for i in range(len(pool)):
                token = pool[(h + i) % len(pool)]
                if token not in seen:
                    seen.add(token)
                    out.append(token)
                    if len(out) == count:
                        return out
        i = 0
        while len(out) < count:
            token = self.tokens[(h + i * 7919) % len(self.tokens)]
            i += 1
            if token not in seen:
                seen.add(token)
                out.append(token)
            elif i > 64 * count + len(self.tokens):
                raise ValueError("the simulation's text corpus has too few distinct tokens")
        return out


def load_corpus(files: Sequence[Path], tokenizer_file: Path, seed: int) -> TruthText:
    """Tokenize the `prompt` (or `text`) field of every line of the JSONL files."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    texts: list[str] = []
    for path in files:
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                texts.append(row.get("prompt") or row.get("text") or "")
    encodings = tokenizer.encode_batch([t for t in texts if t], add_special_tokens=False)
    return TruthText((e.ids for e in encodings), seed)
