"""Tool calls: putting the tools in the prompt, and finding the calls in the model's output.

Prompt: a chat template that reads `tools` gets them as Hugging Face's apply_chat_template
gives them (and earlier calls' arguments as objects, as those templates expect). A template
that ignores them (SmolLM2's) gets them in a system message, Hermes-style: the functions
inside <tools></tools>, calls asked for as <tool_call>{"name": ..., "arguments": ...}
</tool_call>; earlier calls and results are written into the messages the same way.

Output, by tool_choice:
- "auto": the model's own syntax, parsed: Hermes-style <tool_call>{...}</tool_call> blocks
  (Qwen 2.5/3, Hermes, SmolLM with the prompt above) and Llama 3's bare JSON calls
  ({"name": ..., "parameters": {...}}, after an optional <|python_tag|>).
- a named function: the output *is* its arguments (a grammar forces it, structured_output.py).
- "required": the output is a JSON array of {"name", "arguments"} (forced by a grammar, which
  writes "name" first; the parser takes either order).

`ToolCallStream` turns a choice's text deltas into OpenAI's chat deltas as they come: content,
or for each call a first delta with its index, id, type and name, then argument fragments.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from zeroserve.gateway.api.openai_schema import ToolChoice
from zeroserve.gateway.errors import invalid_request
from zeroserve.gateway.text import bounded_json

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's "a tool call follows" (special: usually skipped)
_USES_TOOLS = re.compile(r"\btools\b")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_call_id()

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


# --- the prompt ------------------------------------------------------------------------

def template_uses_tools(template_source: str) -> bool:
    return bool(_USES_TOOLS.search(template_source))


def tools_system_prompt(functions: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                      for f in functions)
    return ("You are a function calling AI model. You are provided with function signatures "
            "within <tools></tools> XML tags. You may call one or more functions to assist "
            "with the user query. Don't make assumptions about what values to plug into "
            f"functions. Here are the available tools:\n<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a JSON object with the function name and "
            "arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")


def prepare_messages(messages: list[dict[str, Any]], tools: ToolChoice | None,
                     template_source: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template arguments that put `tools` (and earlier calls and
    their results) in front of the model."""
    has_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if tools is None and not has_history:
        return messages, {}
    if template_uses_tools(template_source):
        out = [_with_object_arguments(m, i) for i, m in enumerate(messages)]
        return out, ({"tools": tools.tools} if tools is not None else {})
    out = [_as_text(m, i) for i, m in enumerate(messages)]
    if tools is not None:
        prompt = tools_system_prompt(tools.functions)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": prompt + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _calls_of(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A message's earlier tool calls, each with a `function` object (others are dropped:
    the client's history is not validated beyond what rendering needs)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return []
    return [c for c in calls if isinstance(c, dict) and isinstance(c.get("function"), dict)]


