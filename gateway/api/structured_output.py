"""What a request's output must look like, as a grammar for the worker's constrained decoding.

`response_format` json_object / json_schema and forced tool calls (tool_choice "required" or a
named function) become a JSON schema that travels in SUBMIT as ["json_schema", text]; the
worker compiles it with llguidance (worker/grammar.py). The schema is checked here first, with
the same engine, so a schema it cannot run is a 400 before any worker sees the request.

Forced tool calls follow vLLM's shapes, which need no knowledge of the model's own call
syntax: a named function constrains the output to that function's arguments object; "required"
to a JSON array of {"name": ..., "arguments": {...}} objects, one of the given functions each.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from zeroserve.common.protocol import MAX_GRAMMAR_CHARS
from zeroserve.gateway.errors import invalid_request

# Any JSON object (json_object mode and functions without `parameters`).
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Grammar:
    kind: str  # "json_schema", "regex" (common.protocol.GRAMMAR_KINDS)
    source: str

    def to_wire(self) -> list[str]:
        return [self.kind, self.source]


def json_schema_grammar(schema: Any, param: str) -> Grammar:
    """A JSON schema (already parsed) -> a grammar, or a 400 naming `param`."""
    if not isinstance(schema, (dict, bool)):
        raise invalid_request(f"'{param}' must be a JSON schema object.", param=param)
    # Keys keep the caller's order: the grammar engine writes an object's properties in the
    # schema's order, and callers choose it (a "reasoning" before its "answer"), as with
    # OpenAI's structured outputs. Sorted, a forced tool call's "arguments" came before its
    # "name", so they could not stream until the name arrived.
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if len(text) > MAX_GRAMMAR_CHARS:
        raise invalid_request(f"'{param}' is too large ({len(text)} characters; the limit is "
                              f"{MAX_GRAMMAR_CHARS}).", param=param)
    error = _schema_error(text)
    if error:
        raise invalid_request(f"'{param}' is not a JSON schema this server can enforce: "
                              f"{error}", param=param)
    return Grammar("json_schema", text)


def regex_grammar(pattern: str, param: str) -> Grammar:
    if not 0 < len(pattern) <= MAX_GRAMMAR_CHARS:
        raise invalid_request(f"'{param}' must have 1 to {MAX_GRAMMAR_CHARS} characters.",
                              param=param)
    error = _regex_error(pattern)
    if error:
        raise invalid_request(f"'{param}' is not a valid regular expression: {error}",
                              param=param)
    return Grammar("regex", pattern)


def closed_schema(schema: Any) -> Any:
    """A tool's parameters with every object that declares `properties` closed to other keys
    (`additionalProperties: false`) where the schema does not say, as llama.cpp's grammars
    do: a small model let free writes keys the tool never declared ("temperature_on_your_
    body", nested objects) until max_tokens cuts the call. An explicit
    `additionalProperties` (or `patternProperties`, `unevaluatedProperties`) always wins."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_children(k, v) for k, v in schema.items()}
    if isinstance(out.get("properties"), dict) and not any(
            k in out for k in ("additionalProperties", "patternProperties",
                               "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def _close_children(key: str, value: Any) -> Any:
    if key in ("properties", "$defs", "definitions", "dependentSchemas") \
            and isinstance(value, dict):
        return {name: closed_schema(sub) for name, sub in value.items()}
    if key in ("items", "additionalItems", "prefixItems", "anyOf", "oneOf", "allOf", "not",
               "then", "else", "if", "contains", "additionalProperties"):
        return closed_schema(value)
    return value


def tool_parameters(function: dict[str, Any], is_closed: bool = True) -> Any:
    """The schema a forced call's arguments follow (closed: see closed_schema)."""
    schema = function.get("parameters") or ANY_OBJECT
    return closed_schema(schema) if is_closed else schema


def named_tool_grammar(function: dict[str, Any], is_closed: bool = True) -> Grammar:
    """The output is the named function's arguments object."""
    name = function["name"]
    return json_schema_grammar(tool_parameters(function, is_closed),
                               f"tools[{name}].function.parameters")


def required_tool_grammar(functions: list[dict[str, Any]], parallel: bool,
                          is_closed: bool = True) -> Grammar:
    """The output is a JSON array of calls: {"name": one of the functions, "arguments": its
    parameters' object}; exactly one call unless parallel calls are allowed."""
    calls = [{
        "type": "object",
        "properties": {"name": {"const": f["name"]},
                       "arguments": tool_parameters(f, is_closed)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return json_schema_grammar(schema, "tools")


class _Verdicts:
    """What the grammar engine said about recent schema texts, keyed by their digest (not
    the texts: 256 cached 256 KiB schemas would hold 64 MiB). Shared by the CPU pool."""

    def __init__(self, size: int = 1024) -> None:
        self._size = size
        self._items: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, kind: str, text: str, check) -> str:
        key = hashlib.blake2b(f"{kind}\0{text}".encode(), digest_size=16).digest()
        with self._lock:
            verdict = self._items.get(key)
            if verdict is not None:
                self._items.move_to_end(key)
                return verdict
        verdict = check(text)
        with self._lock:
            self._items[key] = verdict
            if len(self._items) > self._size:
                self._items.popitem(last=False)
        return verdict


_VERDICTS = _Verdicts()


def _schema_error(text: str) -> str:
    return _VERDICTS.get("json_schema", text, _check_schema)


def _regex_error(pattern: str) -> str:
    return _VERDICTS.get("regex", pattern, _check_regex)


def _check_schema(text: str) -> str:
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
    except ValueError as e:
        return str(e)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return (messages[0] if messages else "invalid schema") if is_error else ""


def _check_regex(pattern: str) -> str:
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_regex(pattern)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return (messages[0] if messages else "invalid regex") if is_error else ""
