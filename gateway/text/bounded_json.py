"""JSON text found inside strings (tool-call `arguments` in a conversation, or in the model's
own output), parsed within bounds.

The request body's own nesting is bounded when it is read (request_body.py), but a string
in it may hold JSON of any depth, and so may a model's output: `json.loads` of 100,000
nested brackets raises RecursionError, which no `except ValueError` catches (a 500, or a
stream cut with no error event). Here every failure is a ValueError: text that is not JSON,
text that nests deeper than MAX_DEPTH (`TooDeep`), and a RecursionError on the way. Large
text with many values goes through the stdlib's pure-Python scanner, which yields the GIL
every switch interval (the C parser would hold it for the whole parse).
"""

from __future__ import annotations

import json
import json.scanner
from typing import Any

MAX_DEPTH = 64  # as a request body's (request_body.MAX_DEPTH)
# Above these, the C parser could hold the GIL for more than a few milliseconds.
_INLINE_CHARS = 64 * 1024
_MAX_C_PARSER_VALUES = 20_000


class TooDeep(ValueError):
    pass


def _python_decoder() -> json.JSONDecoder:
    decoder = json.JSONDecoder()
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder


_C_DECODER = json.JSONDecoder()
_PY_DECODER = _python_decoder()


def loads(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads, but a ValueError for anything it cannot take (see the module docstring)."""
    decoder = _PY_DECODER if _is_costly_for_c(text) else _C_DECODER
    try:
        value = decoder.decode(text)
    except RecursionError:
        raise TooDeep(f"JSON nests deeper than {max_depth} levels") from None
    if depth(value) > max_depth:
        raise TooDeep(f"JSON nests deeper than {max_depth} levels")
    return value


def depth(root: Any) -> int:
    """The nesting depth of a parsed value (a scalar: 0), without recursion."""
    deepest = 0
    stack = [(root, 1)]
    while stack:
        value, level = stack.pop()
        kind = type(value)
        if kind is not dict and kind is not list:
            continue
        deepest = max(deepest, level)
        for item in value.values() if kind is dict else value:
            if type(item) is dict or type(item) is list:
                stack.append((item, level + 1))
    return deepest


def _is_costly_for_c(text: str) -> bool:
    if len(text) <= _INLINE_CHARS:
        return False
    return text.count(",") + text.count("[") + text.count("{") > _MAX_C_PARSER_VALUES
