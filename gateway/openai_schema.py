"""OpenAI request bodies -> validated, typed requests. Every mistake is a 400 (or 404 for
an unknown model) with the offending parameter named; nothing here touches a worker."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import invalid_request, model_not_found

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
_MISSING = object()


@dataclass(frozen=True)
class SamplingOptions:
    """What both endpoints share. `max_tokens` None: fill the context (chat default)."""

    max_tokens: int | None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    logprobs: int | None = None  # top-N alternatives per token; None: no logprobs
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True

    def worker_params(self, max_tokens: int, choice: int) -> dict[str, Any]:
        """SamplingParams fields by name for SUBMIT. Choice i of n gets seed + i."""
        seed = None if self.seed is None else (self.seed + choice) % (2 ** 63)
        return {
            "max_tokens": max_tokens, "min_tokens": min(self.min_tokens, max_tokens),
            "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "seed": seed,
            "stop_token_ids": list(self.stop_token_ids), "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
        }


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False
    add_generation_prompt: bool = True
    extra_template_kwargs: dict[str, Any] = field(default_factory=dict)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body


# --- field readers ---------------------------------------------------------------------

def _type_name(t: type | tuple) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    ts = t if isinstance(t, tuple) else (t,)
    return " or ".join(names.get(x, x.__name__) for x in ts)


def _get(body: dict, name: str, types: type | tuple, default: Any = None) -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    ts = types if isinstance(types, tuple) else (types,)
    ok = isinstance(value, ts) and not (isinstance(value, bool) and bool not in ts)
    if float in ts and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise invalid_request(f"'{name}' must be {_type_name(types)}, got {json.dumps(value)[:50]}.",
                              param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid_request(f"'{name}' must be a finite number.", param=name)
    return value


def _in_range(name: str, value: float | int | None, lo: float | None, hi: float | None,
              lo_open: bool = False) -> None:
    if value is None:
        return
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    if too_low or (hi is not None and value > hi):
        lo_s = "-inf" if lo is None else f"{lo:g}"
        hi_s = "inf" if hi is None else f"{hi:g}"
        bracket = "(" if lo_open else "["
        raise invalid_request(f"'{name}' must be in {bracket}{lo_s}, {hi_s}], got {value}.",
                              param=name)


def _reject_if_set(body: dict, name: str, why: str, allowed: tuple = (None, False)) -> None:
    value = body.get(name)
    if value not in allowed and value != [] and value != {}:
        raise invalid_request(f"'{name}' is not supported: {why}", param=name)


def check_model(body: dict, served_names: tuple[str, ...]) -> str:
    model = _get(body, "model", str)
    if model is None:
        return served_names[0]
    if model not in served_names:
        raise model_not_found(model)
    return model


def _parse_stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid_request("'stop' must be a string or an array of strings.", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid_request(f"'stop' may hold at most {MAX_STOP_STRINGS} strings.",
                              param="stop")
    return tuple(s for s in stop if s)


def _parse_int_list(body: dict, name: str) -> tuple[int, ...]:
    value = _get(body, name, list, [])
    if not all(type(v) is int and v >= 0 for v in value):
        raise invalid_request(f"'{name}' must be an array of non-negative integers.",
                              param=name)
    return tuple(value)


def _parse_sampling(body: dict, *, max_tokens: int | None, logprobs: int | None
                    ) -> SamplingOptions:
    _in_range("max_tokens", max_tokens, 1, None)
    temperature = float(_get(body, "temperature", float, 1.0))
    _in_range("temperature", temperature, 0, 2)
    top_p = float(_get(body, "top_p", float, 1.0))
    _in_range("top_p", top_p, 0, 1, lo_open=True)
    top_k = _get(body, "top_k", int, 0)
    if top_k == -1:  # vLLM's spelling of "disabled"
        top_k = 0
    _in_range("top_k", top_k, 0, None)
    min_p = float(_get(body, "min_p", float, 0.0))
    _in_range("min_p", min_p, 0, 1)
    seed = _get(body, "seed", int)
    n = _get(body, "n", int, 1)
    _in_range("n", n, 1, MAX_N)
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise invalid_request("'best_of' other than n is not supported.", param="best_of")
    min_tokens = _get(body, "min_tokens", int, 0)
    _in_range("min_tokens", min_tokens, 0, max_tokens)
    presence = float(_get(body, "presence_penalty", float, 0.0))
    _in_range("presence_penalty", presence, -2, 2)
    frequency = float(_get(body, "frequency_penalty", float, 0.0))
    _in_range("frequency_penalty", frequency, -2, 2)
    repetition = float(_get(body, "repetition_penalty", float, 1.0))
    _in_range("repetition_penalty", repetition, 0, None, lo_open=True)
    _reject_if_set(body, "logit_bias", "logit_bias is not implemented.")
    return SamplingOptions(
        max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_p=top_p,
        top_k=top_k, min_p=min_p, seed=seed, stop=_parse_stop(body),
        stop_token_ids=_parse_int_list(body, "stop_token_ids"), n=n, logprobs=logprobs,
        ignore_eos=_get(body, "ignore_eos", bool, False), presence_penalty=presence,
        frequency_penalty=frequency, repetition_penalty=repetition,
        skip_special_tokens=_get(body, "skip_special_tokens", bool, True))


def _parse_stream(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict)
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid_request("'stream_options' is only allowed when 'stream' is true.",
                                  param="stream_options")
        include_usage = _get(options, "include_usage", bool, False)
    return stream, include_usage


# --- endpoints -------------------------------------------------------------------------

def parse_completion(body: dict, served_names: tuple[str, ...]) -> CompletionRequest:
    model = check_model(body, served_names)
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid_request("'prompt' is required.", param="prompt")
    prompts = _parse_prompts(prompt)
    _reject_if_set(body, "echo", "echo is not implemented.")
    _reject_if_set(body, "suffix", "suffix is not implemented.", allowed=(None, ""))
    logprobs = _get(body, "logprobs", int)
    _in_range("logprobs", logprobs, 0, MAX_LOGPROBS)
    stream, include_usage = _parse_stream(body)
    sampling = _parse_sampling(body, max_tokens=_get(body, "max_tokens", int, 16),
                               logprobs=logprobs)
    return CompletionRequest(model, prompts, sampling, stream, include_usage)


def _parse_prompts(prompt: Any) -> list[str | list[int]]:
    def is_token_list(x: Any) -> bool:
        return isinstance(x, list) and len(x) > 0 and all(type(t) is int for t in x)

    if isinstance(prompt, str):
        return [prompt]
    if is_token_list(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(is_token_list(p) for p in prompt):
            return list(prompt)
    raise invalid_request("'prompt' must be a string, an array of strings, an array of token "
                          "ids or an array of token id arrays (non-empty).", param="prompt")


_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def parse_chat(body: dict, served_names: tuple[str, ...]) -> ChatRequest:
    model = check_model(body, served_names)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty array.", param="messages")
    parsed = [_parse_message(m, i) for i, m in enumerate(messages)]
    _reject_if_set(body, "tools", "tool calling is not implemented.")
    _reject_if_set(body, "functions", "function calling is not implemented.")
    fmt = _get(body, "response_format", dict)
    if fmt is not None and fmt.get("type") not in (None, "text"):
        raise invalid_request("Only response_format {'type': 'text'} is supported.",
                              param="response_format")
    logprobs_on = _get(body, "logprobs", bool, False)
    top_logprobs = _get(body, "top_logprobs", int)
    _in_range("top_logprobs", top_logprobs, 0, MAX_LOGPROBS)
    if top_logprobs is not None and not logprobs_on:
        raise invalid_request("'top_logprobs' requires 'logprobs' to be true.",
                              param="top_logprobs")
    max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    stream, include_usage = _parse_stream(body)
    sampling = _parse_sampling(body, max_tokens=max_tokens,
                               logprobs=(top_logprobs or 0) if logprobs_on else None)
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    return ChatRequest(model, parsed, sampling, stream, include_usage,
                       add_generation_prompt=_get(body, "add_generation_prompt", bool, True),
                       extra_template_kwargs=kwargs)


def _parse_message(m: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid_request(f"'{param}' must be an object.", param=param)
    role = m.get("role")
    if role not in _ROLES:
        raise invalid_request(f"'{param}.role' must be one of {', '.join(_ROLES)}.",
                              param=f"{param}.role")
    content = m.get("content")
    if isinstance(content, list):
        content = _join_text_parts(content, f"{param}.content")
    elif content is None:
        if role != "assistant":
            raise invalid_request(f"'{param}.content' is required.", param=f"{param}.content")
        content = ""
    elif not isinstance(content, str):
        raise invalid_request(f"'{param}.content' must be a string or an array of text parts.",
                              param=f"{param}.content")
    out = {k: v for k, v in m.items() if k not in ("role", "content")}
    out.update(role=role, content=content)
    return out


def _join_text_parts(parts: list, param: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str):
            raise invalid_request(f"'{param}[{j}]' must be {{\"type\": \"text\", \"text\": "
                                  "string}; other content types are not supported.",
                                  param=f"{param}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_tokenize(body: dict, served_names: tuple[str, ...]) -> dict[str, Any]:
    if "model" in body:
        check_model(body, served_names)
    add_special = _get(body, "add_special_tokens", bool, None)
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise invalid_request("'messages' must be a non-empty array.", param="messages")
        return {"messages": [_parse_message(m, i) for i, m in enumerate(messages)],
                "add_generation_prompt": _get(body, "add_generation_prompt", bool, True),
                "add_special_tokens": False if add_special is None else add_special}
    prompt = _get(body, "prompt", str)
    if prompt is None:
        raise invalid_request("'prompt' (a string) or 'messages' is required.", param="prompt")
    return {"prompt": prompt, "add_special_tokens": True if add_special is None else add_special}


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                  what: str = "prompt") -> int:
    """The max_tokens in effect; 400 when prompt + completion would not fit the context."""
    if num_prompt_tokens == 0:
        raise invalid_request(f"The {what} is empty.", param="prompt")
    if num_prompt_tokens >= max_model_len:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{what} has {num_prompt_tokens} tokens, which leaves no room for a completion. "
            f"Please reduce the length of the {what}.", param="prompt",
            code="context_length_exceeded")
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"{what}, {max_tokens} in the completion). Please reduce the length of the {what} "
            "or completion.", param="max_tokens", code="context_length_exceeded")
    return max_tokens


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid_request(f"Token id {bad} is out of the vocabulary [0, {vocab_size}).",
                              param="prompt")

