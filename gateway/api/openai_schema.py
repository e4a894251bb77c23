"""OpenAI request bodies -> validated, typed requests. Every mistake is a 400 (or 404 for
an unknown model) with the offending parameter named; nothing here touches a worker."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from zeroserve.common.protocol import MAX_PRIORITY
from zeroserve.gateway.api.limits import RequestLimits
from zeroserve.gateway.api.structured_output import (
    ANY_OBJECT,
    Grammar,
    json_schema_grammar,
    named_tool_grammar,
    regex_grammar,
    required_tool_grammar,
)
from zeroserve.gateway.errors import invalid_request, model_not_found

# OpenAI's `service_tier` as a `priority` (relative to the default class; the class's rank is
# clamped to the classes there are): "priority" asks for the best class, "default" for the
# default one, "flex" for the lowest; "auto" and "scale" ask for nothing (the key's class).
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
SERVICE_TIER_PRIORITY = {"priority": -MAX_PRIORITY, "default": 0, "flex": MAX_PRIORITY}

MAX_N = 128
# echo + logprobs: each choice carries its prompt's logprobs (prompt tokens x (logprobs + 1)
# entries), so n multiplies the response, not the work (computed once per prompt).
MAX_N_WITH_PROMPT_LOGPROBS = 4
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16  # OpenAI takes 4, vLLM any number
# Each stop string's characters and all of them together: the matcher's work per piece of
# output grows with the longest (gateway/text/stop_strings.py), and a stop string longer than a
# reply is no stop string.
MAX_STOP_CHARS = 256
MAX_STOP_TOTAL_CHARS = 1024
# Every integer field must fit 64 bits before anything converts it (float() of a 400-digit
# integer raises OverflowError).
_MIN_INT = -(2 ** 63)
_MAX_INT = 2 ** 64 - 1
MAX_TOP_K = 2 ** 31 - 1
# Like vLLM: below this a temperature is greedy (dividing logits by it would overflow).
GREEDY_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-5  # smaller keeps only the top token anyway, and 1e-300 is 0 in float32
# repetition_penalty divides or multiplies logits; far outside these it overflows float32
# (1e-300 becomes 0 in float32: a division by zero) and no sampler needs more.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
DEFAULT_LIMITS = RequestLimits()
MAX_LOGIT_BIAS = 1024  # token ids one request may bias (the worker's limit too)
MAX_TOOLS = 128
_FUNCTION_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                 "0123456789_-")
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
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: Grammar | None = None  # constrained decoding (response_format, forced tools)
    prompt_logprobs: int | None = None  # echo + logprobs: the prompt's logprobs too
    # vLLM's `priority` (lower is served first; an int relative to the default class) or a
    # priority class's name; never above the key's class (gateway/priority_classes.py).
    priority: int | str | None = None

    @property
    def is_scoring(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) is the whole answer."""
        return self.max_tokens == 0

    def worker_params(self, max_tokens: int, choice: int) -> dict[str, Any]:
        """SamplingParams fields by name for SUBMIT (plus "grammar", which SUBMIT carries in
        a field of its own). Choice i of n gets seed + i. Only choice 0 asks for the
        prompt's logprobs (an uncached prefill over the whole vocabulary): the other
        choices show the same ones and share one cached prefill among themselves."""
        seed = None if self.seed is None else (self.seed + choice) % (2 ** 63)
        extra: dict[str, Any] = {}
        if self.logit_bias:
            extra["logit_bias"] = [list(pair) for pair in self.logit_bias]
        if self.grammar is not None:
            extra["grammar"] = self.grammar.to_wire()
        if self.prompt_logprobs is not None and choice == 0:
            extra["prompt_logprobs"] = self.prompt_logprobs
        return extra | {
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
    echo: bool = False  # the prompt's text comes before the completion's


@dataclass(frozen=True)
class ToolChoice:
    """A chat request's tools: the functions, and whether/how the model must call one."""

    tools: list[dict[str, Any]]  # as the client sent them ({"type": "function", ...})
    mode: str = "auto"  # "none", "auto", "required" or "named"
    name: str | None = None  # the function, when mode is "named"
    # parallel_tool_calls as the client sent it (None: not sent). A forced call ("required")
    # is one call unless the client asked for parallel calls in so many words: a small model
    # let free to add calls keeps adding them until max_tokens cuts the array, and then no
    # call is complete. One call is always an answer that parallel calls allow.
    parallel: bool | None = None

    @property
    def functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.tools]

    @property
    def is_forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class ChatPrompt:
    """What a chat request puts in front of the model: the messages, the tools and how the
    template renders them. /v1/chat/completions and /tokenize read it from the same fields,
    so /tokenize counts exactly the chat prompt."""

    messages: list[dict[str, Any]]
    tools: ToolChoice | None = None  # None: no tools given (or tool_choice "none")
    add_generation_prompt: bool = True
    # The final (assistant) message stays open: the model continues its content.
    continue_final_message: bool = False
    extra_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def num_chars(self) -> int:
        """The characters of the messages, earlier calls' arguments included."""
        return sum(_message_chars(m) for m in self.messages)


