"""OpenAI Responses API request bodies (`POST /v1/responses`) -> a chat request.

The Responses API is chat with other spellings: `input` items become chat messages
(`function_call` items an assistant message's tool calls, `function_call_output` items tool
messages), `instructions` a system message, flat function tools chat's nested ones,
`text.format` chat's `response_format`, `max_output_tokens` its `max_tokens`. The chat body
built here goes through `parse_chat`, so both endpoints check, template, constrain and
sample alike; a mistake it finds is renamed to the Responses field it came from.

What this server cannot run is left out rather than refused, as clients send it by default:
hosted tool types (`web_search`, `image_generation`, `mcp`, ...) are dropped (the caller logs
them), and so are the `reasoning` items of earlier turns (a model's old thinking is not
shown to it again, as chat templates of reasoning models drop it too). A `namespace` tool's
function tools are offered to the model like the others.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from zeroserve.gateway.api.limits import RequestLimits
from zeroserve.gateway.api.openai_schema import DEFAULT_LIMITS, ChatRequest, parse_chat
from zeroserve.gateway.api.responses_echo import echoed_fields
from zeroserve.gateway.errors import APIError, invalid_request

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_INPUT_ITEMS = 4096
MAX_ALLOWED_TOOLS = 512  # allowed_tools' entries (a hosted tool may be named too)
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # `include` asks for the text's logprobs
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# Sampling fields that mean the same in both APIs (vLLM's extras included).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "stop", "parallel_tool_calls",
                    "logit_bias", "min_tokens", "ignore_eos", "skip_special_tokens",
                    "priority", "service_tier")
# Text parts of a message, by what they hold.
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
# Items of earlier turns that carry nothing the model needs to see again.
_SKIPPED_ITEMS = ("reasoning", "compaction", "web_search_call", "file_search_call",
                  "image_generation_call", "code_interpreter_call", "mcp_list_tools",
                  "mcp_approval_request", "mcp_approval_response", "tool_search_call",
                  "tool_search_output")
# What the store keeps of each item items_to_messages reads (besides its type and id).
_STORED_KEYS = {"message": ("role", "content"),
                "function_call": ("call_id", "name", "arguments", "input"),
                "custom_tool_call": ("call_id", "name", "arguments", "input"),
                "function_call_output": ("call_id", "output"),
                "custom_tool_call_output": ("call_id", "output")}
_MAX_ITEM_ID_CHARS = 128
# Chat's parameter names -> the Responses fields they came from (for error messages).
_PARAM_NAMES = {"max_tokens": "max_output_tokens", "messages": "input",
                "response_format": "text.format"}


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request: the chat request it runs as, and what only Responses has."""

    chat: ChatRequest
    echo: dict[str, Any]  # the fields the response object repeats (api/responses_echo.py)
    input_items: list[dict[str, Any]]  # this turn's input, as items (for the store)
    store: bool = True
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    # Namespace tools' functions: function name -> its namespace (function_call items say it).
    namespaces: dict[str, str] = field(default_factory=dict)
    dropped_tools: tuple[str, ...] = ()  # tool types this server cannot run (warned, left out)

    @property
    def stream(self) -> bool:
        return self.chat.stream


def parse_responses(body: dict, served_names: tuple[str, ...],
                    limits: RequestLimits = DEFAULT_LIMITS,
                    history: list[dict[str, Any]] | None = None) -> ResponsesRequest:
    """A Responses body -> a typed request. `history`: the items of the stored conversation
    that `previous_response_id` continues (its inputs and outputs), which come first."""
    _reject_unsupported(body)
    input_items = _parse_input(body.get("input"))
    instructions = _get_str(body, "instructions")
    store = _get_bool(body, "store", True)
    previous = _get_str(body, "previous_response_id")
    cache_key = _get_str(body, "prompt_cache_key")
    _check_metadata(body.get("metadata"))
    _check_string_list(body, "include")
    _check_choice(body, "truncation", ("auto", "disabled"))
    text_format = _parse_text(body.get("text"))
    template_kwargs = _parse_reasoning(body.get("reasoning"), body.get("chat_template_kwargs"))
    tools, namespaces, dropped = _parse_tools(body.get("tools"))
    messages = items_to_messages((history or []) + input_items, instructions)
    chat: dict[str, Any] = {"messages": messages, "stream": _get_bool(body, "stream", False)}
    if "model" in body:
        chat["model"] = body["model"]
    for name in _SAMPLING_FIELDS:
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if text_format is not None:
        chat["response_format"] = text_format
    if LOGPROBS_INCLUDE in (body.get("include") or ()) or body.get("top_logprobs"):
        chat["logprobs"] = True  # (chat checks top_logprobs' range)
        chat["top_logprobs"] = body.get("top_logprobs")
    if template_kwargs:
        chat["chat_template_kwargs"] = template_kwargs
    choice = _tool_choice(body.get("tool_choice"), tools)
    if tools:
        chat["tools"] = tools
    if choice is not None:
        chat["tool_choice"] = choice
    echo = echoed_fields(body, store)
    try:
        request = parse_chat(chat, served_names, limits)
    except APIError as e:
        raise responses_param(e) from None
    return ResponsesRequest(request, echo, input_items, store, previous, cache_key,
                            namespaces, dropped)


