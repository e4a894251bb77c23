"""Per-key rate limits: a token bucket for requests and one for tokens, per API key.

- **Requests**: `requests_per_second` refills a bucket of `burst` requests (default: the
  rate rounded up, at least 1); each request to a protected path (`gateway/http/auth.py`) takes
  one.
- **Tokens**: `tokens_per_minute` refills a bucket of one minute's tokens. A request's cost
  (prompt + completion tokens, as its `usage` reports them, each prompt counted once
  whatever `n`) is known only when its response ends, so it is charged then, and the
  balance may go below zero; a client whose balance is below zero is refused until it has
  refilled to zero. So a single request is never cut short, and a key that overspends waits
  for its debt to refill (a 4,000-token reply on a 1,000 tokens/minute key: about three
  minutes).
- Over either limit: 429 in OpenAI's shape (`rate_limit_error`, `rate_limit_exceeded`) with
  `Retry-After`: the whole seconds until the request would be admitted.
- Who is limited: each API key, with its own limits from `--rate-limits FILE` (JSON or
  TOML: key -> {requests_per_second, burst, tokens_per_minute}; a field left out takes the
  flag's default, `null` or "unlimited" is unlimited) or the defaults from `--rate-limit-rps`,
  `--rate-limit-burst`, `--rate-limit-tpm`. Without API keys the defaults apply per client
  IP address (behind a proxy: the proxy's), in at most MAX_IP_BUCKETS buckets, the least
  recently used dropped first: a courtesy against one greedy client, not a defence.
- Memory is bounded: buckets exist per configured key, or in the IP LRU.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from zeroserve.gateway.errors import APIError, rate_limited
from zeroserve.gateway.http.auth import is_protected, key_index
from zeroserve.gateway.http.error_response import error_response
from zeroserve.gateway.key_limits import Limits

MAX_IP_BUCKETS = 4096
USAGE_STATE = "usage_meter"  # request.state attribute: the UsageMeter of this request


class TokenBucket:
    """`capacity` units, refilled at `rate` a second; the level may go below zero."""

    def __init__(self, capacity: float, rate: float, now: float):
        self.capacity = capacity
        self.rate = rate
        self.level = capacity
        self.updated = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def seconds_until(self, level: float) -> float:
        """Seconds until the bucket holds `level` (0 if it does); call refill first."""
        return max(0.0, (level - self.level) / self.rate)


@dataclass
class _Buckets:
    requests: TokenBucket | None
    tokens: TokenBucket | None


class RateLimiter:
    """Buckets per client: an API key's index, or ("ip", address) without keys."""

    def __init__(self, default: Limits, per_key: dict[int, Limits] | None = None,
                 max_ip_buckets: int = MAX_IP_BUCKETS,
                 clock: Callable[[], float] = time.monotonic):
        self.default = default
        self.per_key = per_key or {}
        self.max_ip_buckets = max_ip_buckets
        self.clock = clock
        self._keys: dict[int, _Buckets] = {}  # at most one per configured key
        self._ips: OrderedDict[Hashable, _Buckets] = OrderedDict()  # LRU

    @property
    def is_enabled(self) -> bool:
        return not self.default.is_unlimited or any(
            not limits.is_unlimited for limits in self.per_key.values())

    def limits(self, client: Hashable) -> Limits:
        return self.per_key.get(client, self.default) if type(client) is int else self.default

    def admit(self, client: Hashable) -> APIError | None:
        """Take one request from `client`'s bucket; a 429 if it is over a limit."""
        limits = self.limits(client)
        if limits.is_unlimited:
            return None
        now = self.clock()
        buckets = self._buckets(client, limits, now)
        if buckets.tokens is not None:
            buckets.tokens.refill(now)
            if buckets.tokens.level < 0:
                return rate_limited(
                    f"Rate limit reached for tokens: {limits.tokens_per_minute} per minute "
                    "(prompt + completion). Retry after the Retry-After seconds.",
                    _whole_seconds(buckets.tokens.seconds_until(0)))
        if buckets.requests is not None:
            buckets.requests.refill(now)
            if buckets.requests.level < 1:
                return rate_limited(
                    f"Rate limit reached for requests: {limits.requests_per_second:g} per "
                    f"second (burst {limits.request_capacity}). Retry after the Retry-After "
                    "seconds.", _whole_seconds(buckets.requests.seconds_until(1)))
            buckets.requests.level -= 1
        return None

    def charge(self, client: Hashable, num_tokens: int) -> None:
        """Charge a finished request's tokens (the balance may go below zero)."""
        if num_tokens <= 0:
            return
        buckets = self._keys.get(client) if type(client) is int else self._ips.get(client)
        if buckets is not None and buckets.tokens is not None:
            buckets.tokens.refill(self.clock())
            buckets.tokens.level -= num_tokens

    def _buckets(self, client: Hashable, limits: Limits, now: float) -> _Buckets:
        table = self._keys if type(client) is int else self._ips
        buckets = table.get(client)
        if buckets is None:
            buckets = table[client] = _new_buckets(limits, now)
            if table is self._ips and len(table) > self.max_ip_buckets:
                table.popitem(last=False)
        elif table is self._ips:
            table.move_to_end(client)
        return buckets


def _new_buckets(limits: Limits, now: float) -> _Buckets:
    requests = tokens = None
    if limits.requests_per_second is not None:
        requests = TokenBucket(limits.request_capacity, limits.requests_per_second, now)
    if limits.tokens_per_minute is not None:
        tokens = TokenBucket(limits.tokens_per_minute, limits.tokens_per_minute / 60, now)
    return _Buckets(requests, tokens)


def _whole_seconds(seconds: float) -> int:
    return max(1, math.ceil(seconds))


# --- per request: what its response cost ----------------------------------------------------


class UsageMeter:
    """The generations one HTTP request ran; read when its response has ended."""

    def __init__(self) -> None:
        self._groups: list[Any] = []

    def add(self, group: Any) -> None:
        self._groups.append(group)

    @property
    def num_tokens(self) -> int:
        return sum(group.usage()["total_tokens"] for group in self._groups)


def track_usage(request: Request, group: Any) -> None:
    """Count `group`'s tokens (anything with OpenAI's `usage()`) against the request's
    client, if rate limits are on; called by the route that runs the generation."""
    meter = request.scope.get("state", {}).get(USAGE_STATE)
    if meter is not None:
        meter.add(group)


class RateLimitMiddleware:
    """ASGI middleware, inside ApiKeyMiddleware: admit or 429, then charge the tokens."""

    def __init__(self, app: ASGIApp, limiter: RateLimiter,
                 on_refused: Callable[[APIError], None] | None = None):
        self.app = app
        self.limiter = limiter
        self.on_refused = on_refused  # the metrics' count of 429s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] == "OPTIONS"
                or not is_protected(scope["path"])):
            await self.app(scope, receive, send)
            return
        client = _client(scope)
        refusal = self.limiter.admit(client)
        if refusal is not None:
            if self.on_refused is not None:
                self.on_refused(refusal)
            await error_response(refusal)(scope, receive, send)
            return
        meter = scope.setdefault("state", {})[USAGE_STATE] = UsageMeter()
        try:
            await self.app(scope, receive, send)  # returns when the response (stream) ended
        finally:
            self.limiter.charge(client, meter.num_tokens)


def _client(scope: Scope) -> Hashable:
    index = key_index(scope)
    if index is not None:
        return index
    client = scope.get("client")
    return ("ip", client[0] if client else None)
