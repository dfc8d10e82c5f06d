"""Structured output's grammars: a request's `GrammarSpec`, compiled by xgrammar against the served tokenizer.

`Grammars` holds one xgrammar `GrammarCompiler` (its `TokenizerInfo` made from the gateway's Hugging Face
tokenizer, the model's vocabulary size and stop ids, on first use) and a cache of compiled grammars keyed
by the spec. `compile_async` answers a cached spec at once and compiles a new one on a worker thread, so
a large schema never stalls the streams; a spec xgrammar refuses is a `GrammarError` with its message.
A `RequestGrammar` (the spec and its compiled grammar) travels in a request's `Submission`; the engine
makes the request's `Constraint` (engine/constrain.py) from it.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

    from specserve.gateway.engine.constrain import Constraint

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf")
CACHE_ENTRIES = 256  # compiled grammars kept, least recently used dropped first
CACHE_BYTES = 256 * 2**20  # and at most this much of their memory
COMPILE_THREADS = max(1, min(4, os.cpu_count() or 1))  # xgrammar's threads for one compilation
# xgrammar prefixes its messages with a time and its source line: "[07:23:20] /project/cpp/x.cc:83: "
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request constrains its output to. kind: json_schema (source: the schema as JSON text),
    json_object (any JSON object; source empty), regex, choice (source: a JSON list of the strings), ebnf
    (xgrammar's EBNF). field: the request field it came from, named in errors (not part of the key)."""

    kind: str
    source: str
    field: str = field(default="", compare=False)


class GrammarError(ValueError):
    """A spec xgrammar cannot compile; `field` is the request field to name in the 400."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.message, self.field = message, field


@dataclass(frozen=True, slots=True, eq=False)
class RequestGrammar:
    """A request's compiled grammar, as its Submission carries it."""

    spec: GrammarSpec
    compiled: xgrammar.CompiledGrammar
    grammars: Grammars

    def constraint(self) -> Constraint:
        """A fresh matcher over it, at the start of the output."""
        from specserve.gateway.engine.constrain import Constraint

        return Constraint(self.compiled, self.grammars.vocab_size, self.grammars.encode)


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of `choices`: JSON string literals are xgrammar's EBNF string literals."""
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammars:
    """Compiles specs for one tokenizer; the compiled grammars are cached by spec (shared by the threads)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: frozenset[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: OrderedDict[GrammarSpec, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """The tokenizer's ids of a piece of text, without special tokens (forced strings into tokens)."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def cached(self, spec: GrammarSpec) -> RequestGrammar | None:
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
        return None if compiled is None else RequestGrammar(spec, compiled, self)

    async def compile_async(self, spec: GrammarSpec) -> RequestGrammar:
        """The cached grammar, else compiled on a worker thread."""
        hit = self.cached(spec)
        return hit if hit is not None else await asyncio.to_thread(self.compile, spec)

    def compile(self, spec: GrammarSpec) -> RequestGrammar:
        """Compile (or take from the cache); GrammarError when xgrammar refuses the spec."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        try:
            compiled = self._compile(self.compiler(), spec)
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError, TypeError... with its reason
            reason = _XGRAMMAR_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__
            raise GrammarError(f"{spec.field}: {reason[:500]}", spec.field) from None
        with self._lock:
            self._cache[spec] = compiled
            self._trim()
        return RequestGrammar(spec, compiled, self)

    def compiler(self) -> xgrammar.GrammarCompiler:
        """The compiler, made on first use (building the TokenizerInfo reads the whole vocabulary)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
            return self._compiler

    @staticmethod
    def _compile(compiler: xgrammar.GrammarCompiler, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """JSON without free whitespace (compact, as OpenAI's structured outputs): a model cannot pad it
        forever, and more of it is forced."""
        make: dict[str, Callable[[], Any]] = {
            "json_schema": lambda: compiler.compile_json_schema(spec.source, any_whitespace=False),
            "json_object": lambda: compiler.compile_json_schema('{"type": "object"}', any_whitespace=False),
            "regex": lambda: compiler.compile_regex(spec.source),
            "choice": lambda: compiler.compile_grammar(choice_grammar(_choices(spec.source))),
            "ebnf": lambda: compiler.compile_grammar(spec.source),
        }
        if spec.kind not in make:
            raise ValueError(f"unknown grammar kind {spec.kind!r}; one of {', '.join(KINDS)}")
        compiled: xgrammar.CompiledGrammar = make[spec.kind]()
        return compiled

    def _trim(self) -> None:
        total = sum(c.memory_size_bytes for c in self._cache.values())
        while len(self._cache) > 1 and (len(self._cache) > CACHE_ENTRIES or total > CACHE_BYTES):
            _, dropped = self._cache.popitem(last=False)
            total -= dropped.memory_size_bytes


def _choices(source: str) -> list[str]:
    import json

    choices = json.loads(source)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("the choices must be a non-empty list of strings")
    return choices


__all__ = ["KINDS", "GrammarError", "GrammarSpec", "Grammars", "RequestGrammar", "choice_grammar"]
