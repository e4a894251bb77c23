"""The request fields a Responses object repeats (`tools`, `tool_choice`, `reasoning`,
`text`, `user`, ...), checked and built once when the request is parsed.

A response object is serialised several times (response.created, response.in_progress and
response.completed on a stream, the store, every GET), so what it echoes must be small and
known: each echoed field is bounded (a clear 400 past the bound, as OpenAI bounds `metadata`:
16 keys, 64-character keys, 512-character values) and holds only the keys this server reads.
What is rendered into the prompt (instructions, function tools) is bounded by the context
length already; what is not (hosted tools this server drops, free-text identifiers) is
bounded here.
"""

from __future__ import annotations

import json
from typing import Any

from zeroserve.gateway.api.openai_schema import SERVICE_TIERS
from zeroserve.gateway.errors import invalid_request

# The request fields a response object repeats, and their defaults.
ECHOED_DEFAULTS: dict[str, Any] = {
    "instructions": None, "max_output_tokens": None, "metadata": {},
    "parallel_tool_calls": True, "previous_response_id": None, "prompt_cache_key": None,
    "reasoning": None, "safety_identifier": None, "service_tier": "default", "store": True,
    "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto",
    "tools": [], "top_p": 1.0, "truncation": "disabled", "user": None,
    "max_tool_calls": None, "top_logprobs": 0}
# Free-text identifiers: OpenAI's bound for safety_identifier; metadata's value bound for
# the others (a conversation or end-user name needs no more).
MAX_IDENTIFIER_CHARS = {"safety_identifier": 64, "user": 512, "prompt_cache_key": 512}
# A tool this server does not run is echoed as sent, so it is bounded as JSON, each and all.
MAX_DROPPED_TOOL_BYTES = 16 * 1024
MAX_DROPPED_TOOLS = 128
MAX_NAME_CHARS = 128  # a namespace's, a tool type's, an allowed tool's name
MAX_DESCRIPTION_CHARS = 4096  # text.format's and a namespace's description (not rendered)
# Echoed scalars some paths of chat's parser do not check (parallel_tool_calls without
# tools): their types, checked here whatever the path.
_SCALAR_TYPES = {"parallel_tool_calls": (bool,), "temperature": (int, float),
                 "top_p": (int, float), "top_logprobs": (int,), "max_output_tokens": (int,)}
_FUNCTION_KEYS = ("type", "name", "description", "parameters", "strict")
_FORMAT_KEYS = ("type", "name", "schema", "strict", "description")


def echoed_fields(body: dict[str, Any], store: bool) -> dict[str, Any]:
    """The fields the response object repeats, each bounded; 400 for one past its bound.
    Called after the body's fields were checked for type (parse_responses)."""
    echoed = {k: default if body.get(k) is None else body[k]
              for k, default in ECHOED_DEFAULTS.items()}
    for name, limit in MAX_IDENTIFIER_CHARS.items():
        _check_chars(body.get(name), name, limit)
    for name, types in _SCALAR_TYPES.items():
        value = body.get(name)
        if value is not None and (type(value) not in types):
            raise invalid_request(f"'{name}' must be {' or '.join(t.__name__ for t in types)}.",
                                  param=name)
    if echoed["service_tier"] not in SERVICE_TIERS:
        raise invalid_request(f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}.",
                              param="service_tier")
    max_calls = body.get("max_tool_calls")
    if max_calls is not None and not (type(max_calls) is int and max_calls >= 1):
        raise invalid_request("'max_tool_calls' must be an integer >= 1.",
                              param="max_tool_calls")
    echoed["reasoning"] = _known(body.get("reasoning"), ("effort", "summary"))
    echoed["text"] = _text(body.get("text"))
    echoed["tool_choice"] = _tool_choice(body.get("tool_choice"))
    echoed["tools"] = _tools(body.get("tools"))
    echoed["store"] = store
    return echoed


