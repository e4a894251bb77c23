"""A request's JSON body, read and parsed within limits: no body can cost a 500, unbounded
memory, or a long hold of the event loop.

Reading: the Content-Type must be JSON (415); a declared Content-Length over the limit is
refused before a byte is read, and a body that grows past it while streaming is refused
then (413, connection closed); a body that has not fully arrived in time is 408.

Parsing, measured on this project's 2-core machine: C json.loads of an 8 MiB body holds
the GIL for 0.2-0.5 s when it is made of millions of small values (a thread does not help),
but for ~12 ms when it is one big string. So a large body is parsed in the CPU pool, by the
C parser when its count of values and digits bounds the hold to a few milliseconds, else by
the stdlib's pure-Python scanner, which yields the GIL every switch interval. Then:
- nesting deeper than MAX_DEPTH is 400 (and RecursionError from deeper still);
- an integer literal longer than MAX_INT_DIGITS is 400 (nothing we read needs more than
  64 bits, and int() of thousands of digits is slow);
- the body must be UTF-8 (RFC 8259), and a lone UTF-16 surrogate from a `\\uD800` escape,
  anywhere (values or keys), is 400: such a str cannot be encoded, tokenized or logged.
"""

from __future__ import annotations

import asyncio
import json
import json.scanner
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive

from zeroserve.gateway.errors import (
    APIError,
    body_timeout,
    body_too_large,
    invalid_request,
    unsupported_media_type,
)
from zeroserve.gateway.http.http_protocol import CYCLE_SCOPE_KEY
from zeroserve.gateway.http.offload import CpuPool

MAX_DEPTH = 64
MAX_INT_DIGITS = 20  # 2**64 has 20 digits
INLINE_BODY_BYTES = 64 * 1024  # parsed on the loop: a few ms at most, whatever its shape
# Beyond either count, the C parser could hold the GIL for more than ~10 ms.
MAX_C_PARSER_VALUES = 20_000
MAX_C_PARSER_DIGITS = 200_000
_DIGITS = b"0123456789"


class _IntegerTooLong(ValueError):
    pass


def _parse_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise _IntegerTooLong(literal[:24])
    return int(literal)


def _python_decoder() -> json.JSONDecoder:
    decoder = json.JSONDecoder(parse_int=_parse_int)
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder


_C_DECODER = json.JSONDecoder(parse_int=_parse_int)
_PY_DECODER = _python_decoder()


def is_json_content_type(value: str | None) -> bool:
    """application/json (any parameters, e.g. charset) or application/<x>+json."""
    if not value:
        return False
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    headers = request.headers
    content_type = headers.get("content-type")
    if not is_json_content_type(content_type):
        raise unsupported_media_type(content_type or "")
    declared = headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise body_too_large(max_bytes)
    receive = request.receive
    try:
        if has_whole_body(request.scope):
            # receive() returns it without waiting: no timer to arm (issue 36: the timeout
            # was a tenth of the cost of admitting a request).
            return await _read_limited(receive, max_bytes)
        async with asyncio.timeout(timeout_s):
            return await _read_limited(receive, max_bytes)
    except TimeoutError:
        raise body_timeout(timeout_s) from None
    except ClientDisconnect:
        raise APIError(499, "The client closed the connection during the request body.",
                       code="client_closed") from None


def has_whole_body(scope: dict) -> bool:
    """True when the request's whole body has arrived and nothing has read it yet, so its
    first receive() returns all of it at once: behind the gateway's own protocol
    (gateway/http/http_protocol.py), whose cycle shows it. A body still arriving, or
    any other server, is read under the body timeout."""
    cycle = scope.get(CYCLE_SCOPE_KEY)
    return (cycle is not None and cycle.more_body is False and cycle.message_event.is_set()
            and not cycle.disconnected)


async def _read_limited(receive: Receive, max_bytes: int) -> bytes:
    """The body's messages (as Starlette's Request.stream() reads them), within max_bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(max_bytes)
        if not message.get("more_body", False):
            if not chunks:
                return chunk
            chunks.append(chunk)
            return b"".join(chunks)
        chunks.append(chunk)


async def parse_json_object(raw: bytes, cpu: CpuPool) -> dict[str, Any]:
    """The body as a JSON object; 400 for anything else (see the module docstring)."""
    if len(raw) <= INLINE_BODY_BYTES:
        return parse_json_bytes(raw)
    return await cpu.run(parse_json_bytes, raw)


def parse_json_bytes(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid_request("The request body is not valid UTF-8.") from None
    decoder = _PY_DECODER if _is_costly_for_c(raw) else _C_DECODER
    try:
        body = decoder.decode(text)
    except _IntegerTooLong as e:
        raise invalid_request(f"The request body has an integer with more than "
                              f"{MAX_INT_DIGITS} digits ({e}...).") from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:  # JSONDecodeError, or int() past sys.get_int_max_str_digits()
        raise invalid_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    # A lone surrogate can only come from a \uXXXX escape: the text itself is valid UTF-8.
    check_json_tree(body, check_strings="\\ud" in text or "\\uD" in text)
    return body


def _is_costly_for_c(raw: bytes) -> bool:
    """True when C json.loads could hold the GIL for long: many values (each needs a comma
    or an opening bracket) or many digits (big integers)."""
    if len(raw) <= INLINE_BODY_BYTES:
        return False
    num_values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if num_values > MAX_C_PARSER_VALUES:
        return True
    return len(raw) - len(raw.translate(None, _DIGITS)) > MAX_C_PARSER_DIGITS


def check_json_tree(root: Any, check_strings: bool = True) -> None:
    """400 when `root` nests deeper than MAX_DEPTH or (check_strings) holds a string or key
    with a lone surrogate. Iterative: no recursion for an attacker to exhaust."""
    stack = [(root, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        if type(value) is dict:
            items = value.values()
            if check_strings:
                for key in value:
                    _check_text(key)
        else:
            items = value
        for item in items:
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, depth + 1))
            elif check_strings and kind is str:
                _check_text(item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid_request(
            f"The request body has a lone UTF-16 surrogate (U+{ord(e.object[e.start]):04X}) "
            "in a string; only whole characters may be sent.") from None


def _too_deep() -> APIError:
    return invalid_request(f"The request body nests deeper than {MAX_DEPTH} levels.")