def responses_param(e: APIError) -> APIError:
    """A chat error, naming the Responses field the chat field came from."""
    param = e.param or ""
    head, dot, rest = param.partition(".")
    head, bracket, index = head.partition("[")
    if head in _PARAM_NAMES:
        e.param = _PARAM_NAMES[head]
        if head == "messages" and bracket:
            e.param = "input"  # messages do not map one to one to input items
        e.message = e.message.replace(f"'{param}'", f"'{e.param}'")
        if not dot:
            e.message = e.message.replace(f"'{head}'", f"'{e.param}'")
    return e


# --- fields --------------------------------------------------------------------------------

def _get_str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise invalid_request(f"'{name}' must be a string.", param=name)
    return value


def _get_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_request(f"'{name}' must be a boolean.", param=name)
    return value


def _check_choice(body: dict, name: str, allowed: tuple[str, ...]) -> None:
    value = body.get(name)
    if value is not None and value not in allowed:
        raise invalid_request(f"'{name}' must be one of {', '.join(allowed)}.", param=name)


def _check_string_list(body: dict, name: str) -> None:
    value = body.get(name)
    if value is not None and not (isinstance(value, list)
                                  and all(isinstance(v, str) for v in value)):
        raise invalid_request(f"'{name}' must be an array of strings.", param=name)


def _reject_unsupported(body: dict) -> None:
    if body.get("background"):
        raise invalid_request("'background' responses are not supported: send the request "
                              "and wait for it (or stream it).", param="background")
    if body.get("conversation") is not None:
        raise invalid_request("'conversation' is not supported: continue a conversation with "
                              "'previous_response_id' or send its items in 'input'.",
                              param="conversation")
    if body.get("prompt") is not None:
        raise invalid_request("'prompt' (stored prompt templates) is not supported.",
                              param="prompt")
    if body.get("n") not in (None, 1):
        raise invalid_request("'n' is not a Responses parameter: one response per request.",
                              param="n")


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS:
        raise invalid_request(f"'metadata' must be an object of at most {MAX_METADATA_KEYS} "
                              "string values.", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str) \
                or len(value) > MAX_METADATA_VALUE_CHARS:
            raise invalid_request(f"'metadata' keys must have at most {MAX_METADATA_KEY_CHARS} "
                                  f"characters and values be strings of at most "
                                  f"{MAX_METADATA_VALUE_CHARS}.", param="metadata")


