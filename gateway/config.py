"""Gateway configuration: one frozen dataclass, validated on creation."""

from __future__ import annotations

import enum
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from zeroserve.common.keys import InsecurePlaneError, check_plane_security
from zeroserve.common.runtime_dir import make_private_dirs, runtime_dir
from zeroserve.gateway.key_limits import (
    default_limits,
    load_key_limits,
    load_model_limits,
    load_priorities,
)

LOG_FORMATS = ("text", "json")


class RoutingPolicy(enum.Enum):
    """Which worker takes a request (gateway/workers/routing.py)."""
    CACHE_AWARE = "cache_aware"
    LEAST_LOADED = "least_loaded"


ROUTING_POLICIES = tuple(p.value for p in RoutingPolicy)
SCHEDULING_POLICIES = ("fair", "fcfs")  # the gateway's queue (gateway/admission.py)


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "default"  # for the tokenizer and chat template; as EngineConfig.model
    served_model_name: str | None = None
    chat_template: str | None = None  # a file whose template replaces the model's own
    router_address: str | None = None  # None -> default_endpoints(port)
    tokens_address: str | None = None
    credit_window: int = 32
    slow_client_timeout_s: float = 30.0
    max_queued_requests: int = 256  # beyond: 429 with Retry-After
    heartbeat_interval_s: float = 0.5
    worker_timeout_s: float = 3.0  # no heartbeat for this long -> worker lost
    log_format: str = "text"  # "text" or "json"
    # Added beyond docs/architecture.md (all defaulted):
    queue_timeout_s: float = 60.0  # a queued request waits this long for a worker, then 503
    # Requests a worker may hold beyond max_num_seqs (its own waiting queue); None -> as many
    # again as its max_num_seqs. More than that waits in the gateway's bounded queue.
    max_waiting_per_worker: int | None = None
    log_level: str = "info"
    # HTTP input limits (gateway/http/request_body.py, gateway/api/limits.py, gateway/http/http_protocol.py):
    max_request_body_bytes: int = 8 * 1024 * 1024  # beyond: 413
    request_body_timeout_s: float = 30.0  # a body not fully received by then: 408
    header_timeout_s: float = 10.0  # a request head not complete by then: connection closed
    # A server cap on max_tokens, also the chat default's ceiling (with the room left in the
    # context): one request with no max_tokens holds a sequence slot and KV for a bounded time.
    max_tokens_limit: int = 4096
    max_prompt_chars: int = 1_000_000  # per prompt, per conversation and per /tokenize input
    # Slow readers and the event loop (gateway/http/sse.py, gateway/observability/loop_monitor.py):
    # a stream whose sends were blocked for most of the last slow_client_timeout_s and that
    # delivered fewer bytes/s than this over it is aborted (0 turns the rate rule off).
    min_client_rate: float = 1024.0
    # The kernel's send buffer for each client connection (SO_SNDBUF; 0: the kernel's
    # autotuning). Credit goes back when a chunk is handed to the socket, so this bounds
    # what a client that stops reading takes before its stream pauses: autotuned, a
    # loopback or LAN socket grows to 4 MiB (tcp_wmem), some 16,000 tokens, and such a
    # client was never paused nor aborted. Linux doubles the value given.
    client_send_buffer_bytes: int = 64 * 1024
    # While a burst of requests arrives, the relay waits up to this long at a time for them
    # to be admitted first (gateway/workers/zmq_io.py, ZmqEdge._hold_for_admissions); 0: never.
    admission_hold_s: float = 0.05
    loop_lag_warn_s: float = 0.25  # event-loop lag at or above this is a stall: logged, counted
    # Bearer keys for the admin API (gateway/http/admin.py); never logged or shown in repr.
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    # The worker plane's keys (common/keys.py): required for tcp:// endpoints unless insecure.
    keys_dir: str | None = None
    insecure: bool = False  # the operator's explicit consent to tcp:// without CurveZMQ
    # Liveness and reconciliation (see gateway/core.py):
    # a running request with credit and no output from its worker for this long fails.
    request_idle_timeout_s: float = 300.0
    # a worker whose engine made no progress for this long gets no new work (UNHEALTHY).
    worker_stall_timeout_s: float = 30.0
    # On SIGTERM: new and queued requests get a 503 at once; running streams get this long to
    # finish, then end with an error event (gateway/server.py). Kubernetes: keep it under
    # terminationGracePeriodSeconds.
    shutdown_timeout_s: float = 5.0
    # Observability (gateway/observability/metrics.py, gateway/observability/tracing.py): an OTLP collector for request
    # traces (None: no tracing), and whether to skip Prometheus metrics altogether.
    otlp_traces_endpoint: str | None = None
    disable_metrics: bool = False
    # The web console at /ui (gateway/http/ui.py): off -> /ui answers 404.
    disable_ui: bool = False
    # HTTP access (gateway/http/auth.py, gateway/http/rate_limit.py; CORS and hosts in gateway/app.py):
    # bearer keys for /v1/*, /tokenize and /detokenize; never logged or shown in repr.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    allowed_origins: tuple[str, ...] = ()  # CORS; () -> no CORS headers: browsers cannot read
    allowed_hosts: tuple[str, ...] = ()  # Host header allow-list ("*.example.com"); () -> any
    # Default limits per API key (per client IP without keys); None: unlimited.
    rate_limit_rps: float | None = None  # requests per second
    rate_limit_burst: int | None = None  # requests at once; None -> rps rounded up
    rate_limit_tpm: int | None = None  # prompt + completion tokens per minute
    rate_limits_file: str | None = None  # per-key limits, JSON or TOML (gateway/http/rate_limit.py)
    # Which worker gets a request (gateway/workers/routing.py): "cache_aware" or "least_loaded".
    routing: str = "cache_aware"
    # The gateway's queue (gateway/admission.py): "fair" (priority classes, fair queuing
    # across keys) or "fcfs" (one first-in, first-out queue: the baseline).
    scheduling_policy: str = "fair"
    # Bind the HTTP port with SO_REUSEPORT, so that several gateway processes share it (the
    # kernel spreads connections over them): `zeroserve serve --gateways N`.
    reuse_port: bool = False
    # The gateways of one tier (`serve --gateways N`) share this folder and each answers
    # /metrics for all of them (gateway/observability/tier_metrics.py); `gateway_index` names this one.
    metrics_dir: str | None = None
    gateway_index: int = 0
    # A reasoning model's <think> output (gateway/text/reasoning.py): "qwen3" or
    # "deepseek_r1"; None: picked from the chat template (a template writing <think>: qwen3).
    reasoning_parser: str | None = None
    # Stored responses (/v1/responses with store; gateway/http/response_store.py): a private
    # folder the gateways of a tier share (None: tier_responses_dir(port)), how many a key
    # keeps (the oldest go) and for how long.
    responses_dir: str | None = None
    # A forced tool call may write keys its tool's schema does not declare (where the schema
    # does not say; default: closed, as llama.cpp's grammars are).
    allow_extra_tool_arguments: bool = False
    response_store_size: int = 1000
    response_store_ttl_s: float = 24 * 3600.0
    # More models beside `model` (gateway/workers/models.py): "NAME=PATH" each (`--add-model`;
    # a "NAME@VERSION=PATH" form names a version, which the gateway does not need: the
    # tokenizer is the served name's). Aliases over them, "ALIAS=TARGET:WEIGHT,..."
    # (`--model-alias chat=smollm@v1:90,smollm@v2:10`), and the file through which the
    # gateways of a tier share changed weights (None: none; `serve --gateways N` sets one).
    extra_models: tuple[str, ...] = ()
    model_aliases: tuple[str, ...] = ()
    aliases_file: str | None = None
    # Where class shares set through the admin API are kept for the next start
    # (gateway/class_shares.py; the CLI sets tier_class_shares_file(port)); None: not kept.
    class_shares_file: str | None = None

    def __post_init__(self) -> None:
        self._check_input_limits()
        self._check_http_access()
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in [0, 65535]")
        if self.credit_window < 1:
            raise ValueError("credit_window must be >= 1")
        if self.slow_client_timeout_s <= 0:
            raise ValueError("slow_client_timeout_s must be > 0")
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        if self.worker_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("worker_timeout_s must exceed heartbeat_interval_s")
        if self.queue_timeout_s <= 0:
            raise ValueError("queue_timeout_s must be > 0")
        if self.max_waiting_per_worker is not None and self.max_waiting_per_worker < 0:
            raise ValueError("max_waiting_per_worker must be >= 0")
        check_plane_security(self.endpoints, self.keys_dir, self.insecure)
        if self.request_idle_timeout_s <= 0:
            raise ValueError("request_idle_timeout_s must be > 0")
        if self.worker_stall_timeout_s <= 0:
            raise ValueError("worker_stall_timeout_s must be > 0")
        if self.shutdown_timeout_s <= 0:
            raise ValueError("shutdown_timeout_s must be > 0")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}")
        if self.min_client_rate < 0:
            raise ValueError("min_client_rate must be >= 0")
        if self.client_send_buffer_bytes < 0:
            raise ValueError("client_send_buffer_bytes must be >= 0")
        if not 0 <= self.admission_hold_s <= 1:
            raise ValueError("admission_hold_s must be between 0 and 1")
        if self.loop_lag_warn_s <= 0:
            raise ValueError("loop_lag_warn_s must be > 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}")
        if self.response_store_size < 1 or self.response_store_ttl_s <= 0:
            raise ValueError("response_store_size must be >= 1 and response_store_ttl_s > 0")
        if self.reasoning_parser not in (None, "qwen3", "deepseek_r1"):
            raise ValueError("reasoning_parser must be qwen3 or deepseek_r1")
        for spec in self.extra_models:
            parse_model_spec(spec)

    def _check_input_limits(self) -> None:
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be >= 1024")
        if self.request_body_timeout_s <= 0:
            raise ValueError("request_body_timeout_s must be > 0")
        if self.header_timeout_s <= 0:
            raise ValueError("header_timeout_s must be > 0")
        if self.max_tokens_limit < 1:
            raise ValueError("max_tokens_limit must be >= 1")
        if self.max_prompt_chars < 1:
            raise ValueError("max_prompt_chars must be >= 1")

    def _check_http_access(self) -> None:
        # Errors name a key by its position only: keys are secrets.
        for position, key in enumerate(self.api_keys, start=1):
            if not (isinstance(key, str) and key and key.isascii() and key.isprintable()
                    and " " not in key and "," not in key):
                raise ValueError(f"API key {position} must be printable ASCII without spaces "
                                 "or commas")
        if len(set(self.api_keys)) != len(self.api_keys):
            raise ValueError("API keys must be distinct")
        for origin in self.allowed_origins:
            if origin != "*" and "://" not in origin:
                raise ValueError(f"allowed origin {origin!r} must be '*' or scheme://host[:port]")
        for host in self.allowed_hosts:
            if not host or " " in host or "*" in host[1:] or (
                    host.startswith("*") and host != "*" and not host.startswith("*.")):
                raise ValueError(f"allowed host {host!r} must be a host name, '*' or a "
                                 "pattern like *.example.com")
        if self.rate_limit_burst is not None and self.rate_limit_rps is None:
            raise ValueError("a rate limit burst needs a request rate (--rate-limit-rps)")
        default = default_limits(self.rate_limit_rps, self.rate_limit_burst,
                                 self.rate_limit_tpm)
        load_key_limits(self.rate_limits_file, self.api_keys, default)
        load_model_limits(self.rate_limits_file)
        load_priorities(self.rate_limits_file, self.api_keys)

    @property
    def endpoints(self) -> tuple[str, str]:
        """(router, tokens) addresses in effect."""
        router, tokens = default_endpoints(self.port)
        return self.router_address or router, self.tokens_address or tokens


