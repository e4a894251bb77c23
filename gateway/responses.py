"""OpenAI response shapes: stream chunks and whole responses for both endpoints."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.generation import ChoiceUpdate
from gateway.tokenizer import TextTokenizer


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
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
            self.id = f"{prefix}-{uuid.uuid4().hex}"

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

    @staticmethod
    def merge(acc: dict | None, new: dict) -> dict:
        if acc is None:
            return {k: list(v) for k, v in new.items()}
        for k, v in new.items():
            acc[k].extend(v)
        return acc


# --- stream chunks -------------------------------------------------------------------

def completion_chunk(ctx: ResponseContext, update: ChoiceUpdate, logprobs: dict | None
                     ) -> dict:
    return ctx.chunk([{"index": update.index, "text": update.text, "logprobs": logprobs,
                       "finish_reason": update.finish_reason}])


def chat_role_chunk(ctx: ResponseContext, index: int) -> dict:
    return ctx.chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                       "logprobs": None, "finish_reason": None}])


def chat_chunk(ctx: ResponseContext, update: ChoiceUpdate, logprobs: dict | None) -> dict:
    delta = {"content": update.text} if update.text else {}
    return ctx.chunk([{"index": update.index, "delta": delta, "logprobs": logprobs,
                       "finish_reason": update.finish_reason}])


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