def _parse_text(text: Any) -> dict | None:
    """text.format -> chat's response_format (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid_request("'text' must be an object.", param="text")
    if text.get("verbosity") not in (None, "low", "medium", "high"):
        raise invalid_request("'text.verbosity' must be low, medium or high.",
                              param="text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_request("'text.format' must be an object.", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise invalid_request("'text.format.type' must be text, json_object or json_schema.",
                          param="text.format.type")


def _parse_reasoning(reasoning: Any, template_kwargs: Any) -> dict[str, Any]:
    """reasoning.effort -> the chat template's arguments: `reasoning_effort` for templates
    that read it, and "none" turns Qwen3's thinking off (`enable_thinking: false`).
    chat_template_kwargs (vLLM's extension) may set either itself."""
    kwargs: dict[str, Any] = {}
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid_request("'reasoning' must be an object.", param="reasoning")
        effort = reasoning.get("effort")
        if effort is not None:
            if effort not in REASONING_EFFORTS:
                raise invalid_request(f"'reasoning.effort' must be one of "
                                      f"{', '.join(REASONING_EFFORTS)}.",
                                      param="reasoning.effort")
            kwargs["reasoning_effort"] = effort
            if effort == "none":
                kwargs["enable_thinking"] = False
        if reasoning.get("summary") not in (None, "auto", "concise", "detailed"):
            raise invalid_request("'reasoning.summary' must be auto, concise or detailed.",
                                  param="reasoning.summary")
    if template_kwargs is not None:
        if not isinstance(template_kwargs, dict):
            raise invalid_request("'chat_template_kwargs' must be an object.",
                                  param="chat_template_kwargs")
        kwargs.update(template_kwargs)
    return kwargs


# --- tools ---------------------------------------------------------------------------------

def _parse_tools(tools: Any) -> tuple[list[dict], dict[str, str], tuple[str, ...]]:
    """Responses tools -> (chat function tools, function -> namespace, dropped types)."""
    if tools is None:
        return [], {}, ()
    if not isinstance(tools, list):
        raise invalid_request("'tools' must be an array.", param="tools")
    out: list[dict] = []
    namespaces: dict[str, str] = {}
    dropped: list[str] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise invalid_request(f"'tools[{i}]' must be an object with a 'type'.",
                                  param=f"tools[{i}]")
        kind = tool["type"]
        if kind == "function":
            out.append(_function_tool(tool, f"tools[{i}]"))
        elif kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(inner, list) or not isinstance(tool.get("name"), str):
                raise invalid_request(f"'tools[{i}]' (a namespace) must have a 'name' and "
                                      "'tools'.", param=f"tools[{i}]")
            for j, sub in enumerate(inner):
                param = f"tools[{i}].tools[{j}]"
                if isinstance(sub, dict) and sub.get("type") == "function":
                    function = _function_tool(sub, param)
                    namespaces[function["function"].get("name")] = tool["name"]
                    out.append(function)
                elif isinstance(sub, dict) and isinstance(sub.get("type"), str):
                    dropped.append(f"{tool['name']}.{sub['type']}")
                else:
                    raise invalid_request(f"'{param}' must be an object with a 'type'.",
                                          param=param)
        else:
            dropped.append(kind)
    return out, namespaces, tuple(dropped)


def _function_tool(tool: dict, param: str) -> dict:
    """{"type": "function", "name", "description", "parameters", "strict"} -> chat's."""
    name = tool.get("name")
    if not isinstance(name, str):
        raise invalid_request(f"'{param}.name' must be a string.", param=f"{param}.name")
    function = {"name": name}
    for key in ("description", "parameters"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
        raise invalid_request(f"'{param}.strict' must be a boolean.", param=f"{param}.strict")
    return {"type": "function", "function": function}


def _tool_choice(choice: Any, tools: list[dict]) -> Any:
    """tool_choice -> chat's; None leaves it to chat's default ("auto" with tools)."""
    if choice is None:
        return None
    if choice in ("none", "auto"):
        return choice if tools else None  # every tool may have been dropped
    if choice == "required":
        if not tools:
            raise invalid_request("'tool_choice' is 'required' but no function tools are "
                                  "given (only function tools run here).", param="tool_choice")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise invalid_request("'tool_choice.name' must be a string.",
                                  param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = _allowed_names(choice.get("tools"))
        tools[:] = [t for t in tools if t["function"].get("name") in allowed]
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise invalid_request("'tool_choice.mode' must be auto or required.",
                                  param="tool_choice.mode")
        return _tool_choice(mode, tools)
    raise invalid_request("'tool_choice' must be 'none', 'auto', 'required', {\"type\": "
                          "\"function\", \"name\": ...} or allowed_tools; hosted tools do not "
                          "run here.", param="tool_choice")


def _allowed_names(entries: Any) -> set[str]:
    """allowed_tools' `tools` ([{"type": "function", "name": ...}, ...]) -> the names."""
    if not isinstance(entries, list) or len(entries) > MAX_ALLOWED_TOOLS:
        raise invalid_request(f"'tool_choice.tools' must be an array of at most "
                              f"{MAX_ALLOWED_TOOLS} tools.", param="tool_choice.tools")
    names = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise invalid_request(f"'tool_choice.tools[{i}]' must be an object with a "
                                  "'name' string.", param=f"tool_choice.tools[{i}]")
        names.add(entry["name"])
    return names


# --- input items -> chat messages ------------------------------------------------------------

def _parse_input(value: Any) -> list[dict[str, Any]]:
    """`input` as items: a string is one user message."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid_request("'input' must be a string or a non-empty array of items.",
                              param="input")
    if len(value) > MAX_INPUT_ITEMS:
        raise invalid_request(f"'input' may hold at most {MAX_INPUT_ITEMS} items.",
                              param="input")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise invalid_request(f"'input[{i}]' must be an object.", param=f"input[{i}]")
    return value


def items_to_messages(items: list[dict[str, Any]], instructions: str | None
                      ) -> list[dict[str, Any]]:
    """Responses items -> chat messages; consecutive calls join one assistant message."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, param))
        elif kind in ("function_call", "custom_tool_call"):
            _add_call(messages, item, param)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise invalid_request(f"'{param}.call_id' must be a string.",
                                      param=f"{param}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _output_text(item.get("output"), f"{param}.output")})
        elif kind in _SKIPPED_ITEMS:
            continue
        elif kind == "item_reference":
            raise invalid_request(f"'{param}': item references are not supported; send the "
                                  "item itself or use 'previous_response_id'.", param=param)
        else:
            raise invalid_request(f"'{param}.type' {json.dumps(kind)[:40]} is not an input "
                                  "item this server reads (message, function_call, "
                                  "function_call_output).", param=f"{param}.type")
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    # Instructions and leading system/developer items make one system message: many chat
    # templates take only one, and only first (Codex sends two developer items).
    while len(messages) > 1 and messages[0]["role"] == messages[1]["role"] == "system":
        second = messages.pop(1)
        messages[0] = {**messages[0],
                       "content": messages[0]["content"] + "\n\n" + second["content"]}
    if not messages:
        raise invalid_request("'input' holds no message the model can read.", param="input")
    return messages


def stored_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as the store keeps them: only what items_to_messages reads (so what was
    rendered and billed), in the items' own shape. Items it skips (reasoning items and their
    encrypted_content, hosted tools' calls) and fields it does not read are left out.
    The items were checked by items_to_messages already."""
    out = []
    for item in items:
        kind = item.get("type", "message" if "role" in item else None)
        keys = _STORED_KEYS.get(kind)
        if keys is None:
            continue
        kept = {"type": kind} | {k: _stored_value(item[k]) for k in keys if k in item}
        item_id = item.get("id")
        if isinstance(item_id, str) and len(item_id) <= _MAX_ITEM_ID_CHARS:
            kept["id"] = item_id
        out.append(kept)
    return out


def _stored_value(value: Any) -> Any:
    """A text or an array of text parts, each with only its text."""
    if not isinstance(value, list):
        return value
    return [{"type": p["type"], "refusal": p["refusal"]} if p.get("type") == "refusal"
            else {"type": p["type"], "text": p["text"]} for p in value]


def _message(item: dict, param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("system", "developer", "user", "assistant"):
        raise invalid_request(f"'{param}.role' must be system, developer, user or assistant.",
                              param=f"{param}.role")
    content = item.get("content")
    if isinstance(content, list):
        content = _join_parts(content, f"{param}.content")
    elif not isinstance(content, str):
        raise invalid_request(f"'{param}.content' must be a string or an array of text parts.",
                              param=f"{param}.content")
    # Chat templates know system, not OpenAI's newer "developer" (its meaning is the same).
    return {"role": "system" if role == "developer" else role, "content": content}


def _join_parts(parts: list, param: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, dict) and part.get("type") in _TEXT_PARTS \
                and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, dict) and part.get("type") == "refusal" \
                and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            kind = part.get("type") if isinstance(part, dict) else None
            raise invalid_request(f"'{param}[{j}]' must be a text part (input_text or "
                                  f"output_text); {json.dumps(kind)[:40]} is not supported.",
                                  param=f"{param}[{j}]")
    return "\n".join(texts)


def _output_text(output: Any, param: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _join_parts(output, param)
    raise invalid_request(f"'{param}' must be a string or an array of text parts.",
                          param=param)


def _add_call(messages: list[dict[str, Any]], item: dict, param: str) -> None:
    name, call_id = item.get("name"), item.get("call_id")
    arguments = item.get("arguments", item.get("input", "{}"))
    if not isinstance(name, str) or not isinstance(call_id, str) \
            or not isinstance(arguments, str):
        raise invalid_request(f"'{param}' must have 'name', 'call_id' and 'arguments' "
                              "strings.", param=param)
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
