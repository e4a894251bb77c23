"""Anthropic Messages responses: content blocks, the streamed events, usage and errors.

`MessageBuilder` is one choice's output as it arrives. Its seam is `push(reasoning_delta,
text_delta)`: the thinking text and the answer text of one update (chat's reasoning parser
splits them: `ChoiceUpdate.reasoning`; without one, `reasoning_delta` is ""). Thinking goes to a `thinking` block
(`thinking_delta`s, then a `signature_delta` before it closes); the answer text goes through
chat's tool-call parser (`ToolCallStream`), and what it finds becomes `text` blocks
(`text_delta`) and `tool_use` blocks (`input_json_delta` with `partial_json`). The builder
returns the events each push makes, and keeps the blocks, so one builder serves the stream
(the events) and the whole response (`content()`).

Events are `(name, data)` pairs; `sse_event` writes one as Anthropic does:
`event: NAME\\ndata: {JSON}\\n\\n`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from json.encoder import encode_basestring as _json_string
from typing import Any

from zeroserve.gateway.api.openai_schema import ToolChoice
from zeroserve.gateway.api.tool_calls import ToolCallStream
from zeroserve.gateway.errors import APIError

Event = tuple[str, dict[str, Any]]

# chat's finish reasons -> Anthropic's stop reasons ("stop" is refined: stop_reason()).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                504: "timeout_error", 529: "overloaded_error"}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    if name == "content_block_delta" and data["delta"]["type"] == "text_delta":
        # The hot path, one per output chunk: only the text goes through the JSON encoder.
        return (f'event: content_block_delta\ndata: {{"type":"content_block_delta","index":'
                f'{data["index"]},"delta":{{"type":"text_delta","text":'
                f'{_json_string(data["delta"]["text"])}}}}}\n\n').encode()
    return (f"event: {name}\ndata: "
            f"{json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n").encode()


def sse_events(events: list[Event]) -> bytes:
    return b"".join(sse_event(name, data) for name, data in events)


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(error: APIError) -> dict[str, Any]:
    """An APIError in Anthropic's shape (the body of a response and of an `error` event)."""
    return {"type": "error", "error": {"type": error_type(error.status),
                                       "message": error.message}}


