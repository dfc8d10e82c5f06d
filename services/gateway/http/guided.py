"""Structured output's request fields -> one `GrammarSpec` (engine/grammar.py), or a 400 naming the field.

OpenAI's `response_format` (`{"type": "text"}`, `{"type": "json_object"}`, `{"type": "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}`) and vLLM's `guided_json` (a schema, as an
object or as JSON text), `guided_regex`, `guided_choice` (a list of strings) and `guided_grammar`
(xgrammar's EBNF). At most one of them may ask for a grammar. The shapes are checked here; whether
xgrammar can compile the schema, regex or grammar is decided by compiling it (http/server.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from specserve.gateway.engine.grammar import GrammarSpec
from specserve.gateway.http.protocol import ApiError, ChatCompletionRequest, CompletionRequest

MAX_GRAMMAR_CHARS = 100_000  # a schema, regex, grammar or choice list longer than this is refused
MAX_CHOICES = 1024
FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
RESPONSE_TYPES = ("text", "json_object", "json_schema")


def grammar_spec(req: CompletionRequest | ChatCompletionRequest) -> GrammarSpec | None:
    """The grammar a parsed request asks for, or None; ApiError (400) when a field is malformed or two ask."""
    specs = [(name, spec) for name in FIELDS if (spec := _SPEC_OF[name](getattr(req, name))) is not None]
    if len(specs) > 1:
        raise ApiError(f"only one of {', '.join(FIELDS)} may ask for structured output; got "
                       f"{' and '.join(name for name, _ in specs)}", param=specs[1][0])
    if not specs:
        return None
    spec = specs[0][1]
    if len(spec.source) > MAX_GRAMMAR_CHARS:
        raise ApiError(f"{spec.field} is too long: {len(spec.source)} characters (at most {MAX_GRAMMAR_CHARS})",
                       param=spec.field)
    return spec


def _response_format(value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(f"response_format must be an object, got {type(value).__name__}", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", "response_format")
    if kind != "json_schema":
        raise ApiError(f"response_format.type must be one of {', '.join(RESPONSE_TYPES)}, got {_short(kind)}",
                       param="response_format.type")
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise ApiError("response_format.json_schema must be an object with the schema",
                       param="response_format.json_schema")
    for key, types, what in (("name", (str,), "a string"), ("description", (str,), "a string"),
                             ("strict", (bool,), "a boolean")):
        if js.get(key) is not None and not isinstance(js[key], types):
            raise ApiError(f"response_format.json_schema.{key} must be {what}, got {_short(js[key])}",
                           param=f"response_format.json_schema.{key}")
    schema = js.get("schema")
    if schema is None:  # a json_schema without its schema: any JSON object
        return GrammarSpec("json_object", "", "response_format.json_schema")
    return GrammarSpec("json_schema", _schema_text(schema, "response_format.json_schema.schema"),
                       "response_format.json_schema.schema")


def _guided_json(value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ApiError(f"guided_json is not valid JSON: {exc}", param="guided_json") from None
    return GrammarSpec("json_schema", _schema_text(value, "guided_json"), "guided_json")


def _guided_text(name: str, kind: str) -> Callable[[Any], GrammarSpec | None]:
    def spec(value: Any) -> GrammarSpec | None:
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise ApiError(f"{name} must be a non-empty string, got {_short(value)}", param=name)
        return GrammarSpec(kind, value, name)

    return spec


def _guided_choice(value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise ApiError(f"guided_choice must be a non-empty list of strings, got {_short(value)}",
                       param="guided_choice")
    if len(value) > MAX_CHOICES:
        raise ApiError(f"guided_choice may hold at most {MAX_CHOICES} strings, got {len(value)}",
                       param="guided_choice")
    return GrammarSpec("choice", json.dumps(value, ensure_ascii=False), "guided_choice")


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema as JSON text, its keys in the order given (the order of an object's properties)."""
    if not isinstance(schema, (dict, bool)):
        raise ApiError(f"{param} must be a JSON schema (an object), got {_short(schema)}", param=param)
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (ValueError, TypeError, RecursionError) as exc:
        raise ApiError(f"{param} cannot be a JSON schema: {exc}", param=param) from None


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


_SPEC_OF: dict[str, Callable[[Any], GrammarSpec | None]] = {
    "response_format": _response_format,
    "guided_json": _guided_json,
    "guided_regex": _guided_text("guided_regex", "regex"),
    "guided_choice": _guided_choice,
    "guided_grammar": _guided_text("guided_grammar", "ebnf"),
}

__all__ = ["FIELDS", "MAX_GRAMMAR_CHARS", "grammar_spec"]
