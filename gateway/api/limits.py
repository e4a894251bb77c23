"""What one request may ask of the server, checked before any worker sees it.

Each limit keeps one request from costing everyone else: gateway CPU (characters to
tokenize, messages to render), worker slots (prompts x n engine requests), time and KV (the
max_tokens cap, which also bounds the chat default), and the wire (a SUBMIT must fit one
frame, or the worker would drop it and the request would wait forever).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeroserve.common.protocol import MAX_FRAME_BYTES, Submit, encode
from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.errors import invalid_request

MAX_ENGINE_REQUESTS = 256  # prompts x n in one HTTP request
MAX_MESSAGES = 2048
MAX_STOP_TOKEN_IDS = 256
# Worst case msgpack sizes: a token id (uint32) is 5 bytes; the rest of a SUBMIT (request id,
# the sampling parameters, stop_token_ids at most MAX_STOP_TOKEN_IDS x 5) stays far below.
_MAX_TOKEN_BYTES = 5
_MAX_SUBMIT_OVERHEAD = 16 * 1024


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int | None = None  # None: token ids are not checked against a vocabulary
    max_tokens_limit: int = 4096
    max_prompt_chars: int = 1_000_000
    max_engine_requests: int = MAX_ENGINE_REQUESTS
    max_messages: int = MAX_MESSAGES
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    # A forced tool call's arguments may hold only the declared properties where the tool's
    # schema does not say (structured_output.closed_schema); False: any extra keys.
    close_tool_schemas: bool = True

    @classmethod
    def from_config(cls, config: GatewayConfig, vocab_size: int) -> RequestLimits:
        return cls(vocab_size=vocab_size, max_tokens_limit=config.max_tokens_limit,
                   max_prompt_chars=config.max_prompt_chars,
                   close_tool_schemas=not config.allow_extra_tool_arguments)


def check_submit_fits(prompt_token_ids: list[int], params: dict[str, Any], credit: int) -> None:
    """400 when this request's SUBMIT would not fit one wire frame. Encoded only when the
    cheap upper bound says it might not fit (a prompt of millions of tokens)."""
    estimate = _MAX_TOKEN_BYTES * len(prompt_token_ids) + _MAX_SUBMIT_OVERHEAD
    if estimate <= MAX_FRAME_BYTES:
        return
    frames = encode(Submit("req-" + "0" * 32, prompt_token_ids, params, credit))
    if sum(len(f) for f in frames) > MAX_FRAME_BYTES:
        raise invalid_request(f"The request is too large to send to a worker (over "
                              f"{MAX_FRAME_BYTES} bytes); shorten the prompt.",
                              param="prompt", code="request_too_large")
