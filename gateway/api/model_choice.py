"""Which served model a request asks for, and the key that keeps a conversation on one version.

The gateway's catalog (gateway/workers/models.py) turns the request's `model` into a target;
an alias over versions picks by the conversation's sticky key, so that every turn of one
chat lands on the same version (and its prefix cache) while the weights stay.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Headers that name a conversation or session (Codex sends session-id and thread-id; older
# clients used underscores; X-Session-ID is the common proxy convention).
SESSION_HEADERS = ("x-session-id", "session-id", "session_id", "conversation-id",
                   "conversation_id", "thread-id")
_MAX_KEY_CHARS = 1024


def requested_model(body: Mapping[str, Any]) -> str | None:
    """The body's `model` when it is a string (a wrong type is the parser's 400 to give)."""
    model = body.get("model")
    return model if isinstance(model, str) else None


def sticky_key(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The conversation's name: `prompt_cache_key`, a session header, `user` (OpenAI's), or
    Anthropic's `metadata.user_id`; None: the request names none (a weighted random pick)."""
    for value in (body.get("prompt_cache_key"),
                  next((headers[h] for h in SESSION_HEADERS if headers.get(h)), None),
                  body.get("user"), _metadata_user(body)):
        if isinstance(value, str) and value:
            return value[:_MAX_KEY_CHARS]
    return None


def _metadata_user(body: Mapping[str, Any]) -> Any:
    metadata = body.get("metadata")
    return metadata.get("user_id") if isinstance(metadata, Mapping) else None