def _message_chars(message: dict[str, Any]) -> int:
    num_chars = len(message["content"])
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                num_chars += len(arguments)
    return num_chars


@dataclass(frozen=True)
class ChatRequest:
    model: str
    prompt: ChatPrompt
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False

    @property
    def tools(self) -> ToolChoice | None:
        return self.prompt.tools


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
        raise invalid_request(f"'{name}' must be {_type_name(types)}, got "
                              f"{_preview(value)}.", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid_request(f"'{name}' must be a finite number.", param=name)
    if type(value) is int and not _MIN_INT <= value <= _MAX_INT:
        raise invalid_request(f"'{name}' is out of range (more than 64 bits).", param=name)
    return value


def _preview(value: Any) -> str:
    """A short, safe rendering of a bad value for an error message (no huge int to str)."""
    if isinstance(value, (list, dict)):
        return "an array" if isinstance(value, list) else "an object"
    if type(value) is int and not _MIN_INT <= value <= _MAX_INT:
        return "a huge integer"
    return json.dumps(value)[:50]


def _in_range(name: str, value: float | int | None, lo: float | None, hi: float | None,
              lo_open: bool = False) -> None:
    if value is None:
        return
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    if too_low or (hi is not None and value > hi):
        lo_s = "-inf" if lo is None else _number(lo)
        hi_s = "inf" if hi is None else _number(hi)
        bracket = "(" if lo_open else "["
        raise invalid_request(f"'{name}' must be in {bracket}{lo_s}, {hi_s}], got {value}.",
                              param=name)


def _number(x: float | int) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


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
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise invalid_request(f"Each 'stop' string may have at most {MAX_STOP_CHARS} "
                              f"characters; one has {longest}.", param="stop")
    total = sum(map(len, stop))
    if total > MAX_STOP_TOTAL_CHARS:
        raise invalid_request(f"The 'stop' strings may have at most {MAX_STOP_TOTAL_CHARS} "
                              f"characters together; they have {total}.", param="stop")
    return tuple(s for s in stop if s)


def _parse_stop_token_ids(body: dict, limits: RequestLimits) -> tuple[int, ...]:
    name = "stop_token_ids"
    value = _get(body, name, list, [])
    if len(value) > limits.max_stop_token_ids:
        raise invalid_request(f"'{name}' may hold at most {limits.max_stop_token_ids} ids.",
                              param=name)
    vocab = limits.vocab_size
    for v in value:
        if type(v) is not int or v < 0 or (vocab is not None and v >= vocab):
            within = f" in [0, {vocab})" if vocab is not None else " (non-negative)"
            raise invalid_request(f"'{name}' must be an array of token ids{within}, got "
                                  f"{_preview(v)}.", param=name)
    return tuple(value)


def _parse_top_k(body: dict, vocab_size: int | None) -> int:
    top_k = _get(body, "top_k", int, 0)
    if top_k == -1:  # vLLM's spelling of "disabled"
        return 0
    _in_range("top_k", top_k, 0, MAX_TOP_K)
    if vocab_size is not None and top_k >= vocab_size:
        return 0  # keeps the whole vocabulary: the same as off
    return top_k


def _parse_max_tokens(name: str, value: int | None, limits: RequestLimits) -> None:
    _in_range(name, value, 1, limits.max_tokens_limit)


def _parse_sampling(body: dict, *, max_tokens: int | None, logprobs: int | None,
                    limits: RequestLimits = DEFAULT_LIMITS) -> SamplingOptions:
    temperature = float(_get(body, "temperature", float, 1.0))
    _in_range("temperature", temperature, 0, 2)
    if temperature < GREEDY_TEMPERATURE:
        temperature = 0.0
    top_p = float(_get(body, "top_p", float, 1.0))
    _in_range("top_p", top_p, 0, 1, lo_open=True)
    top_p = max(top_p, MIN_TOP_P)
    top_k = _parse_top_k(body, limits.vocab_size)
    min_p = float(_get(body, "min_p", float, 0.0))
    _in_range("min_p", min_p, 0, 1)
    seed = _get(body, "seed", int)
    n = _get(body, "n", int, 1)
    _in_range("n", n, 1, MAX_N)
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise invalid_request("'best_of' other than n is not supported.", param="best_of")
    min_tokens = _get(body, "min_tokens", int, 0)
    _in_range("min_tokens", min_tokens, 0,
              max_tokens if max_tokens is not None else limits.max_tokens_limit)
    presence = float(_get(body, "presence_penalty", float, 0.0))
    _in_range("presence_penalty", presence, -2, 2)
    frequency = float(_get(body, "frequency_penalty", float, 0.0))
    _in_range("frequency_penalty", frequency, -2, 2)
    repetition = float(_get(body, "repetition_penalty", float, 1.0))
    _in_range("repetition_penalty", repetition, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
    return SamplingOptions(
        max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_p=top_p,
        top_k=top_k, min_p=min_p, seed=seed, stop=_parse_stop(body),
        stop_token_ids=_parse_stop_token_ids(body, limits), n=n, logprobs=logprobs,
        ignore_eos=_get(body, "ignore_eos", bool, False), presence_penalty=presence,
        frequency_penalty=frequency, repetition_penalty=repetition,
        skip_special_tokens=_get(body, "skip_special_tokens", bool, True),
        logit_bias=_parse_logit_bias(body, limits.vocab_size), priority=_parse_priority(body))


def _parse_priority(body: dict) -> int | str | None:
    """vLLM's `priority`: an integer (lower is served first), or a priority class's name
    (checked against the classes where the request is admitted). Without it, OpenAI's
    `service_tier` asks for a class (SERVICE_TIER_PRIORITY); either way never above the
    key's (gateway/priority_classes.py)."""
    priority = _get(body, "priority", (int, str))
    if isinstance(priority, str) and not 0 < len(priority) <= 64:
        raise invalid_request("'priority' must be an integer or a priority class's name.",
                              param="priority")
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise invalid_request(f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}.",
                              param="service_tier")
    if priority is None and tier is not None:
        return SERVICE_TIER_PRIORITY.get(tier)
    return priority


def _parse_logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id as a string": bias in [-100, 100]}."""
    name = "logit_bias"
    value = _get(body, name, dict, {})
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid_request(f"'{name}' may hold at most {MAX_LOGIT_BIAS} tokens.", param=name)
    out = []
    for key, bias in value.items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else -1
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            within = f" in [0, {vocab_size})" if vocab_size is not None else ""
            raise invalid_request(f"'{name}' keys must be token ids{within}, got "
                                  f"{_preview(key)}.", param=name)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not (
                -100 <= bias <= 100):
            raise invalid_request(f"'{name}' values must be numbers in [-100, 100], got "
                                  f"{_preview(bias)} for token {token}.", param=name)
        out.append((token, float(bias)))
    return tuple(out)


def _parse_response_format(body: dict) -> Grammar | None:
    """response_format: text (None), json_object (any JSON object) or json_schema."""
    name = "response_format"
    fmt = _get(body, name, dict)
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(ANY_OBJECT, name)
    if kind != "json_schema":
        raise invalid_request(f"'{name}.type' must be 'text', 'json_object' or 'json_schema'.",
                              param=f"{name}.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid_request(f"'{name}.json_schema' must be an object with 'name' and "
                              "'schema'.", param=f"{name}.json_schema")
    _check_function_name(spec.get("name"), f"{name}.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_request(f"'{name}.json_schema.strict' must be a boolean.",
                              param=f"{name}.json_schema.strict")
    schema = spec.get("schema")
    # Strict or not, the schema is enforced: constrained decoding has no weaker mode.
    return json_schema_grammar(ANY_OBJECT if schema is None else schema,
                               f"{name}.json_schema.schema")


def _parse_guided(body: dict) -> Grammar | None:
    """vLLM's extra parameters: guided_json (a schema) and guided_regex."""
    schema = body.get("guided_json")
    if schema is not None:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise invalid_request("'guided_json' must be a JSON schema.",
                                      param="guided_json") from None
        return json_schema_grammar(schema, "guided_json")
    pattern = _get(body, "guided_regex", str)
    return None if pattern is None else regex_grammar(pattern, "guided_regex")


def _parse_output_grammar(body: dict) -> Grammar | None:
    fmt = _parse_response_format(body)
    guided = _parse_guided(body)
    if fmt is not None and guided is not None:
        raise invalid_request("Give either 'response_format' or a guided_* parameter, not "
                              "both.", param="response_format")
    return fmt or guided


def _check_function_name(name: Any, param: str) -> str:
    if not (isinstance(name, str) and 0 < len(name) <= 64
            and all(c in _FUNCTION_NAME_CHARS for c in name)):
        raise invalid_request(f"'{param}' must be 1 to 64 letters, digits, '_' or '-'.",
                              param=param)
    return name


def _parse_tools(body: dict) -> ToolChoice | None:
    """tools and tool_choice -> None when the model may not call anything."""
    tools = _get(body, "tools", list, [])
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise invalid_request("'tool_choice' is only allowed when 'tools' are given.",
                                  param="tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise invalid_request(f"'tools' may hold at most {MAX_TOOLS} functions.", param="tools")
    names = set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                tool.get("function"), dict):
            raise invalid_request(f"'{param}' must be {{\"type\": \"function\", \"function\": "
                                  "{...}}.", param=param)
        function = tool["function"]
        name = _check_function_name(function.get("name"), f"{param}.function.name")
        if name in names:
            raise invalid_request(f"Function '{name}' is given twice in 'tools'.", param=param)
        names.add(name)
        params = function.get("parameters")
        if params is not None:
            json_schema_grammar(params, f"{param}.function.parameters")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid_request(f"'{param}.function.description' must be a string.",
                                  param=f"{param}.function.description")
    parallel = _get(body, "parallel_tool_calls", bool, None)
    if choice is None or choice == "auto":
        return ToolChoice(tools, "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolChoice(tools, "required", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise invalid_request(f"'tool_choice' names the function {_preview(name)}, which "
                                  "is not in 'tools'.", param="tool_choice")
        return ToolChoice(tools, "named", name=name, parallel=parallel)
    raise invalid_request("'tool_choice' must be 'none', 'auto', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}.",
                          param="tool_choice")


def _forced_tool_grammar(tools: ToolChoice, is_closed: bool = True) -> Grammar:
    if tools.mode == "named":
        function = next(f for f in tools.functions if f["name"] == tools.name)
        return named_tool_grammar(function, is_closed)
    return required_tool_grammar(tools.functions, tools.parallel is True, is_closed)


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

def parse_completion(body: dict, served_names: tuple[str, ...],
                     limits: RequestLimits = DEFAULT_LIMITS) -> CompletionRequest:
    model = check_model(body, served_names)
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid_request("'prompt' is required.", param="prompt")
    prompts = _parse_prompts(prompt, limits)
    echo = _get(body, "echo", bool, False)
    _reject_if_set(body, "suffix", "suffix is not implemented.", allowed=(None, ""))
    logprobs = _get(body, "logprobs", int)
    _in_range("logprobs", logprobs, 0, MAX_LOGPROBS)
    stream, include_usage = _parse_stream(body)
    max_tokens = _get(body, "max_tokens", int, min(16, limits.max_tokens_limit))
    if not (echo and max_tokens == 0):  # echo with 0: score the prompt (OpenAI's legacy API)
        _parse_max_tokens("max_tokens", max_tokens, limits)
    sampling = _parse_sampling(body, max_tokens=max_tokens, logprobs=logprobs, limits=limits)
    grammar = _parse_output_grammar(body)
    if grammar is not None:
        sampling = replace(sampling, grammar=grammar)
    if echo and logprobs is not None:  # OpenAI: the echoed prompt comes with its logprobs
        if sampling.n > MAX_N_WITH_PROMPT_LOGPROBS:
            raise invalid_request(f"'n' may be at most {MAX_N_WITH_PROMPT_LOGPROBS} with "
                                  "'echo' and 'logprobs' (each choice repeats the prompt's "
                                  f"logprobs); got {sampling.n}.", param="n")
        sampling = replace(sampling, prompt_logprobs=logprobs)
    _check_num_engine_requests(len(prompts), sampling.n, limits)
    return CompletionRequest(model, prompts, sampling, stream, include_usage, echo)


def _parse_prompts(prompt: Any, limits: RequestLimits) -> list[str | list[int]]:
    def is_token_list(x: Any) -> bool:
        return isinstance(x, list) and len(x) > 0 and all(type(t) is int for t in x)

    if isinstance(prompt, str) or is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt) or all(is_token_list(p) for p in prompt)):
        prompts = list(prompt)
    else:
        raise invalid_request("'prompt' must be a string, an array of strings, an array of "
                              "token ids or an array of token id arrays (non-empty).",
                              param="prompt")
    for p in prompts:
        if isinstance(p, str):
            check_prompt_chars(len(p), limits, "prompt")
    return prompts


