"""Per-key rate limits: a token bucket for requests and one for tokens, per API key.

- **Requests**: `requests_per_second` refills a bucket of `burst` requests (default: the
  rate rounded up, at least 1); each request to a protected path (`gateway/http/auth.py`) takes
  one.
- **Tokens**: `tokens_per_minute` refills a bucket of one minute's tokens. A generation
  reserves what it may cost once it is validated, before any worker sees it: its prompt
  tokens (each prompt once, whatever `n`) plus `n` x `max_tokens` per prompt. It is refused
  (429) unless the bucket holds that much, or a whole minute's worth for a request larger
  than that; so a key cannot start more work than its budget by sending it all at once.
  When the response ends, what was reserved and not used (`usage`'s total is the cost, plus
  each prompt once more when echo + logprobs computed its logprobs) is given back. A request larger than a minute's tokens leaves the balance below zero; a
  client whose balance is below zero is refused until it has refilled to zero (a
  4,000-token request on a 1,000 tokens/minute key: about three minutes).
- **Concurrency**: `max_concurrent_requests` bounds a client's requests in flight (a stream
  counts until it ends); past it, 429 with `Retry-After: 1`. Unlimited unless the per-key
  file sets it: one key can then no longer fill the gateway's queue for everyone.
- Over either limit: 429 in OpenAI's shape (`rate_limit_error`, `rate_limit_exceeded`) with
  `Retry-After`: the whole seconds until the request would be admitted.
- Who is limited: each API key, with its own limits from `--rate-limits FILE` (JSON or
  TOML: key -> {requests_per_second, burst, tokens_per_minute, max_concurrent_requests}; a
  field left out takes the
  flag's default, `null` or "unlimited" is unlimited) or the defaults from `--rate-limit-rps`,
  `--rate-limit-burst`, `--rate-limit-tpm`. Without API keys the defaults apply per client
  IP address (behind a proxy: the proxy's), in at most MAX_IP_BUCKETS buckets, the least
  recently used dropped first: a courtesy against one greedy client, not a defence.
- Per model: the file's `models` table (`{"models": {"tiny": {"requests_per_second": 5,
  "tokens_per_minute": 10000}}}`) limits each client's use of one served model, on top of
  its own limits: a generation for that model takes a request from the client's bucket for
  the model and reserves its tokens there too (429 naming the model), checked once the
  request's `model` is known; aliases count against the served model they pick.
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
        # Requests in flight per client with a concurrency limit (no entry at zero).
        self._in_flight: dict[Hashable, int] = {}
        # Served model -> the limiter of each client's use of it (the file's models table).
        self.models: dict[str, RateLimiter] = {}

    def limit_models(self, per_model: dict[str, Limits]) -> None:
        self.models = {name: RateLimiter(limits, max_ip_buckets=self.max_ip_buckets,
                                         clock=self.clock)
                       for name, limits in per_model.items() if not limits.is_unlimited}

    @property
    def is_enabled(self) -> bool:
        return not self.default.is_unlimited or bool(self.models) or any(
            not limits.is_unlimited for limits in self.per_key.values())

    def limits(self, client: Hashable) -> Limits:
        return self.per_key.get(client, self.default) if type(client) is int else self.default

    def admit(self, client: Hashable) -> APIError | None:
        """Take one request from `client`'s bucket; a 429 if it is over a limit. An admitted
        request is in flight until `finish`."""
        limits = self.limits(client)
        if limits.is_unlimited:
            return None
        in_flight = self._in_flight.get(client, 0)
        if limits.max_concurrent_requests is not None \
                and in_flight >= limits.max_concurrent_requests:
            return rate_limited(
                f"Rate limit reached for concurrent requests: at most "
                f"{limits.max_concurrent_requests} at once. Retry after the Retry-After "
                "seconds.", 1)
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
        if limits.max_concurrent_requests is not None:
            self._in_flight[client] = in_flight + 1
        return None

    def reserve(self, client: Hashable, num_tokens: int) -> APIError | None:
        """Take what a generation may cost from the token bucket now; a 429 unless the
        bucket holds it (or, for one larger than the bucket, a full bucket)."""
        limits = self.limits(client)
        if limits.tokens_per_minute is None or num_tokens <= 0:
            return None
        now = self.clock()
        bucket = self._buckets(client, limits, now).tokens
        assert bucket is not None
        bucket.refill(now)
        needed = min(num_tokens, bucket.capacity)
        if bucket.level < needed:
            return rate_limited(
                f"Rate limit reached for tokens: {limits.tokens_per_minute} per minute "
                f"(prompt + completion); this request may use {num_tokens} (its prompt and "
                f"max_tokens) and {max(0, math.floor(bucket.level))} are left. Retry after "
                "the Retry-After seconds, or ask for fewer max_tokens.",
                _whole_seconds(bucket.seconds_until(needed)))
        bucket.level -= num_tokens
        return None

    def finish(self, client: Hashable, num_tokens: int, num_reserved: int = 0) -> None:
        """A request ended: it used `num_tokens` of the `num_reserved` taken for it. The
        difference is charged or given back (never above a full bucket), and the request
        is no longer in flight."""
        in_flight = self._in_flight.get(client)
        if in_flight is not None:
            if in_flight > 1:
                self._in_flight[client] = in_flight - 1
            else:
                del self._in_flight[client]
        self.charge(client, num_tokens - num_reserved)

    def charge(self, client: Hashable, num_tokens: int) -> None:
        """Charge tokens (the balance may go below zero); a negative count gives back."""
        if num_tokens == 0:
            return
        buckets = self._keys.get(client) if type(client) is int else self._ips.get(client)
        if buckets is not None and buckets.tokens is not None:
            bucket = buckets.tokens
            bucket.refill(self.clock())
            bucket.level = min(bucket.capacity, bucket.level - num_tokens)

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
    """The generations one HTTP request ran, and the tokens reserved for them; read when
    its response has ended."""

    def __init__(self, limiter: RateLimiter, client: Hashable) -> None:
        self.limiter = limiter
        self.client = client
        self.num_reserved = 0
        self._groups: list[Any] = []
        self._per_model: list[tuple[RateLimiter, Any, int]] = []  # (its limiter, group, tokens)

    def add(self, group: Any, num_tokens: int, model: str | None = None) -> None:
        """Reserve `num_tokens` for `group` (429 when the client's budget lacks them, or its
        budget for `model`)."""
        model_limiter = None if model is None else self.limiter.models.get(model)
        if model_limiter is not None:
            refusal = model_limiter.admit(self.client)
            if refusal is None:
                refusal = model_limiter.reserve(self.client, num_tokens)
                if refusal is not None:
                    model_limiter.finish(self.client, 0)
            if refusal is not None:
                raise APIError(refusal.status, f"{refusal.message} (the limit of model "
                                               f"'{model}')", type=refusal.type,
                               code=refusal.code, headers=refusal.headers)
        refusal = self.limiter.reserve(self.client, num_tokens)
        if refusal is not None:
            if model_limiter is not None:
                model_limiter.finish(self.client, 0, num_tokens)
            raise refusal
        self.num_reserved += num_tokens
        self._groups.append(group)
        if model_limiter is not None:
            self._per_model.append((model_limiter, group, num_tokens))

    def finish_models(self) -> None:
        """The response ended: each model's budget gets back what its group did not use."""
        for model_limiter, group, num_reserved in self._per_model:
            model_limiter.finish(self.client, group.num_billed_tokens, num_reserved)
        self._per_model.clear()

    @property
    def num_tokens(self) -> int:
        return sum(group.num_billed_tokens for group in self._groups)