def thinking_signature(thinking: str) -> str:
    """A locally derived signature for a thinking block: a digest of its text. (Anthropic's
    is an encrypted proof; clients store it and send it back, and this server ignores it.)"""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def tool_use_id(call_id: str) -> str:
    """chat's call id ("call_…") in Anthropic's spelling ("toolu_…")."""
    return "toolu_" + call_id.removeprefix("call_")


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0
          ) -> dict[str, int]:
    """Anthropic counts the cached part of the input apart: input_tokens is the rest."""
    cached = min(num_cached_tokens, num_prompt_tokens)
    return {"input_tokens": num_prompt_tokens - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": num_output_tokens}


def stop_reason(finish_reason: str | None, has_tool_use: bool, stop_sequence: str | None
                ) -> str | None:
    if finish_reason is None:
        return None
    if stop_sequence is not None:
        return "stop_sequence"
    if has_tool_use and finish_reason in ("stop", "tool_calls"):
        return "tool_use"
    return _STOP_REASONS.get(finish_reason, "end_turn")


def matched_stop_sequence(text: str, stops: tuple[str, ...]) -> str | None:
    """Which stop sequence ended the output: the one found first in its full text."""
    if len(stops) == 1:
        return stops[0]
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(found)[1] if found else (stops[0] if stops else None)


class MessageBuilder:
    """One choice's output -> content blocks, and the stream events that build them."""

    def __init__(self, tools: ToolChoice | None = None, is_single_tool_use: bool = False):
        # The blocks as content_block_start showed them; the text of each (its text, its
        # thinking or its input's JSON) in pieces, joined once by content(): a string grown
        # by += per token would be copied each time.
        self.blocks: list[dict[str, Any]] = []
        self._pieces: list[list[str]] = []
        self._tool_stream = None if tools is None else ToolCallStream(tools)
        self._is_single_tool_use = is_single_tool_use
        self._open: str | None = None  # the type of the last block while it is open
        self._call_index = -1  # the chat tool-call index of the open tool_use block
        self._num_tool_uses = 0
        self._skipped_calls: set[int] = set()  # after the first, with single tool use

    @property
    def has_tool_use(self) -> bool:
        return self._num_tool_uses > 0

    def push(self, reasoning_delta: str, text_delta: str) -> list[Event]:
        """One update's thinking text and answer text -> its events."""
        events: list[Event] = []
        if reasoning_delta:
            self._delta("thinking", {"type": "thinking_delta", "thinking": reasoning_delta},
                        events)
        if text_delta:
            if self._tool_stream is None:
                self._delta("text", {"type": "text_delta", "text": text_delta}, events)
            else:
                self._chat_deltas(self._tool_stream.push(text_delta), events)
        return events

    def finish(self) -> list[Event]:
        """The output ended: what the tool parser held back, then the last block closes."""
        events: list[Event] = []
        if self._tool_stream is not None:
            self._chat_deltas(self._tool_stream.finish(), events)
        self._close(events)
        return events

    def content(self) -> list[dict[str, Any]]:
        """The content blocks as a whole response holds them (tool_use input an object)."""
        out = []
        for block, pieces in zip(self.blocks, self._pieces, strict=True):
            text = "".join(pieces)
            if block["type"] == "tool_use":
                out.append({**block, "input": _arguments(text)})
            elif block["type"] == "thinking":
                out.append({**block, "thinking": text,
                            "signature": thinking_signature(text)})
            else:
                out.append({**block, "text": text})
        return out

    def _chat_deltas(self, deltas: list[dict[str, Any]], events: list[Event]) -> None:
        for delta in deltas:
            if delta.get("content"):
                self._delta("text", {"type": "text_delta", "text": delta["content"]}, events)
            for call in delta.get("tool_calls") or ():
                self._call_delta(call, events)

    def _call_delta(self, call: dict[str, Any], events: list[Event]) -> None:
        index = call["index"]
        if index in self._skipped_calls:
            return
        if call.get("id"):  # a new call starts
            if self._is_single_tool_use and self._num_tool_uses:
                self._skipped_calls.add(index)
                return
            self._close(events)
            self._num_tool_uses += 1
            self._call_index = index
            self._open_block({"type": "tool_use", "id": tool_use_id(call["id"]),
                              "name": call["function"]["name"], "input": {}}, events)
        fragment = call["function"].get("arguments")
        if fragment and index == self._call_index and self._open == "tool_use":
            self._pieces[-1].append(fragment)
            events.append(("content_block_delta", {
                "type": "content_block_delta", "index": len(self.blocks) - 1,
                "delta": {"type": "input_json_delta", "partial_json": fragment}}))

    def _delta(self, kind: str, delta: dict[str, Any], events: list[Event]) -> None:
        """Text or thinking: into the open block of its kind, or a new one."""
        if self._open != kind:
            self._close(events)
            self._open_block({"type": "text", "text": ""} if kind == "text"
                             else {"type": "thinking", "thinking": "", "signature": ""}, events)
        self._pieces[-1].append(delta[kind])
        events.append(("content_block_delta", {"type": "content_block_delta",
                                               "index": len(self.blocks) - 1, "delta": delta}))

    def _open_block(self, block: dict[str, Any], events: list[Event]) -> None:
        self.blocks.append(block)
        self._pieces.append([])
        self._open = block["type"]
        events.append(("content_block_start", {"type": "content_block_start",
                                               "index": len(self.blocks) - 1,
                                               "content_block": block}))

    def _close(self, events: list[Event]) -> None:
        if self._open is None:
            return
        index = len(self.blocks) - 1
        if self._open == "thinking":
            signature = thinking_signature("".join(self._pieces[index]))
            events.append(("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "signature_delta", "signature": signature}}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        self._open = None


def _arguments(text: str) -> Any:
    """A tool_use block's input: the arguments' JSON object; a call cut short (max_tokens)
    keeps what could be read: {} when nothing parses."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def message_shell(message_id: str, model: str, num_prompt_tokens: int) -> dict[str, Any]:
    """The message as message_start announces it: no content, no stop reason yet."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage(num_prompt_tokens, 0)}


def message_start_events(message_id: str, model: str, num_prompt_tokens: int) -> list[Event]:
    return [("message_start", {"type": "message_start",
                               "message": message_shell(message_id, model, num_prompt_tokens)}),
            ("ping", {"type": "ping"})]


def message_end_events(reason: str | None, stop_sequence: str | None,
                       usage_now: dict[str, int]) -> list[Event]:
    return [("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                               "usage": usage_now}),
            ("message_stop", {"type": "message_stop"})]


def message_response(message_id: str, model: str, content: list[dict[str, Any]],
                     reason: str | None, stop_sequence: str | None,
                     usage_now: dict[str, int]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": usage_now}