def parse_model_spec(spec: str) -> tuple[str, str | None, str, int | None]:
    """`NAME[@VERSION]=PATH[:WORKERS]` -> (name, version, path, workers). ValueError if bad."""
    name, sep, path = spec.partition("=")
    name, at, version = name.strip().partition("@")
    workers = None
    head, colon, tail = path.rpartition(":")
    if colon and tail.isdigit():
        path, workers = head, int(tail)
    if not sep or not name or not path.strip() or (at and not version) or workers == 0:
        raise ValueError(f"model {spec!r} must be NAME[@VERSION]=PATH[:WORKERS] (WORKERS >= 1)")
    if not (name + version).isprintable() or len(name) > 256 or len(version) > 256:
        raise ValueError(f"model {spec!r}: the name and version must be printable")
    return name, version or None, path.strip(), workers


def tier_aliases_file(port: int) -> str:
    """Where the gateways of `serve --gateways N` on `port` share alias weights."""
    return str(_ipc_dir() / f"gw-{port}-aliases" / "aliases.json")


def tier_class_shares_file(port: int) -> str:
    """Where the gateways on `port` keep class shares set at run time across restarts."""
    return str(_ipc_dir() / f"gw-{port}-classes" / "shares.json")


def _ipc_dir() -> Path:
    return runtime_dir()


