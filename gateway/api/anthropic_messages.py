"""Anthropic Messages request bodies -> the same typed chat request the OpenAI endpoint makes.

`POST /v1/messages` is chat in another notation, so a Messages body is translated into the
fields of a chat body and parsed by `parse_chat` (one set of checks, one pipeline):

- `system` (a string or text blocks; Claude Code's billing-header block is left out, see
  BILLING_HEADER) is the leading system message. A `system`-role message inside `messages`
  (newer Claude Code sends one after the user's turn) stays where it was sent when the chat
  template renders it there (ChatML, Qwen, Llama 3 do): so a later one leaves the prompt's
  prefix, and its cached KV blocks, as they were. For a template that refuses or drops a
  system message there (Mistral's, Gemma's), `merged_system_prompt` joins them into the
  leading one, where it expects them.
- `tool_use` blocks become the assistant message's `tool_calls`; `tool_result` blocks become
  `tool` messages (their content a string or text blocks; `is_error` marks the text), in the
  order they came, before the rest of that user turn. Earlier `thinking` blocks are dropped,
  as Anthropic drops them from the context.
- A final assistant message is a prefill: the model continues it.
- `tools` (custom tools: `name`, `description`, `input_schema`) become functions; server
  tools (`web_search_...`, `bash_...`: they have a `type` of their own) are dropped, since
  nothing here runs them. `tool_choice` `auto`/`any`/`tool`/`none` become chat's
  `auto`/`required`/named/`none`.
- `max_tokens` is required; beyond the server's limit it is lowered to it (Claude Code asks
  for tens of thousands of tokens whatever the model), and the route lowers it to the room
  left in the context, where Anthropic would answer `max_tokens` at the end.
- `model`: Anthropic's names (`claude-…`) mean the served model, so Claude Code works with
  only `ANTHROPIC_BASE_URL` set; other names must be one of the server's.
- `output_config.format` (structured outputs: a JSON schema) becomes chat's
  `response_format`, enforced by a grammar as there.
- `thinking` turns the chat template's `enable_thinking` on or off; unknown fields (`metadata`,
  `service_tier`, beta fields) are ignored.

Every mistake is an `APIError` (400, or 404 for an unknown model) whose message names the
Messages field, not the chat field it became.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from zeroserve.gateway.api.limits import RequestLimits
from zeroserve.gateway.api.openai_schema import (
    DEFAULT_LIMITS,
    ChatPrompt,
    ChatRequest,
    parse_chat,
)
from zeroserve.gateway.errors import APIError, invalid_request

ROLES = ("user", "assistant", "system")
# Claude Code's first system block, "x-anthropic-billing-header: cc_version=2.1.197.fa0; …":
# metadata for Anthropic's billing, not words for the model, and its suffix changes with each
# conversation's first message. Left at the head of the prompt it would keep every new
# conversation from reusing the ~20k cached tokens of the system prompt after it.
BILLING_HEADER = "x-anthropic-billing-header:"
THINKING_TYPES = ("enabled", "disabled", "adaptive")
TOOL_CHOICE_TYPES = ("auto", "any", "tool", "none")
# Blocks an assistant turn may hold that say nothing to the next turn's model.
_SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
_UNSUPPORTED_BLOCKS = frozenset({"image", "document", "search_result", "container_upload"})
# chat's field names in parse_chat's messages -> the Messages names they came from.
_PARAM_NAMES = (("'stop'", "'stop_sequences'"), (".function.parameters", ".input_schema"),
                (".function.name", ".name"), ("'max_completion_tokens'", "'max_tokens'"),
                ("'response_format.json_schema.schema'", "'output_config.format.schema'"),
                ("'response_format'", "'output_config.format'"))


@dataclass(frozen=True)
class MessagesRequest:
    chat: ChatRequest  # the request in chat's terms: prompt, tools, sampling
    max_tokens: int  # as asked, at most the server's limit
    stream: bool = False
    is_single_tool_use: bool = False  # disable_parallel_tool_use: at most one tool_use
    dropped_tools: tuple[str, ...] = ()  # server tools, not offered to the model
    stop_sequences: tuple[str, ...] = ()

    @property
    def model(self) -> str:
        return self.chat.model


def parse_messages(body: dict, served_names: tuple[str, ...],
                   limits: RequestLimits = DEFAULT_LIMITS) -> MessagesRequest:
    """POST /v1/messages."""
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise invalid_request("max_tokens: Field required", param="max_tokens")
    if type(max_tokens) is not int or max_tokens < 1:
        raise invalid_request("max_tokens: must be an integer of at least 1.",
                              param="max_tokens")
    max_tokens = min(max_tokens, limits.max_tokens_limit)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid_request("stream: must be a boolean.", param="stream")
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(
            temperature, (int, float)) or not 0 <= temperature <= 1):
        raise invalid_request("temperature: must be a number in [0, 1].", param="temperature")
    chat_body, dropped, is_single = _chat_body(body)
    chat_body["model"] = served_model(body.get("model"), served_names)
    chat_body["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "priority"):  # (priority: vLLM's, as chat)
        if body.get(name) is not None:
            chat_body[name] = body[name]
    stops = _stop_sequences(body)
    if stops:
        chat_body["stop"] = list(stops)
    schema = _output_schema(body)
    if schema is not None:
        chat_body["response_format"] = {"type": "json_schema",
                                        "json_schema": {"name": "output", "schema": schema}}
    chat = _parse_as_chat(chat_body, served_names, limits)
    return MessagesRequest(chat, max_tokens, bool(stream), is_single, dropped, stops)


def parse_count_tokens(body: dict, served_names: tuple[str, ...],
                       limits: RequestLimits = DEFAULT_LIMITS) -> ChatPrompt:
    """POST /v1/messages/count_tokens: the prompt a Messages body makes (no max_tokens)."""
    chat_body, _, _ = _chat_body(body)
    chat_body["model"] = served_model(body.get("model"), served_names)
    return _parse_as_chat(chat_body, served_names, limits).prompt


def served_model(model: Any, served_names: tuple[str, ...]) -> Any:
    """Anthropic's model names ("claude-…", what Claude Code and the SDK's examples send
    unless told otherwise) mean the model this server serves; other names must be one of
    its names (else 404, as chat)."""
    if isinstance(model, str) and model.startswith("claude") and model not in served_names:
        return served_names[0]
    return model


def _parse_as_chat(chat_body: dict, served_names: tuple[str, ...],
                   limits: RequestLimits) -> ChatRequest:
    """parse_chat, with only the schemas a grammar enforces checked by the grammar engine:
    with `auto` a schema only goes into the prompt, and Claude Code's tools use JSON schema
    keywords (`propertyNames`) that constrained decoding does not implement."""
    tools = chat_body.get("tools")
    if tools:
        enforced = _enforced_tools(chat_body.get("tool_choice"), tools)
        chat_body = {**chat_body, "tools": [
            t if t["function"]["name"] in enforced else
            {**t, "function": {**t["function"], "parameters": {"type": "object"}}}
            for t in tools]}
    try:
        chat = parse_chat(chat_body, served_names, limits)
    except APIError as e:
        message = e.message
        for chat_name, name in _PARAM_NAMES:
            message = message.replace(chat_name, name)
        raise APIError(e.status, message, type=e.type, param=e.param, code=e.code,
                       headers=e.headers) from None
    if chat.tools is not None and tools:  # the prompt shows the tools as the client sent them
        chat = replace(chat, prompt=replace(chat.prompt, tools=replace(chat.tools, tools=tools)))
    return chat


def _enforced_tools(choice: Any, tools: list[dict[str, Any]]) -> set[str]:
    """The tools whose schemas a grammar enforces: all with `any`, the one `tool` names."""
    if choice == "required":
        return {t["function"]["name"] for t in tools}
    if isinstance(choice, dict):
        return {choice["function"]["name"]}
    return set()


def _chat_body(body: dict) -> tuple[dict, tuple[str, ...], bool]:
    """The chat fields of a Messages body: (chat body, dropped server tools, single call)."""
    system = _system_text(body.get("system"), "system")
    messages = _chat_messages(body.get("messages"))
    if system:
        messages.insert(0, {"role": "system", "content": system})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        chat["add_generation_prompt"] = False  # a prefill: the model goes on from it
        chat["continue_final_message"] = True
    thinking = _thinking(body.get("thinking"))
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    tools, dropped = _tools(body.get("tools"))
    is_single = False
    if tools:
        chat["tools"] = tools
        choice, is_single = _tool_choice(body.get("tool_choice"), {t["function"]["name"]
                                                                   for t in tools})
        chat["tool_choice"] = choice
        if is_single:
            chat["parallel_tool_calls"] = False
    else:
        _tool_choice(body.get("tool_choice"), None)
    return chat, dropped, is_single


def _output_schema(body: dict) -> dict | None:
    """Structured outputs: `output_config.format` (`{"type": "json_schema", "schema"}`; the
    SDK's `messages.parse(output_format=Model)` sends it), or the older beta's top-level
    `output_format`. The schema becomes chat's response_format: a grammar enforces it."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise invalid_request("output_config: must be an object.", param="output_config")
    param, fmt = "output_config.format", (config or {}).get("format")
    if fmt is None:
        param, fmt = "output_format", body.get("output_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(
            fmt.get("schema"), dict):
        raise invalid_request(f'{param}: must be {{"type": "json_schema", "schema": {{...}}}}.',
                              param=param)
    return fmt["schema"]


def _stop_sequences(body: dict) -> tuple[str, ...]:
    stops = body.get("stop_sequences")
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid_request("stop_sequences: must be an array of strings.",
                              param="stop_sequences")
    return tuple(s for s in stops if s)


def _system_text(system: Any, param: str) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        texts = (_text_of_block(b, f"{param}[{i}]") for i, b in enumerate(system))
        return "\n".join(t for t in texts if not t.startswith(BILLING_HEADER))
    raise invalid_request(f"{param}: must be a string or an array of text blocks.", param=param)


def _text_of_block(block: Any, param: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(
            block.get("text"), str):
        raise invalid_request(f'{param}: must be a text block {{"type": "text", "text": '
                              "string}.", param=param)
    return block["text"]


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages -> chat messages (system-role ones where they were)."""
    if not isinstance(messages, list) or not messages:
        raise invalid_request("messages: must be a non-empty array.", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        param = f"messages.{i}"
        if not isinstance(m, dict):
            raise invalid_request(f"{param}: must be an object.", param=param)
        role = m.get("role")
        if role not in ROLES:
            raise invalid_request(f"{param}.role: must be 'user' or 'assistant'.",
                                  param=f"{param}.role")
        blocks = _blocks(m.get("content"), f"{param}.content")
        if role == "system":
            out.append({"role": "system", "content": "\n".join(
                _text_of_block(b, f"{param}.content.{j}") for j, b in enumerate(blocks))})
        elif role == "assistant":
            out.append(_assistant_message(blocks, f"{param}.content"))
        else:
            out.extend(_user_messages(blocks, f"{param}.content"))
    if all(m["role"] == "system" for m in out):
        raise invalid_request("messages: must hold a user message, not only system ones.",
                              param="messages")
    return out


def later_system_texts(prompt: ChatPrompt) -> list[str]:
    """The text of the system messages after the first message."""
    return [m["content"] for m in prompt.messages[1:] if m["role"] == "system"]


def merged_system_prompt(prompt: ChatPrompt) -> ChatPrompt | None:
    """The prompt with the later system messages joined into the leading one, for templates
    that take a system message only first; None when there is no later one."""
    later = later_system_texts(prompt)
    if not later:
        return None
    first, rest = prompt.messages[0], [m for m in prompt.messages[1:] if m["role"] != "system"]
    if first["role"] == "system":
        lead = {**first, "content": "\n\n".join([first["content"], *later])}
    else:
        lead, rest = {"role": "system", "content": "\n\n".join(later)}, [first, *rest]
    return replace(prompt, messages=[lead, *rest])


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid_request(f"{param}: must be a string or an array of content blocks.",
                              param=param)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise invalid_request(f"{param}.{j}: must be a content block (an object with a "
                                  "'type').", param=f"{param}.{j}")
        kind = block["type"]
        if kind in _UNSUPPORTED_BLOCKS:
            raise invalid_request(f"{param}.{j}: '{kind}' blocks are not supported by this "
                                  "model (text only).", param=f"{param}.{j}")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise invalid_request(f"{param}.{j}.text: must be a string.",
                                  param=f"{param}.{j}.text")
    return content


def _assistant_message(blocks: list[dict[str, Any]], param: str) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text":
            texts.append(block["text"])
        elif kind == "tool_use":
            calls.append(_tool_call(block, f"{param}.{j}"))
        elif kind not in _SKIPPED_BLOCKS:
            raise invalid_request(f"{param}.{j}: an assistant turn holds 'text', 'tool_use' "
                                  f"or 'thinking' blocks, not '{kind}'.", param=f"{param}.{j}")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_call(block: dict[str, Any], param: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise invalid_request(f"{param}: a tool_use block needs 'id' and 'name' strings.",
                              param=param)
    if not isinstance(arguments, dict):
        raise invalid_request(f"{param}.input: must be an object.", param=f"{param}.input")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _user_messages(blocks: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    """A user turn -> its tool results as `tool` messages, then its text (if any)."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text":
            texts.append(block["text"])
        elif kind == "tool_result":
            out.append(_tool_result(block, f"{param}.{j}"))
        else:
            raise invalid_request(f"{param}.{j}: a user turn holds 'text' or 'tool_result' "
                                  f"blocks, not '{kind}'.", param=f"{param}.{j}")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_result(block: dict[str, Any], param: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise invalid_request(f"{param}.tool_use_id: must be a string.",
                              param=f"{param}.tool_use_id")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in _UNSUPPORTED_BLOCKS:
                texts.append(f"[{kind} omitted: this model reads text only]")
            else:
                texts.append(_text_of_block(part, f"{param}.content.{k}"))
        text = "\n".join(texts)
    else:
        raise invalid_request(f"{param}.content: must be a string or an array of text "
                              "blocks.", param=f"{param}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise invalid_request(f"{param}.is_error: must be a boolean.",
                              param=f"{param}.is_error")
    if is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _thinking(thinking: Any) -> bool | None:
    """thinking -> enable_thinking for the chat template (None: not sent, model default)."""
    if thinking is None:
        return None
    if not isinstance(thinking, dict) or thinking.get("type") not in THINKING_TYPES:
        raise invalid_request("thinking: must be {\"type\": \"enabled\", \"budget_tokens\": N}"
                              ", {\"type\": \"adaptive\"} or {\"type\": \"disabled\"}.",
                              param="thinking")
    budget = thinking.get("budget_tokens")
    if budget is not None and (type(budget) is not int or budget < 0):
        raise invalid_request("thinking.budget_tokens: must be a non-negative integer.",
                              param="thinking.budget_tokens")
    return thinking["type"] != "disabled"


def _tools(tools: Any) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """Custom tools as chat functions, and the names of the server tools dropped."""
    if tools is None:
        return [], ()
    if not isinstance(tools, list):
        raise invalid_request("tools: must be an array.", param="tools")
    functions, dropped = [], []
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        if not isinstance(tool, dict):
            raise invalid_request(f"{param}: must be an object.", param=param)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            dropped.append(str(tool.get("name", kind))[:64])
            continue
        if not isinstance(tool.get("name"), str):
            raise invalid_request(f"{param}.name: must be a string.", param=f"{param}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid_request(f"{param}.input_schema: Field required (a JSON schema "
                                  "object).", param=f"{param}.input_schema")
        function = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    return functions, tuple(dropped)


def _tool_choice(choice: Any, names: set[str] | None) -> tuple[Any, bool]:
    """tool_choice -> (chat's tool_choice, disable_parallel_tool_use). `names` None: no
    tools were given, where only `auto` and `none` make sense."""
    if choice is None:
        return "auto", False
    if not isinstance(choice, dict) or choice.get("type") not in TOOL_CHOICE_TYPES:
        raise invalid_request("tool_choice: must be {\"type\": \"auto\"}, {\"type\": \"any\"}, "
                              "{\"type\": \"tool\", \"name\": ...} or {\"type\": \"none\"}.",
                              param="tool_choice")
    single = choice.get("disable_parallel_tool_use")
    if single is not None and not isinstance(single, bool):
        raise invalid_request("tool_choice.disable_parallel_tool_use: must be a boolean.",
                              param="tool_choice.disable_parallel_tool_use")
    kind = choice["type"]
    if names is None:
        if kind in ("any", "tool"):
            raise invalid_request(f"tool_choice: '{kind}' needs 'tools'.", param="tool_choice")
        return None, False
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise invalid_request(f"tool_choice.name: {json.dumps(name)[:70]} is not one of "
                                  "the tools.", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}, bool(single)
    return {"auto": "auto", "any": "required", "none": "none"}[kind], bool(single)


def with_max_tokens(request: MessagesRequest, max_tokens: int) -> ChatRequest:
    """The chat request with its max_tokens lowered (to the room left in the context)."""
    sampling = replace(request.chat.sampling, max_tokens=max_tokens)
    return replace(request.chat, sampling=sampling)