def check_prompt_chars(num_chars: int, limits: RequestLimits, param: str,
                       what: str = "A prompt") -> None:
    if num_chars > limits.max_prompt_chars:
        raise invalid_request(f"{what} has {num_chars} characters; the limit is "
                              f"{limits.max_prompt_chars}.", param=param,
                              code="prompt_too_long")


def _check_num_engine_requests(num_prompts: int, n: int, limits: RequestLimits) -> None:
    if num_prompts * n > limits.max_engine_requests:
        raise invalid_request(f"This request asks for {num_prompts} prompts x n={n} = "
                              f"{num_prompts * n} completions; the limit is "
                              f"{limits.max_engine_requests}.", param="n")


# What the server itself passes to a chat template (continue_final_message: what
# ChatTemplate.render takes beside the template's arguments).
_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token",
                             "tools", "continue_final_message"})
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def parse_chat(body: dict, served_names: tuple[str, ...],
               limits: RequestLimits = DEFAULT_LIMITS) -> ChatRequest:
    model = check_model(body, served_names)
    prompt = _parse_chat_prompt(body, limits)
    tools = prompt.tools
    grammar = _parse_output_grammar(body)
    if tools is not None and tools.is_forced:
        if grammar is not None:
            raise invalid_request("'response_format' cannot be combined with a forced tool "
                                  "call ('tool_choice' required or a named function).",
                                  param="response_format")
        grammar = _forced_tool_grammar(tools, limits.close_tool_schemas)
    logprobs_on = _get(body, "logprobs", bool, False)
    top_logprobs = _get(body, "top_logprobs", int)
    _in_range("top_logprobs", top_logprobs, 0, MAX_LOGPROBS)
    if top_logprobs is not None and not logprobs_on:
        raise invalid_request("'top_logprobs' requires 'logprobs' to be true.",
                              param="top_logprobs")
    name = "max_completion_tokens"
    max_tokens = _get(body, name, int)
    if max_tokens is None:
        name = "max_tokens"
        max_tokens = _get(body, name, int)
    _parse_max_tokens(name, max_tokens, limits)
    stream, include_usage = _parse_stream(body)
    sampling = _parse_sampling(body, max_tokens=max_tokens,
                               logprobs=(top_logprobs or 0) if logprobs_on else None,
                               limits=limits)
    if grammar is not None:
        sampling = replace(sampling, grammar=grammar)
    _check_num_engine_requests(1, sampling.n, limits)
    return ChatRequest(model, prompt, sampling, stream, include_usage)