def tier_metrics_dir(port: int) -> str:
    """Where `serve --gateways N` on `port` keeps its gateways' metrics snapshots."""
    return str(_ipc_dir() / f"gw-{port}-metrics")


def tier_responses_dir(port: int) -> str:
    """Where the gateways on `port` keep stored responses (one folder for a whole tier)."""
    return str(_ipc_dir() / f"gw-{port}-responses")


def default_endpoints(port: int, index: int = 0) -> tuple[str, str]:
    """ipc:// router and tokens addresses, one pair per gateway port, under the temp dir.

    Gateway processes sharing a port (`serve --gateways N`) each have their own pair:
    index 0 has the one-gateway names, index i > 0 adds `-i`."""
    base = _ipc_dir() / (f"gw-{port}" if index == 0 else f"gw-{port}-{index}")
    return f"ipc://{base}-router.sock", f"ipc://{base}-tokens.sock"


class EndpointInUseError(RuntimeError):
    pass


def prepare_ipc_endpoint(address: str) -> None:
    """Make an ipc:// endpoint bindable: create its folder, remove a stale socket file.

    A gateway that died leaves its socket file behind. One that still listens there is
    not stale: taking its file would cut its workers off, so refuse instead.
    """
    if not address.startswith("ipc://"):
        return
    path = Path(address[len("ipc://"):])
    make_private_dirs(path.parent)
    check_private_dir(path.parent)
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_socket() and _is_listening(path):
        raise EndpointInUseError(f"{address} is in use by a running process")
    path.unlink()


def check_private_dir(folder: Path) -> None:
    """Anyone who can open an ipc:// socket file can speak as a worker: its folder must be
    ours and closed to everyone else."""
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise InsecurePlaneError(
            f"{folder} (the ipc:// sockets' folder) must be owned by uid {os.getuid()} and "
            f"closed to others (mode 700); it is uid {info.st_uid}, mode "
            f"{oct(info.st_mode & 0o777)}")


def _is_listening(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()
