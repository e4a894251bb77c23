"""OpenAI response shapes: stream chunks and whole responses for both endpoints."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from json.encoder import encode_basestring as _json_string
from typing import Any

from zeroserve.gateway.api.openai_schema import ToolChoice
from zeroserve.gateway.generation import ChoiceUpdate
from zeroserve.gateway.text.tokenizer import TextTokenizer


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class ResponseContext:
    """What every chunk of one response repeats."""

    kind: str  # "completion" or "chat"
    model: str
    include_usage: bool = False
    id: str = ""
    created_at: float = field(default_factory=time.time)
    tools: ToolChoice | None = None  # chat: the model may call these
    # The API the request came through, for metrics ("" -> kind; "responses" runs as chat).
    endpoint: str = ""

    @property
    def created(self) -> int:
        return int(self.created_at)

    def __post_init__(self) -> None:
        self.endpoint = self.endpoint or self.kind
        if not self.id:
            prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
            self.id = f"{prefix}-{uuid.uuid4().hex}"
        # Per-token chunks are rendered from these fixed pieces around the one choice, so
        # only the new text goes through json.dumps (the hot path: one chunk per token).
        self._head = (f'data: {{"id":{_json(self.id)},"object":"{self.chunk_object}",'
                      f'"created":{self.created},"model":{_json(self.model)},"choices":[')
        tail = "]"
        if self.kind == "chat":
            tail += ',"system_fingerprint":null'
        if self.include_usage:
            tail += ',"usage":null'
        self._tail = tail + "}\n\n"

    def render_choice(self, choice_json: str) -> bytes:
        """One SSE event whose choices hold just this (already JSON) choice."""
        return (self._head + choice_json + self._tail).encode()

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": self.chunk_object, "created": self.created,
               "model": self.model, "choices": choices}
        if self.kind == "chat":
            out["system_fingerprint"] = None
        if self.include_usage:
            out["usage"] = usage
        return out


# --- logprobs ------------------------------------------------------------------------

class LogprobsFormatter:
    """Worker logprob entries -> the endpoint's shape. Entries: [logprob, [[id, lp], ...]]."""

    def __init__(self, tokenizer: TextTokenizer, kind: str):
        self.tokenizer = tokenizer
        self.kind = kind

    def chat(self, token_ids: list[int], entries: list) -> dict:
        content = []
        for tid, (lp, top) in zip(token_ids, entries, strict=False):
            content.append({**self._token(tid, lp),
                            "top_logprobs": [self._token(t, v) for t, v in top]})
        return {"content": content}

    def _token(self, tid: int, lp: float) -> dict:
        return {"token": self.tokenizer.token_text(tid), "logprob": lp,
                "bytes": list(self.tokenizer.token_bytes(tid))}

    def completion(self, token_ids: list[int], entries: list, text_offset: int) -> dict:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for tid, (lp, top) in zip(token_ids, entries, strict=False):
            text = self.tokenizer.token_text(tid)
            tokens.append(text)
            token_logprobs.append(lp)
            top_logprobs.append({self.tokenizer.token_text(t): v for t, v in top})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": offsets}

    def prompt(self, token_ids: list[int], entries: list) -> dict:
        """echo + logprobs: the prompt's tokens in the completion shape, the first with no
        logprob (nothing precedes it), as OpenAI returns them."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = 0
        for i, tid in enumerate(token_ids):
            text = self.tokenizer.token_text(tid)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if 0 < i <= len(entries):
                lp, top = entries[i - 1]
                token_logprobs.append(lp)
                top_logprobs.append({self.tokenizer.token_text(t): v for t, v in top})
            else:
                token_logprobs.append(None)
                top_logprobs.append(None)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": offsets}

    @staticmethod
    def merge(acc: dict | None, new: dict) -> dict:
        if acc is None:
            return {k: list(v) for k, v in new.items()}
        for k, v in new.items():
            acc[k].extend(v)
        return acc


# --- echo + logprobs: the prompt's logprobs, rendered once per prompt -------------------

_LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
_JSON_SLICE = 1024  # values per json.dumps call: each holds the GIL well under a millisecond


def prompt_logprobs_json(tokenizer: TextTokenizer, token_ids: list[int],
                         entries: list) -> dict[str, str]:
    """A prompt's logprobs in the completion shape, each array as JSON text without its
    brackets: every choice of the prompt splices the same text (spliced_logprobs_json).
    Pure Python and slice-sized C calls: run in the CPU pool, it lets the loop in."""
    lp = LogprobsFormatter(tokenizer, "completion").prompt(token_ids, entries)
    return {k: _json_array_body(lp[k]) for k in _LOGPROB_KEYS}


def spliced_logprobs_json(prompt: dict[str, str], completion: dict | None) -> str:
    """The logprobs of an echoed choice: its prompt's (already JSON), then its own."""
    parts = []
    for k in _LOGPROB_KEYS:
        head = prompt[k]
        tail = "" if completion is None else _json_array_body(completion[k])
        parts.append(f'"{k}":[{head}{"," if head and tail else ""}{tail}]')
    return "{" + ",".join(parts) + "}"