def track_usage(request: Request, group: Any, num_tokens: int,
                model: str | None = None) -> None:
    """Reserve what `group` may cost (`num_tokens`: prompts + n x max_tokens) and count
    its tokens (anything with `num_billed_tokens`) against the request's client, if rate
    limits are on; called by the route that runs the generation before it registers any
    engine request. Raises the 429 when the client's token budget lacks them."""
    meter = request.scope.get("state", {}).get(USAGE_STATE)
    if meter is not None:
        meter.add(group, num_tokens, model)


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
        client = rate_limit_client(scope)
        refusal = self.limiter.admit(client)
        if refusal is not None:
            if self.on_refused is not None:
                self.on_refused(refusal)
            await error_response(refusal)(scope, receive, send)
            return
        meter = scope.setdefault("state", {})[USAGE_STATE] = UsageMeter(self.limiter, client)
        try:
            await self.app(scope, receive, send)  # returns when the response (stream) ended
        finally:
            self.limiter.finish(client, meter.num_tokens, meter.num_reserved)
            meter.finish_models()


def rate_limit_client(scope: Scope) -> Hashable:
    """Who a request counts against: its API key's index, else ("ip", its address)."""
    index = key_index(scope)
    if index is not None:
        return index
    client = scope.get("client")
    return ("ip", client[0] if client else None)
