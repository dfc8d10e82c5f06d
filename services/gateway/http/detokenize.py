"""Incremental detokenization and stop strings for streamed output.

`IncrementalDetokenizer` turns generated token ids into text piece by piece with vLLM's
prefix_offset/read_offset technique: each step decodes a short window of already-emitted tokens
together with the new ones, and emits only what the new ones added, so that tokenizers whose
decoding of a token depends on its neighbours (leading-space handling, byte merges) come out right.
Text ending in U+FFFD, the replacement character of an incomplete UTF-8 sequence, is withheld until
a later token completes it (or `flush` gives it up at the end).

Guarantee (tested with the bundled byte-level BPE tokenizer): the concatenation of all `add()`
results and `flush()` equals ``tokenizer.decode(output_ids, skip_special_tokens=...)``, however the
ids are split into calls. This holds for any tokenizer whose decoding is a concatenation of
per-token bytes followed by lossy UTF-8 decoding (GPT-2/Llama-3/Qwen style byte-level BPE): the
window only ever starts right after a completely decoded character, where a UTF-8 decoder is in
its initial state, so decoding from there yields exactly the rest of the full decode. Two known
exceptions, both by design:

* Decoders that strip the leading space of the first token (SentencePiece "▁" tokenizers): the
  window starts in the prompt's last tokens, so the first output token keeps its leading space as it
  appears in the continuation (what vLLM streams), while decoding the output alone would drop it.
* ``clean_up_tokenization_spaces`` (a WordPiece-era post-processing that rewrites " ." to "." etc.)
  is context dependent and cannot be applied piecewise; windows are always decoded without it.
  (The bundled tokenizer has it off, and transformers ignores it for BPE tokenizers anyway.)

`StopMatcher` cuts the text at the first stop string, holding back any tail that could still become
one, and never emits the stop string itself (as OpenAI and vLLM do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["IncrementalDetokenizer", "StopMatcher"]

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET


class IncrementalDetokenizer:
    """Detokenizes one request's output tokens incrementally (see the module docstring for the guarantee)."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._backend_decode = _backend_decode(tokenizer)
        # The window: the last few prompt tokens as context, unless they end inside a character
        # (then output bytes would complete a character that decoding the output alone splits).
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        self._tokens = context  # tokens from prefix_offset on; older ones are dropped
        self._prefix_offset = 0  # start of the decoded window, into self._tokens
        self._read_offset = len(context)  # end of what has been emitted, into self._tokens
        self._prefix_text: str | None = None  # decode(self._tokens[prefix_offset:read_offset]), cached

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, self._skip)
        text: str = self._tokenizer.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)
        return text

    def _prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def add(self, token_ids: list[int]) -> str:
        """Append generated tokens; returns the text they newly made stable (possibly "")."""
        if not token_ids:
            return ""
        self._tokens.extend(token_ids)
        prefix_text = self._prefix()
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing yet, or an incomplete character at the end: wait for more tokens
        # Advance: the emitted tokens become the next window's prefix; drop what is before it.
        del self._tokens[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._tokens)
        self._prefix_text = None
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still withheld (e.g. an incomplete character), at the end of the request."""
        prefix_text = self._prefix()
        new_text = self._decode(self._tokens[self._prefix_offset :])
        del self._tokens[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._tokens)
        self._prefix_text = None
        return new_text[len(prefix_text) :]


def _backend_decode(tokenizer: Any) -> Callable[[list[int], bool], str] | None:
    """The Rust `tokenizers.Tokenizer.decode` behind a transformers fast tokenizer whose `decode`
    is exactly that call once clean-up is off (transformers' own `TokenizersBackend.decode` and
    `_decode`, not overridden): the same text, without transformers' per-call Python (argument
    conversion, kwargs), which was a tenth of the gateway's CPU at 1,000 streams. None otherwise."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # an older transformers: its fast tokenizer's _decode does more; use decode()
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or cls._decode is not TokenizersBackend._decode \
            or cls.decode is not PreTrainedTokenizerBase.decode:
        return None
    backend = tokenizer.backend_tokenizer
    return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)


class StopMatcher:
    """Cuts streamed text at the first occurrence of any stop string.

    `feed` returns text that can no longer be part of a stop string; a tail that is a proper prefix
    of some stop string is held back until later text decides it. The emitted pieces concatenate to
    exactly the text before the first stop occurrence, however the text is split into feeds. With
    overlapping stops, "first" means the occurrence that completes first (smallest end; among those
    ending at the same place, the longest): generation stops the moment a stop string is complete,
    so with stops ("b", "aba") the text "abab" is cut to "a", not to "" -- deciding on "aba" would
    mean generating past a completed stop string "b".
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        # The longest held-back tail that can matter: a proper prefix of the longest stop.
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.stopped = False

    @property
    def active(self) -> bool:
        """Whether it looks for any stop string (without one, `feed` passes text through)."""
        return bool(self._stops)

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, stopped). Must not be called again once it has stopped."""
        if self.stopped:
            raise RuntimeError("StopMatcher.feed called after a stop string matched")
        if not self._stops:
            return text, False
        buf = self._held + text
        # The first stop to complete in buf (no stop completed in earlier feeds, or we would have
        # stopped); for each stop its first occurrence is also its earliest-ending one.
        hits = [(i + len(s), i) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)[1]], True
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def flush(self) -> str:
        """The held-back text, when the request finishes for another reason (length, EOS)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