def _json_array_body(values: list) -> str:
    return ",".join(json.dumps(values[i:i + _JSON_SLICE], ensure_ascii=False,
                               separators=(",", ":"))[1:-1]
                    for i in range(0, len(values), _JSON_SLICE))


def completion_body(ctx: ResponseContext, choices: list[dict], usage: dict,
                    logprobs_json: list[str]) -> bytes:
    """completion_response as JSON bytes, each choice's logprobs given as JSON text."""
    rendered = ",".join(
        f'{{"index":{c["index"]},"text":{_json(c["text"])},"logprobs":{lp},'
        f'"finish_reason":{_finish_json(c["finish_reason"])}}}'
        for c, lp in zip(choices, logprobs_json, strict=True))
    return (f'{{"id":{_json(ctx.id)},"object":"text_completion","created":{ctx.created},'
            f'"model":{_json(ctx.model)},"choices":[{rendered}],"usage":{_json(usage)}}}'
            ).encode()


# --- stream chunks -------------------------------------------------------------------

def _json(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return _json_string(value)  # the C encoder, without json.dumps' setup
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _finish_json(reason: str | None) -> str:
    return "null" if reason is None else _json_string(reason)


def completion_chunk(ctx: ResponseContext, update: ChoiceUpdate, logprobs: dict | None,
                     logprobs_json: str | None = None) -> bytes:
    """`logprobs_json`: the logprobs already as JSON text (then `logprobs` is ignored)."""
    lp = _json(logprobs) if logprobs_json is None else logprobs_json
    return ctx.render_choice(
        f'{{"index":{update.index},"text":{_json(update.text)},'
        f'"logprobs":{lp},"finish_reason":{_finish_json(update.finish_reason)}}}')


def chat_role_chunk(ctx: ResponseContext, index: int) -> dict:
    return ctx.chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                       "logprobs": None, "finish_reason": None}])


def chat_chunk(ctx: ResponseContext, update: ChoiceUpdate, logprobs: dict | None) -> bytes:
    delta = f'{{"content":{_json(update.text)}}}' if update.text else "{}"
    if update.reasoning:
        delta = _json(reasoning_delta(update.reasoning) | (
            {"content": update.text} if update.text else {}))
    return ctx.render_choice(
        f'{{"index":{update.index},"delta":{delta},"logprobs":{_json(logprobs)},'
        f'"finish_reason":{_finish_json(update.finish_reason)}}}')


def reasoning_delta(text: str) -> dict:
    """A chat delta of thinking text: vLLM's `reasoning_content`, and `reasoning` (its
    newer name, which OpenRouter and others read)."""
    return {"reasoning_content": text, "reasoning": text}


def chat_delta_chunk(ctx: ResponseContext, index: int, delta: dict, logprobs: dict | None,
                     finish_reason: str | None) -> bytes:
    """A chat chunk with any delta (tool-call pieces, content)."""
    return ctx.render_choice(
        f'{{"index":{index},"delta":{_json(delta)},"logprobs":{_json(logprobs)},'
        f'"finish_reason":{_finish_json(finish_reason)}}}')


def usage_chunk(ctx: ResponseContext, usage: dict) -> dict:
    return ctx.chunk([], usage=usage)


def error_event(error_body: dict) -> bytes:
    return sse(error_body)


# --- whole responses -----------------------------------------------------------------

def completion_response(ctx: ResponseContext, choices: list[dict], usage: dict) -> dict:
    return {"id": ctx.id, "object": "text_completion", "created": ctx.created,
            "model": ctx.model, "choices": choices, "usage": usage}


def chat_response(ctx: ResponseContext, choices: list[dict], usage: dict) -> dict:
    return {"id": ctx.id, "object": "chat.completion", "created": ctx.created,
            "model": ctx.model, "choices": choices, "usage": usage,
            "system_fingerprint": None}