def _check_chars(value: Any, param: str, limit: int) -> None:
    if value is not None and (not isinstance(value, str) or len(value) > limit):
        raise invalid_request(f"'{param}' must be a string of at most {limit} characters.",
                              param=param)


def _known(value: Any, keys: tuple[str, ...]) -> dict[str, Any] | None:
    """An object with only `keys` (the others are not read, so not repeated)."""
    if not isinstance(value, dict):
        return None
    return {k: value[k] for k in keys if k in value}


def _text(text: Any) -> dict[str, Any]:
    if not isinstance(text, dict):
        return dict(ECHOED_DEFAULTS["text"])
    fmt = _known(text.get("format"), _FORMAT_KEYS) or {"type": "text"}
    _check_chars(fmt.get("description"), "text.format.description", MAX_DESCRIPTION_CHARS)
    _check_chars(fmt.get("name"), "text.format.name", MAX_NAME_CHARS)
    out = {"format": fmt}
    if text.get("verbosity") is not None:
        out["verbosity"] = text["verbosity"]
    return out


def _tool_choice(choice: Any) -> Any:
    """tool_choice as sent, with only the keys read (its shape was checked already)."""
    if not isinstance(choice, dict):
        return choice or "auto"
    if choice.get("type") == "allowed_tools":
        tools = []
        for i, entry in enumerate(choice.get("tools") or ()):
            _check_chars(entry.get("name"), f"tool_choice.tools[{i}].name", MAX_NAME_CHARS)
            tools.append(_known(entry, ("type", "name")))
        return {"type": "allowed_tools", "mode": choice.get("mode", "auto"), "tools": tools}
    _check_chars(choice.get("name"), "tool_choice.name", MAX_NAME_CHARS)
    _check_chars(choice.get("type"), "tool_choice.type", MAX_NAME_CHARS)
    return _known(choice, ("type", "name"))


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools with the keys read; namespaces likewise; a tool this server drops as
    sent when it is small (each within MAX_DROPPED_TOOL_BYTES, at most MAX_DROPPED_TOOLS)."""
    out: list[dict[str, Any]] = []
    num_dropped = 0
    for i, tool in enumerate(tools or ()):
        kind = tool["type"]
        if kind == "function":
            out.append(_known(tool, _FUNCTION_KEYS))
        elif kind == "namespace":
            _check_chars(tool.get("name"), f"tools[{i}].name", MAX_NAME_CHARS)
            _check_chars(tool.get("description"), f"tools[{i}].description",
                         MAX_DESCRIPTION_CHARS)
            inner = []
            for j, sub in enumerate(tool["tools"]):
                if sub["type"] == "function":
                    inner.append(_known(sub, _FUNCTION_KEYS))
                else:
                    num_dropped += 1
                    inner.append(_dropped(sub, f"tools[{i}].tools[{j}]"))
            out.append({"type": "namespace", "name": tool["name"], "tools": inner}
                       | _known(tool, ("description",)))
        else:
            num_dropped += 1
            out.append(_dropped(tool, f"tools[{i}]"))
        if num_dropped > MAX_DROPPED_TOOLS:
            raise invalid_request(f"'tools' holds more than {MAX_DROPPED_TOOLS} tools of types "
                                  "this server does not run.", param="tools")
    return out


def _dropped(tool: dict[str, Any], param: str) -> dict[str, Any]:
    _check_chars(tool["type"], f"{param}.type", MAX_NAME_CHARS)
    size = len(json.dumps(tool, ensure_ascii=False, separators=(",", ":")).encode())
    if size > MAX_DROPPED_TOOL_BYTES:
        raise invalid_request(f"'{param}' (a {tool['type'][:MAX_NAME_CHARS]} tool, which this "
                              f"server does not run) takes {size} bytes as JSON; at most "
                              f"{MAX_DROPPED_TOOL_BYTES} are accepted.", param=param)
    return tool
