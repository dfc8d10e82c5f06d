"""Logprobs as OpenAI returns them: which tokens' logprobs go out with which text, and their JSON shapes.

`LogprobTrack` follows one request's text as `Generation` (api.py) makes it: each output token's row
(from its `Tokens` event) is placed at the characters its text added to the detokenized output (a
token that adds none yet, such as the first bytes of a character, ends where the next text does), and
released once the text up to its end has gone out (past the stop-string matcher's and the
detokenizer's held-back tails). Where a stop string cuts the text, the tokens whose text starts
before the cut are released and the rest are dropped: no logprob for a token none of whose text was
returned. With `echo`, the prompt's tokens come first (the first with a null logprob), at their
offsets in the echoed prompt, and the output's offsets follow the prompt's text.

`completion_logprobs` and `chat_logprobs` build the `logprobs` object of a completions choice
(`tokens`, `token_logprobs`, `top_logprobs`: a dict token -> logprob per position holding the N most
likely tokens and the chosen one, `text_offset`) and of a chat choice (`content`: per token its
`token`, `logprob`, `bytes` and its N most likely tokens `top_logprobs`). A logprob below
`LOGPROB_FLOOR` (-inf included, which JSON cannot carry) is returned as the floor, as vLLM does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from specserve.gateway.engine.request import Tokens
from specserve.gateway.http.detokenize import IncrementalDetokenizer
from specserve.shared.wire.logprobs import TokenLogprobs

__all__ = ["LOGPROB_FLOOR", "Entry", "LogprobTrack", "TokenStrings", "chat_logprobs", "completion_logprobs"]

LOGPROB_FLOOR = -9999.0


@dataclass(slots=True)
class Entry:
    token: int
    logprob: float | None  # None: the prompt's first token (nothing precedes it)
    top: list[tuple[int, float]] | None  # the most likely tokens at its position, most likely first
    offset: int  # where its text starts in the choice's text (echoed prompt included)


class TokenStrings:
    """One token's text (decoded alone, special tokens kept) and its bytes: for a byte-level BPE
    tokenizer the token's own bytes (a piece of a multi-byte character included), else its text's UTF-8."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)
        self._byte_of = _byte_level_alphabet(tokenizer)

    def _text(self, token: int) -> str:
        text: str = self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text

    def _bytes(self, token: int) -> list[int]:
        if self._byte_of is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str) and piece and all(c in self._byte_of for c in piece):
                return [self._byte_of[c] for c in piece]
        return list(self.text(token).encode("utf-8"))


def _byte_level_alphabet(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2's byte -> printable character table, inverted, when the tokenizer decodes with it (ByteLevel)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or type(decoder).__name__ != "ByteLevel":
        return None
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class LogprobTrack:
    def __init__(self, echo_chars: int = 0):
        """echo_chars: the length of the echoed prompt text before the output's (0 without echo)."""
        self.base = echo_chars
        self.rows: deque[tuple[float, list[tuple[int, float]]]] = deque()  # received, not yet fed
        self.pending: deque[list] = deque()  # fed, text not yet out: [entry, end of its text (None: not yet made)]
        self.ready: list[Entry] = []  # released, not yet taken
        self.made = 0  # characters of output text the detokenizer has made
        self.sent = 0  # characters of output text that went out

    def prompt(self, ids: list[int], rows: TokenLogprobs, strings: TokenStrings) -> None:
        """The echoed prompt's entries: each token at its offset in the prompt's text (decoded as the output is)."""
        detok = IncrementalDetokenizer(strings.tokenizer, [], skip_special_tokens=False)
        offset = 0
        for i, token in enumerate(ids):
            top = list(zip(rows.top_ids[i - 1], rows.top_logprobs[i - 1])) if 0 < i <= len(rows) else None
            self.ready.append(Entry(token, rows.logprobs[i - 1] if 0 < i <= len(rows) else None, top, offset))
            offset += len(detok.add([token]))

    def receive(self, event: Tokens) -> None:
        """A Tokens event's rows, for its tokens about to be fed."""
        rows = event.logprobs
        for i in range(len(event.tokens)):
            self.rows.append((rows.logprobs[i], list(zip(rows.top_ids[i], rows.top_logprobs[i])))
                             if rows is not None and i < len(rows) else (LOGPROB_FLOOR, []))

    def fed(self, token: int, made: int, sent: int, stopped: bool) -> None:
        """One token fed: it made `made` characters, `sent` went out (the stop matcher's output)."""
        logprob, top = self.rows.popleft() if self.rows else (LOGPROB_FLOOR, [])
        self.pending.append([Entry(token, logprob, top, self.base + self.made), None])
        self.made += made
        if made:  # this token's text, and that of the tokens before it that made none, ends here
            for item in reversed(self.pending):
                if item[1] is not None:
                    break
                item[1] = self.made
        self.out(sent, stopped)

    def out(self, sent: int, stopped: bool, final: bool = False) -> None:
        """`sent` more characters went out; at a stop (or the end) nothing more will."""
        self.sent += sent
        while self.pending and (final or (self.pending[0][1] is not None and self.pending[0][1] <= self.sent)):
            self.ready.append(self.pending.popleft()[0])
        if stopped:  # the text stops here: tokens that began before the cut go, the rest never do
            while self.pending and self.pending[0][0].offset - self.base < self.sent:
                self.ready.append(self.pending.popleft()[0])
            self.pending.clear()

    def take(self) -> list[Entry]:
        ready, self.ready = self.ready, []
        return ready


def _lp(value: float | None) -> float | None:
    return None if value is None else max(value, LOGPROB_FLOOR)


def completion_logprobs(entries: list[Entry], strings: TokenStrings) -> dict[str, Any]:
    """A completions choice's `logprobs`: the N most likely tokens and the chosen one per position."""
    tops: list[dict[str, float] | None] = []
    for e in entries:
        if e.top is None:
            tops.append(None)
            continue
        top = {strings.text(t): _lp(v) for t, v in e.top}
        top.setdefault(strings.text(e.token), _lp(e.logprob))
        tops.append(top)  # type: ignore[arg-type]
    return {"tokens": [strings.text(e.token) for e in entries], "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": tops, "text_offset": [e.offset for e in entries]}


def chat_logprobs(entries: list[Entry], strings: TokenStrings) -> dict[str, Any]:
    """A chat choice's `logprobs`: `content`, per token its text, logprob, bytes and N most likely tokens."""
    def one(token: int, logprob: float | None) -> dict[str, Any]:
        return {"token": strings.text(token), "logprob": _lp(logprob), "bytes": strings.bytes(token)}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top or ()]}
                        for e in entries]}