def _parse_chat_prompt(body: dict, limits: RequestLimits) -> ChatPrompt:
    """The prompt-shaping fields of a chat request (shared by chat and /tokenize)."""
    messages = _parse_messages(body.get("messages"), limits)
    _reject_if_set(body, "functions", "use 'tools' (the legacy 'functions' is not "
                   "supported).")
    tools = _parse_tools(body)
    add_generation_prompt = _get(body, "add_generation_prompt", bool, True)
    continue_final = _get(body, "continue_final_message", bool, False)
    if continue_final and add_generation_prompt:
        raise invalid_request("'continue_final_message' and 'add_generation_prompt' cannot "
                              "both be true (set 'add_generation_prompt' to false).",
                              param="continue_final_message")
    if continue_final and messages[-1]["role"] != "assistant":
        raise invalid_request("'continue_final_message' needs the final message to be the "
                              "assistant's.", param="continue_final_message")
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    reserved = _TEMPLATE_NAMES.intersection(kwargs)
    if reserved:
        raise invalid_request(f"'chat_template_kwargs' may not set {sorted(reserved)}.",
                              param="chat_template_kwargs")
    return ChatPrompt(messages, tools, add_generation_prompt, continue_final, kwargs)


def _parse_messages(messages: Any, limits: RequestLimits) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty array.", param="messages")
    if len(messages) > limits.max_messages:
        raise invalid_request(f"'messages' may hold at most {limits.max_messages} messages.",
                              param="messages")
    parsed = [_parse_message(m, i) for i, m in enumerate(messages)]
    check_prompt_chars(sum(_message_chars(m) for m in parsed), limits, "messages",
                       "The conversation")
    return parsed


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