def _history_arguments(arguments: Any, param: str) -> Any:
    """An earlier call's arguments as an object when they are JSON text (else as given);
    400 when they nest deeper than a request body may."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return bounded_json.loads(arguments)
    except bounded_json.TooDeep as e:
        raise invalid_request(f"'{param}' holds {e}.", param=param) from None
    except ValueError:
        return arguments


def _with_object_arguments(message: dict[str, Any], i: int) -> dict[str, Any]:
    """Templates (transformers' convention) read a call's arguments as an object."""
    calls = _calls_of(message)
    if not calls:
        return message
    fixed = []
    for j, call in enumerate(calls):
        function = dict(call["function"])
        function["arguments"] = _history_arguments(
            function.get("arguments"), f"messages[{i}].tool_calls[{j}].function.arguments")
        fixed.append({**call, "function": function})
    return {**message, "tool_calls": fixed}


def _as_text(message: dict[str, Any], i: int) -> dict[str, Any]:
    """For a template without tool support: calls and results written into the content."""
    calls = _calls_of(message)
    if calls:
        blocks = []
        for j, call in enumerate(calls):
            function = call["function"]
            arguments = _history_arguments(
                function.get("arguments"), f"messages[{i}].tool_calls[{j}].function.arguments")
            body = json.dumps({"name": function.get("name"), "arguments": arguments},
                              ensure_ascii=False)
            blocks.append(f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}")
        content = message["content"]
        text = (content + "\n" if content else "") + "\n".join(blocks)
        return {"role": message["role"], "content": text}
    if message["role"] == "tool":
        return {"role": "tool",
                "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    return message


# --- the output ------------------------------------------------------------------------

def _call_from_object(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if obj["name"] not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            bounded_json.loads(arguments)
        except ValueError:
            return None
        text = arguments
    else:
        text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(obj["name"], text)


def _parse_json_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    """Llama 3 style: the whole output is one call object, a list of them, or objects
    separated by ';'. None when it is not."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith(("{", "[")):
        return None
    try:
        parsed = bounded_json.loads(body)
        objects = parsed if isinstance(parsed, list) else [parsed]
    except ValueError:
        try:
            objects = [bounded_json.loads(part) for part in body.split(";") if part.strip()]
        except ValueError:
            return None
    calls = [_call_from_object(o, names) for o in objects]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def parse_tool_calls(text: str, tools: ToolChoice) -> tuple[str | None, list[ToolCall]]:
    """A whole output -> (content, calls) for tool_choice "auto"."""
    names = {f["name"] for f in tools.functions}
    json_calls = _parse_json_calls(text, names)
    if json_calls is not None:
        return None, json_calls
    if CALL_OPEN not in text:
        return text, []
    content, calls, rest = [], [], text
    while CALL_OPEN in rest:
        before, _, after = rest.partition(CALL_OPEN)
        body, closed, rest = after.partition(CALL_CLOSE)
        call = _parse_block(body, names)
        if call is None:  # not a call after all: keep it as text
            content.append(before + CALL_OPEN + body + (CALL_CLOSE if closed else ""))
            continue
        content.append(before)
        calls.append(call)
    content.append(rest)
    joined = "".join(content).strip()
    return (joined or None), calls


def _parse_block(body: str, names: set[str]) -> ToolCall | None:
    try:
        return _call_from_object(bounded_json.loads(body), names)
    except ValueError:
        return None


def parse_forced_calls(text: str, tools: ToolChoice) -> list[ToolCall]:
    """The output of a forced call (its grammar decided the shape). Each call's arguments
    are the model's own text, as the stream sends them; an output cut short (max_tokens)
    still gives the calls it started, the last with its arguments cut where the output was,
    as the stream sent them too. [] when it was cut before any call's name."""
    if tools.mode == "named":
        return [ToolCall(tools.name or "", text)]
    scanner = _ArrayCallScanner({f["name"] for f in tools.functions})
    scanner.push(text)
    return scanner.calls


def parse_calls(text: str, tools: ToolChoice) -> tuple[str | None, list[ToolCall]]:
    """A whole output -> (content, calls) for any tool_choice. A forced call's output is
    never content: the grammar made it JSON for the call, whole or cut short."""
    if tools.is_forced:
        return None, parse_forced_calls(text, tools)
    return parse_tool_calls(text, tools)


# --- streaming -------------------------------------------------------------------------

def _call_start(index: int, call_id: str, name: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": ""}}]}


def _call_arguments(index: int, fragment: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


class ToolCallStream:
    """One choice's text deltas -> OpenAI chat deltas (content, or tool-call pieces)."""

    def __init__(self, tools: ToolChoice):
        self.tools = tools
        self.names = {f["name"] for f in tools.functions}
        self.num_calls = 0
        self._buffer = ""
        self._mode = "text"  # auto: "text", "call" (inside <tool_call>), "json" (Llama 3)
        self._started = False  # auto: something decided how the output starts
        self._scanner = _ArrayCallScanner(self.names) if tools.mode == "required" else None

    def push(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.tools.mode == "named":
            deltas = []
            if self.num_calls == 0:
                self.num_calls = 1
                deltas.append(_call_start(0, new_call_id(), self.tools.name or ""))
            deltas.append(_call_arguments(0, text))
            return deltas
        if self._scanner is not None:
            return self._scanner.push(text)
        self._buffer += text
        return self._drain_auto(final=False)

    def finish(self) -> list[dict[str, Any]]:
        if self._scanner is not None:
            self.num_calls = self._scanner.num_calls
            return []
        if self.tools.mode == "named":
            return []
        return self._drain_auto(final=True)

    @property
    def has_calls(self) -> bool:
        if self._scanner is not None:
            return self._scanner.num_calls > 0
        return self.num_calls > 0

    def _emit_calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        deltas = []
        for call in calls:
            deltas.append(_call_start(self.num_calls, call.id, call.name))
            deltas.append(_call_arguments(self.num_calls, call.arguments))
            self.num_calls += 1
        return deltas

    def _drain_auto(self, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while True:
            if self._mode == "json":
                if not final:
                    return deltas
                calls = _parse_json_calls(self._buffer, self.names)
                text, self._buffer = self._buffer, ""
                return deltas + (self._emit_calls(calls) if calls else [{"content": text}])
            if self._mode == "call":
                body, closed, rest = self._buffer.partition(CALL_CLOSE)
                if not closed and not final:
                    return deltas
                call = _parse_block(body, self.names)
                if call is not None:
                    deltas += self._emit_calls([call])
                else:
                    deltas.append({"content": CALL_OPEN + body + (CALL_CLOSE if closed else "")})
                self._buffer, self._mode = rest, "text"
                if not rest:
                    return deltas
                continue
            # text
            if not self._started:
                stripped = self._buffer.lstrip()
                if not stripped and not final:
                    return deltas  # only whitespace so far: cannot tell yet
                self._started = bool(stripped) or final
                if stripped.startswith(("{", "[", PYTHON_TAG)) or (
                        PYTHON_TAG.startswith(stripped) and not final):
                    if PYTHON_TAG.startswith(stripped) and not final and stripped != PYTHON_TAG:
                        self._started = False  # maybe the tag, still arriving
                        return deltas
                    self._mode = "json"
                    continue
            before, found, after = self._buffer.partition(CALL_OPEN)
            if found:
                if before.strip():
                    deltas.append({"content": before})
                self._buffer, self._mode = after, "call"
                continue
            keep = 0 if final else _partial_suffix(self._buffer, CALL_OPEN)
            text = self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
            if text:
                deltas.append({"content": text})
            return deltas


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _json_or_none(text: str) -> Any:
    try:
        return bounded_json.loads(text)
    except ValueError:
        return None


class _At(enum.Enum):
    """Where _ArrayCallScanner is in a call object, at the object's own level."""
    KEY_NEXT = 1  # after "{" or ",": a key comes next
    KEY = 2  # inside a key
    VALUE_NEXT = 3  # after a key: ":" and then its value
    VALUE = 4  # inside a value
    VALUE_DONE = 5  # after a value: "," or "}" comes next


class _ArrayCallScanner:
    """Reads the calls of a "required" output, `[{"name": "f", "arguments": {...}}, ...]`, as
    it streams, with the keys in either order and any spacing. The grammar engine writes an
    object's properties in its schema's order, which names "name" first
    (structured_output.required_tool_grammar); a schema sent with sorted keys once put
    "arguments" first, and either order must give the same calls.

    A call starts (its index, id and name are sent) once its name is complete and one of the
    tools'; arguments after the name go out as they arrive. Arguments before the name are held
    until it comes: OpenAI's first delta of a call names it, and an object cut short before
    its name is no call. A call's arguments are the model's own text of the value, so the
    fragments join to exactly what parse_forced_calls returns (it runs this same scanner)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.calls: list[ToolCall] = []  # those started; the last may still be arriving
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._at: _At | None = None  # None: outside any call object
        self._key: str | None = None  # the key whose value comes or is being read
        self._text = ""  # the key or (not the arguments) value being read, as JSON text
        self._is_scalar = False  # the value is a number, true, false or null
        self._held: list[str] = []  # the arguments, while the call's name is not known
        self._has_arguments = False
        self._is_started = False  # this object's call was sent

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def push(self, text: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        fragment: list[str] = []  # the current call's arguments from this text: one delta
        for ch in text:
            depth, in_string = self._depth, self._in_string  # before ch
            self._track(ch)
            if self._at is None:
                if ch == "{" and depth == 1 and not in_string:  # an item of the array
                    self._open_object()
                continue
            if self._at is _At.VALUE:
                if not (self._is_scalar and (ch in ",}" or ch.isspace())):
                    self._add_value(ch, fragment)
                    if not self._is_scalar and self._depth == 2 and not self._in_string:
                        self._end_value(deltas, fragment)  # its closing quote or bracket
                    continue
                self._end_value(deltas, fragment)  # a scalar ends before ch: read ch below
            if self._depth == 1:  # the call object's closing brace
                self._close_object(deltas, fragment)
            elif self._at is _At.KEY:
                self._text += ch
                if not self._in_string:
                    self._key, self._at = _json_or_none(self._text), _At.VALUE_NEXT
            elif self._at is _At.KEY_NEXT and ch == '"':
                self._text, self._at = ch, _At.KEY
            elif self._at is _At.VALUE_DONE and ch == ",":
                self._at = _At.KEY_NEXT
            elif self._at is _At.VALUE_NEXT and ch != ":" and not ch.isspace():
                self._text, self._at, self._is_scalar = "", _At.VALUE, ch not in '"{['
                self._add_value(ch, fragment)
        self._flush(fragment, deltas)
        return deltas

    def _open_object(self) -> None:
        self._at, self._key, self._text = _At.KEY_NEXT, None, ""
        self._held.clear()
        self._has_arguments = self._is_started = False

    def _add_value(self, ch: str, fragment: list[str]) -> None:
        if self._key != "arguments":
            self._text += ch
        elif self._is_started:
            fragment.append(ch)
        else:
            self._held.append(ch)

    def _end_value(self, deltas: list[dict[str, Any]], fragment: list[str]) -> None:
        self._at = _At.VALUE_DONE
        if self._key == "arguments":
            self._has_arguments = True
        elif self._key == "name" and not self._is_started:
            name = _json_or_none(self._text)
            if isinstance(name, str) and name in self.names:
                self._start(name, deltas, fragment)

    def _start(self, name: str, deltas: list[dict[str, Any]], fragment: list[str]) -> None:
        # `fragment` is empty here: arguments reach it only once the call is started.
        call = ToolCall(name, "")
        self.calls.append(call)
        deltas.append(_call_start(len(self.calls) - 1, call.id, name))
        self._is_started = True
        fragment.extend(self._held)
        self._held.clear()

    def _close_object(self, deltas: list[dict[str, Any]], fragment: list[str]) -> None:
        if self._is_started and not self._has_arguments:
            fragment.append("{}")  # no arguments: none (as _call_from_object reads it)
        self._flush(fragment, deltas)
        self._at = None

    def _track(self, ch: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
            return
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1

    def _flush(self, fragment: list[str], deltas: list[dict[str, Any]]) -> None:
        if fragment:
            piece = "".join(fragment)
            self.calls[-1].arguments += piece
            deltas.append(_call_arguments(len(self.calls) - 1, piece))
            fragment.clear()
