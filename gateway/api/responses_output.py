"""OpenAI Responses API output: the response object, its output items, and the streamed
events, as OpenAI sends them.

One `ResponseBuilder` per response. Fed one choice's pieces in order (reasoning text, answer
text, tool-call deltas in chat's shape from api/tool_calls.ToolCallStream), it keeps the
output items and, for a stream, returns the events each piece makes:

    response.created, response.in_progress
    per item: response.output_item.added
      reasoning: response.content_part.added, response.reasoning_text.delta ...,
                 response.reasoning_text.done, response.content_part.done
      message:   response.content_part.added, response.output_text.delta ...,
                 response.output_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta ...,
                 response.function_call_arguments.done
    response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it)

A failure ends a stream with response.failed. Every event has `type` and a
`sequence_number` counting from 0; the SSE lines carry `event: TYPE` too.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from zeroserve.gateway.api.responses_request import ResponsesRequest
from zeroserve.gateway.errors import APIError

# Error codes a response object's `error` may hold (OpenAI's list); others are server_error.
_RESPONSE_ERROR_CODES = ("server_error", "rate_limit_exceeded", "invalid_prompt")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def responses_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    details = chat_usage.get("completion_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": (chat_usage.get("prompt_tokens_details")
                                                       or {}).get("cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": chat_usage["total_tokens"]}


def error_code(e: APIError) -> str:
    if e.code in _RESPONSE_ERROR_CODES:
        return e.code
    if e.status == 429:
        return "rate_limit_exceeded"
    return "server_error"


class ResponseBuilder:
    """One response's output items, built from its pieces; events for a stream."""

    def __init__(self, request: ResponsesRequest, model: str, response_id: str | None = None):
        self.request = request
        self.model = model
        self.id = response_id or new_id("resp")
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item still being written
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self._sequence = 0
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_reason: str | None = None

    # --- the response object -------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        echoed = self.request.echo  # (api/responses_echo.py)
        out = {"id": self.id, "object": "response", "created_at": self.created_at,
               "status": self.status, "background": False, "error": self.error,
               "incomplete_details": None if self.incomplete_reason is None
               else {"reason": self.incomplete_reason},
               "model": self.model, "output": self.output, **echoed, "usage": self.usage}
        if self.status == "completed":
            out["completed_at"] = int(time.time())
        return out

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response()
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    # --- pieces in -----------------------------------------------------------------------

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = self._switch_to("reasoning")
        item = self._open
        item["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                  output_index=self._index(item), content_index=0,
                                  delta=text))
        return events

    def text(self, text: str, logprobs: list[dict[str, Any]] | None = None
             ) -> list[dict[str, Any]]:
        """Answer text; `logprobs`: its tokens' (chat's `logprobs.content` entries, which
        are the Responses shape too), when the request included them."""
        if not text:
            return []
        events = self._switch_to("message")
        item = self._open
        part = item["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs or []
        events.append(self._event("response.output_text.delta", item_id=item["id"],
                                  output_index=self._index(item), content_index=0,
                                  delta=text, logprobs=logprobs or []))
        return events

    def text_item(self) -> list[dict[str, Any]]:
        """Open a message item (if none is) without text yet."""
        return self._switch_to("message")

    def chat_delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """One of ToolCallStream's chat deltas: content, or a tool call's start/arguments."""
        events = []
        if delta.get("reasoning_content"):
            events += self.reasoning(delta["reasoning_content"])
        if delta.get("content"):
            events += self.text(delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call_delta(call)
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index = call["index"]
        function = call.get("function") or {}
        events = []
        item = self._calls.get(index)
        if item is None:
            events += self._close()
            name = function.get("name", "")
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                    "arguments": "", "call_id": call.get("id") or new_id("call"),
                    "name": name}
            namespace = self.request.namespaces.get(name)
            if namespace is not None:
                item["namespace"] = namespace
            self._calls[index] = item
            events += self._add(item)
        fragment = function.get("arguments") or ""
        if fragment:
            item["arguments"] += fragment
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=self._index(item),
                                      delta=fragment))
        return events

    def finish(self, finish_reason: str | None, chat_usage: dict[str, Any]
               ) -> list[dict[str, Any]]:
        """The last events: the open item closed, then response.completed (or
        response.incomplete: cut by max_output_tokens)."""
        if finish_reason == "length":
            self.incomplete_reason = "max_output_tokens"
        events = self._close()
        self.usage = responses_usage(chat_usage)
        if self.incomplete_reason is not None:
            self.status = "incomplete"
            return events + [self._event("response.incomplete", response=self.response())]
        self.status = "completed"
        return events + [self._event("response.completed", response=self.response())]

    def fail(self, e: APIError) -> list[dict[str, Any]]:
        # The item being written is cut: no .done events for it, so none of their
        # sequence numbers either (a client sees response.failed right after the last delta).
        item, self._open = self._open, None
        if item is not None:
            item["status"] = "incomplete"
        self.status = "failed"
        self.error = {"code": error_code(e), "message": e.message}
        return [self._event("response.failed", response=self.response())]

    # --- items ---------------------------------------------------------------------------

    def _index(self, item: dict[str, Any]) -> int:
        return len(self.output) - 1 if self.output and self.output[-1] is item \
            else self.output.index(item)

    def _switch_to(self, kind: str) -> list[dict[str, Any]]:
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._close()
        if kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}],
                    "status": "in_progress"}
        else:
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": [{"type": "output_text", "text": "",
                                                      "annotations": [], "logprobs": []}]}
        events += self._add(item)
        part = dict(item["content"][0], text="")
        events.append(self._event("response.content_part.added", item_id=item["id"],
                                  output_index=self._index(item), content_index=0, part=part))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1,
                            item=_snapshot(item))]

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self._index(item)
        item["status"] = "incomplete" if self.incomplete_reason is not None else "completed"
        if item["type"] == "reasoning":
            part = item["content"][0]
            done = [self._event("response.reasoning_text.done", item_id=item["id"],
                                output_index=index, content_index=0, text=part["text"]),
                    self._event("response.content_part.done", item_id=item["id"],
                                output_index=index, content_index=0, part=dict(part))]
        elif item["type"] == "message":
            part = item["content"][0]
            done = [self._event("response.output_text.done", item_id=item["id"],
                                output_index=index, content_index=0, text=part["text"],
                                logprobs=part["logprobs"]),
                    self._event("response.content_part.done", item_id=item["id"],
                                output_index=index, content_index=0, part=dict(part))]
        else:
            done = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, name=item["name"],
                                arguments=item["arguments"])]
        return done + [self._event("response.output_item.done", output_index=index,
                                   item=_snapshot(item))]


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it stands now (events must not change when the item grows later)."""
    return json.loads(json.dumps(item))


def build_response(request: ResponsesRequest, model: str, chat: dict[str, Any],
                   response_id: str | None = None) -> ResponseBuilder:
    """A whole chat completion (one choice) -> the response's items, as a stream would
    have built them."""
    builder = ResponseBuilder(request, model, response_id)
    choice = chat["choices"][0]
    message = choice["message"]
    builder.reasoning(message.get("reasoning_content") or "")
    builder.text(message.get("content") or "", (choice.get("logprobs") or {}).get("content"))
    if not message.get("content") and not message.get("tool_calls"):
        builder.text_item()  # nothing said: an empty message, as OpenAI answers
    for index, call in enumerate(message.get("tool_calls") or ()):
        builder.chat_delta({"tool_calls": [{"index": index, "id": call["id"],
                                            "function": call["function"]}]})
    finish = choice["finish_reason"]
    builder.finish(finish, chat["usage"])
    return builder