def parse_tokenize(body: dict, served_names: tuple[str, ...],
                   limits: RequestLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    if "model" in body:
        check_model(body, served_names)
    add_special = _get(body, "add_special_tokens", bool, None)
    if "messages" in body:
        return {"chat": _parse_chat_prompt(body, limits),
                "add_special_tokens": False if add_special is None else add_special}
    prompt = _get(body, "prompt", str)
    if prompt is None:
        raise invalid_request("'prompt' (a string) or 'messages' is required.", param="prompt")
    check_prompt_chars(len(prompt), limits, "prompt")
    return {"prompt": prompt, "add_special_tokens": True if add_special is None else add_special}


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                  what: str = "prompt", max_tokens_limit: int | None = None) -> int:
    """The max_tokens in effect; 400 when prompt + completion would not fit the context.
    With no max_tokens (the chat default): the room left, at most `max_tokens_limit`."""
    if num_prompt_tokens == 0:
        raise invalid_request(f"The {what} is empty.", param="prompt")
    if num_prompt_tokens >= max_model_len:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{what} has {num_prompt_tokens} tokens, which leaves no room for a completion. "
            f"Please reduce the length of the {what}.", param="prompt",
            code="context_length_exceeded")
    if max_tokens is None:
        room = max_model_len - num_prompt_tokens
        return room if max_tokens_limit is None else min(room, max_tokens_limit)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"{what}, {max_tokens} in the completion). Please reduce the length of the {what} "
            "or completion.", param="max_tokens", code="context_length_exceeded")
    return max_tokens


def check_token_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid_request(f"Token id {_preview(bad)} is out of the vocabulary "
                              f"[0, {vocab_size}).", param=param)

