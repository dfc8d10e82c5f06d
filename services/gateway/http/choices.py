"""A request's n choices (OpenAI's `n`): n generations of one prompt, answered as one response.

Each choice is a `Generation` of its own (its own engine request, speculated and verified alone;
api.choice_submissions gives them their ids and seeds). `Choices` submits them all, waits until all
are admitted (a refusal of any one is the whole request's 503, the others aborted: no partial
answers), then gives their text pieces as (index, piece) in the order they arrive, (index, None) when
choice `index` ends. Leaving early (a client gone, a stream cut) aborts every choice still running.
With n = 1 it adds no task and no queue: the one generation's pieces are passed through.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from specserve.gateway.engine.request import Submission
from specserve.gateway.frontend.local import EngineApi
from specserve.gateway.http.api import Generation
from specserve.gateway.http.logprobs import TokenStrings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Choices:
    def __init__(self, engine: EngineApi, rid: str, subs: list[Submission], tokenizer: PreTrainedTokenizerBase,
                 stops: tuple[str, ...], echo: str | None = None, strings: TokenStrings | None = None):
        """rid: the response's id; echo, strings: each choice's (`Generation`'s). Submits every choice;
        ServiceUnavailable (503) when one is refused at once (those submitted before it are aborted)."""
        self.engine, self.rid = engine, rid
        self.gens: list[Generation] = []
        try:
            for sub in subs:
                self.gens.append(Generation(engine, sub, tokenizer, stops, echo, strings))
        except BaseException:
            self.abort()
            raise

    @property
    def first(self) -> Generation:
        return self.gens[0]

    def abort(self) -> None:
        """End every choice that is still running (a no-op for those that ended)."""
        for gen in self.gens:
            if gen.finish_reason is None:
                self.engine.abort(gen.sub.rid)

    async def admitted(self) -> None:
        """Wait until every choice is admitted; if any is refused (503) or fails, abort them all and raise."""
        if len(self.gens) == 1:
            await self.first.admitted()
            return
        waits = [asyncio.ensure_future(gen.admitted()) for gen in self.gens]
        try:
            await asyncio.gather(*waits)
        except BaseException:
            for wait in waits:
                wait.cancel()
            self.abort()
            raise

    async def pieces(self) -> AsyncGenerator[tuple[int, str | None], None]:
        """(index, text piece) as they come, and (index, None) once that choice has ended (its
        `finish_reason` set); every choice ends once."""
        if len(self.gens) == 1:
            one = self.first.pieces()
            try:
                async for piece in one:
                    yield 0, piece
            finally:
                await one.aclose()  # closed at once when the consumer leaves: the request ends now, not at GC
            yield 0, None
            return
        queue: asyncio.Queue[tuple[int, str | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, gen: Generation) -> None:
            try:
                async for piece in gen.pieces():
                    queue.put_nowait((index, piece))
                queue.put_nowait((index, None))
            except Exception as exc:  # the handler fails as a single generation's would
                queue.put_nowait((index, exc))

        pumps = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(self.gens)]
        try:
            running = len(pumps)
            while running:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                running -= item is None
                yield index, item
        finally:
            for task in pumps:
                task.cancel()
            self.abort()

    async def texts(self) -> list[str]:
        """Every choice's whole text, in index order."""
        out = [""] * len(self.gens)
        async for index, piece in self.pieces():
            if piece:
                out[index] += piece
        return out

    def usage(self) -> dict:
        """The prompt once (with the first choice's prompt tokens served from the prefix cache), the completion
        tokens of every choice."""
        usage = self.first.usage()
        c = sum(gen.completion_tokens for gen in self.gens)
        usage.update(completion_tokens=c, total_tokens=usage["prompt_tokens"] + c)
        return usage

    def span_attributes(self) -> dict[str, Any]:
        """The request span's attributes: the first choice's, with every choice's completion tokens."""
        out = self.first.span_attributes()
        if len(self.gens) > 1:
            out["gen_ai.request.choice.count"] = len(self.gens)
            out["gen_ai.usage.completion_tokens"] = sum(gen.completion_tokens for gen in self.gens)
        return out
