"""Tokenization and chat templating off the event loop, with a size check before either.

Both run on one worker thread, so a huge prompt never freezes the streams the event loop is
serving. Before that, a prompt whose text is certainly too long is refused without tokenizing it:
a token covers at most `max_token_chars` characters (the longest token string in the vocabulary),
so a text of more than `max_model_len * max_token_chars` characters has more tokens than the
context holds, whatever it says.

The worker thread, and the thread pool the Rust tokenizer keeps for its batch encoding (one thread
per core), are started when `Tokenizing` is made, by a warm-up encoding on the worker: the process
then has every thread it will ever have from its start, not more after its first long prompt, so
its thread count is a constant a leak check can hold it to (bench/soak.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from specserve.gateway.http.protocol import ApiError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")
INLINE_CHARS = 2048  # texts this short are tokenized on the event loop (under a millisecond; a thread hop costs more)


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token's string covers (special tokens excluded)."""
    special = set(tokenizer.all_special_tokens)
    lengths = [len(t) for t in tokenizer.get_vocab() if t not in special]
    return max(lengths, default=1)


class Tokenizing:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_chars = max_model_len * longest_token_chars(tokenizer)  # more is certainly over the context
        self.max_model_len = max_model_len
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._pool.submit(self._warm_up).result()

    def _warm_up(self) -> None:
        """Start the Rust tokenizer's thread pool (a fast tokenizer's batch encoding starts it)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            backend.encode_batch(["warm-up"])

    def check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise ApiError(f"This model's maximum context length is {self.max_model_len} tokens; the {param} has "
                           f"{chars} characters, more than any text of that many tokens can have "
                           f"({self.max_chars}).", param=param, code="context_length_exceeded")

    async def _run(self, fn: Callable[[], T], chars: int) -> T:
        """`fn` on the worker thread, or here when the text is short enough that the hop costs more."""
        if chars <= INLINE_CHARS:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def encode(self, text: str) -> list[int]:
        self.check_chars(len(text), "prompt")
        ids: list[int] = await self._run(lambda: self.tokenizer(text)["input_ids"], len(text))
        return ids

    async def chat(self, messages: list[dict[str, str]]) -> list[int]:
        chars = sum(len(m.get("content") or "") for m in messages)
        self.check_chars(chars, "messages")

        def render() -> list[int]:
            try:
                out: Any = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except Exception as exc:  # a template that rejects the conversation
                raise ApiError(f"the chat template could not render these messages: {exc}",
                               param="messages") from None
            ids = out if isinstance(out, list) else out["input_ids"]  # a list, or a BatchEncoding in newer versions
            return [int(t) for t in ids]

        return await self._run(render, chars)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
