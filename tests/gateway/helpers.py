"""Test helpers: a tiny byte-level tokenizer, a fake worker speaking the real protocol over
real ZeroMQ sockets, and a real uvicorn server running the gateway app in a thread."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from zeroserve.cli.harness import free_port
from zeroserve.common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Credit,
    Drain,
    Heartbeat,
    Hello,
    Ready,
    Shutdown,
    Submit,
    TokenOutput,
    Tokens,
    decode,
    encode,
)
from zeroserve.gateway.app import build_app
from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.server import GatewayHttpServer, uvicorn_config
from zeroserve.gateway.text.tokenizer import TextTokenizer, byte_to_unicode

IM_START, IM_END = 256, 257  # the byte tokenizer's special tokens
_PIDS = itertools.count(10_000)


def byte_tokenizer(max_model_len: int = 4096) -> TextTokenizer:
    """Byte-level BPE with no merges: token id == byte value; 256/257 are ChatML markers.
    Every multi-byte character spans several tokens, which is what the detokenizer must
    survive."""
    spell = byte_to_unicode()
    vocab = {spell[b]: b for b in range(256)}
    tk = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken("<|im_start|>", special=True, normalized=False),
                           AddedToken("<|im_end|>", special=True, normalized=False)])
    return TextTokenizer(tk, "<|im_start|>", "<|im_end|>", (IM_END,), None, max_model_len,
                         is_byte_level=True)


def text_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def cyclic_reply(text: str) -> Callable[[list[int], dict], list[int]]:
    """Reply with `text` repeated to max_tokens (finish 'length')."""
    def reply(prompt: list[int], params: dict) -> list[int]:
        base = text_tokens(text)
        n = params["max_tokens"]
        return (base * (n // len(base) + 1))[:n]
    return reply


def fixed_reply(text: str) -> Callable[[list[int], dict], list[int]]:
    """Reply with `text`, then EOS (finish 'stop'), cut at max_tokens ('length')."""
    return lambda prompt, params: text_tokens(text)


@dataclass
class FakeStream:
    request_id: str
    tokens: list[int]
    max_tokens: int
    num_prompt_tokens: int
    window: int  # the SUBMIT's credit
    logprobs: int | None
    num_sent: int = 0
    credit_limit: int = 0  # the highest CREDIT limit (cumulative), at least the window
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    attempt: int = 1  # the SUBMIT's, echoed by every output

    @property
    def credit(self) -> int:
        return max(self.window, self.credit_limit) - self.num_sent

    @property
    def num_outstanding(self) -> int:
        """Tokens sent and not yet credited by the gateway."""
        return self.num_sent - (max(self.window, self.credit_limit) - self.window)


@dataclass
class FakeWorker:
    """A worker thread speaking common.protocol over DEALER/PUSH. One 'engine step' every
    step_s emits up to tokens_per_step tokens per stream that has credit, in one TOKENS.

    Like the real worker it tags every output with its SUBMIT's attempt, honours attempts in
    ABORT and CREDIT, takes a SUBMIT of a request it holds as the gateway's word (goes on
    where both agree, else starts over from the gateway's tokens), says HELLO again when the
    gateway does not know it, and names in heartbeats the attempts it holds and its last
    TOKENS seq. It handles what the gateway sends `command_lag_steps` (default 1) steps
    late, as a real worker busy in a step does: outputs already in flight keep coming after
    an ABORT (0: at once, before its next step). While not stepping it handles them at
    once. What arrived is in `submits`, `aborts` and `credits` when it arrives."""

    router_address: str
    tokens_address: str
    worker_id: str = "fake-0"
    reply: Callable[[list[int], dict], list[int]] = field(
        default_factory=lambda: fixed_reply("Hello, world! 😀 日本語 done."))
    step_s: float = 0.002
    tokens_per_step: int = 1
    max_num_seqs: int = 64
    max_model_len: int = 4096
    heartbeat_s: float = 0.05
    protocol_version: int = PROTOCOL_VERSION
    pid: int = field(default_factory=lambda: next(_PIDS))  # each instance a "process"
    # observations
    submits: list[Submit] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    credits: list[list] = field(default_factory=list)
    streams: dict[str, FakeStream] = field(default_factory=dict)
    max_outstanding: dict[str, int] = field(default_factory=dict)
    num_sent: dict[str, int] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    refused_reason: str | None = None
    got_shutdown: bool = False
    is_heartbeating: bool = True  # set False to play dead
    is_stepping: bool = True
    num_submits_to_refuse: int = 0  # answer these many SUBMITs with an error, no tokens
    refusal_code: str | None = None  # those errors' TokenOutput.error_code
    # Fault injection at the ZeroMQ edge: messages for which these return True are lost
    # (incoming: gateway -> worker, before the worker sees them; outgoing: TOKENS).
    drop_incoming: Callable[[object], bool] = field(default=lambda msg: False)
    drop_outgoing: Callable[[Tokens], bool] = field(default=lambda msg: False)
    # Fault injection on what the worker sends: each TOKENS (or HEARTBEAT) goes through this,
    # which returns what to send now (lose: [], duplicate: [m, m], delay or reorder: hold
    # it and return it with a later one). Called with None once a step to release held ones.
    tokens_faults: Callable[[Tokens | None], list[Tokens]] | None = None
    heartbeat_faults: Callable[[Heartbeat | None], list[Heartbeat]] | None = None
    command_lag_steps: int = 1
    num_tokens_sent: int = 0  # TOKENS messages sent (Tokens.seq of the last), lost ones too
    progress_age_s: float = 0.0  # what heartbeats report (a large value: engine stuck)
    # As a prefix cache would: a prompt seen before is reported cached whole.
    is_prefix_caching: bool = False
    _seen_prompts: set[tuple[int, ...]] = field(default_factory=set)
    num_free_blocks: int = 1000  # what heartbeats report (of 1000)
    state: str = "ready"  # what heartbeats report
    counters: dict = field(default_factory=dict)  # what heartbeats report (cumulative)
    keys: object | None = None  # common.keys.WorkerKeys: speak CurveZMQ
    # The worker id its HELLO and TOKENS claim (default: worker_id); a rogue claims another.
    claimed_id: str | None = None
    gateway_heartbeats: list[Heartbeat] = field(default_factory=list)
    num_dropped: int = 0
    # What its HELLO announces (gateway/workers/models.py): "" -> the gateway's default model.
    served_model_name: str = ""
    model_version: str = ""

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._lock = threading.Lock()
        self._outbox: list[list[bytes]] = []
        self._refused: list[TokenOutput] = []
        self._lagged: list[tuple[int, object]] = []  # (step to handle it at, message)
        self._num_steps = 0

    def start(self) -> FakeWorker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def send_control(self, msg) -> None:
        """Queue a message to the gateway from the test thread (e.g. DRAIN, HELLO). Like a
        real worker, one that says DRAIN says "draining" in its heartbeats from then on."""
        if isinstance(msg, Drain):
            self.state = "draining"
        with self._lock:
            self._outbox.append(encode(msg))

    def hello(self) -> Hello:
        return Hello(self.protocol_version, self.claimed_id or self.worker_id, "fake",
                     self.max_model_len,
                     1000, 16, self.max_num_seqs, "cpu", self.pid, {},
                     self.served_model_name, self.model_version)

    def _run(self) -> None:
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, f"{self.worker_id}.{self.pid}".encode())  # its route
        dealer.setsockopt(zmq.LINGER, 0)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            from zeroserve.common.keys import curve_client

            curve_client(dealer, self.keys)
            curve_client(push, self.keys)
        dealer.connect(self.router_address)
        push.connect(self.tokens_address)
        dealer.send_multipart(encode(self.hello()))
        next_beat = next_step = time.monotonic()
        step = 0
        try:
            while not self._stop.is_set():
                if dealer.poll(int(self.step_s * 1000) or 1):
                    while True:
                        try:
                            frames = dealer.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._receive(decode(frames))
                with self._lock:
                    outbox, self._outbox = self._outbox, []
                for frames in outbox:
                    dealer.send_multipart(frames)
                now = time.monotonic()
                if not self.is_stepping:
                    self._handle_lagged()
                if now >= next_step and self.is_stepping:
                    next_step = now + self.step_s
                    self._num_steps += 1
                    self._handle_lagged()
                    outputs = self._step()
                    msg = None
                    if outputs:
                        step += 1
                        self.num_tokens_sent += 1
                        msg = Tokens(self.claimed_id or self.worker_id, step, outputs,
                                     self.num_tokens_sent)
                        if self.drop_outgoing(msg):
                            self.num_dropped += 1
                            msg = None
                    for m in ([msg] if self.tokens_faults is None and msg is not None
                              else [] if self.tokens_faults is None
                              else self.tokens_faults(msg)):
                        push.send_multipart(encode(m))
                if self.is_heartbeating and self.ready.is_set() and (
                        now >= next_beat or self.heartbeat_faults is not None):
                    beat = None
                    if now >= next_beat:
                        next_beat = now + self.heartbeat_s
                        beat = Heartbeat(
                            self.worker_id, self.state, len(self.streams), 0, 0,
                            self.num_free_blocks, 1000,
                            time.time(), request_ids=list(self.streams),
                            progress_age_s=self.progress_age_s, counters=dict(self.counters),
                            request_attempts=[s.attempt for s in self.streams.values()],
                            tokens_seq=self.num_tokens_sent)
                    for m in ([beat] if self.heartbeat_faults is None
                              else self.heartbeat_faults(beat)):
                        dealer.send_multipart(encode(m))
        finally:
            dealer.close(0)
            push.close(0)
            ctx.term()

    def _receive(self, msg) -> None:
        if self.drop_incoming(msg):
            self.num_dropped += 1
            return
        # Observed as they arrive (the I/O thread has them), handled maybe steps later.
        if isinstance(msg, Submit):
            self.submits.append(msg)
        elif isinstance(msg, Abort):
            self.aborts.extend(msg.request_ids)
        elif isinstance(msg, Credit):
            self.credits.extend(msg.grants)
        if self.command_lag_steps and self.is_stepping and not isinstance(
                msg, (Ready, Heartbeat)):
            # Handled before the step after `command_lag_steps` more steps ran.
            self._lagged.append((self._num_steps + self.command_lag_steps + 1, msg))
        else:
            self._handle(msg)

    def _handle_lagged(self) -> None:
        """What is due; everything while not stepping (no step is under way to wait for)."""
        while self._lagged and (self._lagged[0][0] <= self._num_steps or not self.is_stepping):
            self._handle(self._lagged.pop(0)[1])

    def _handle(self, msg) -> None:
        if isinstance(msg, Ready):
            if msg.accepted:
                self.ready.set()
            else:
                self.refused_reason = msg.reason
        elif isinstance(msg, Submit):
            if self.num_submits_to_refuse > 0:
                self.num_submits_to_refuse -= 1
                self._refused.append(TokenOutput(msg.request_id, [], "error",
                                                 len(msg.prompt_token_ids), 0, 0, None,
                                                 "worker is draining", attempt=msg.attempt,
                                                 error_code=self.refusal_code))
                return
            held = self.streams.get(msg.request_id)
            if held is not None and held.num_sent == len(msg.output_token_ids):
                held.attempt = msg.attempt  # the gateway's word: go on under its attempt
                held.credit_limit = max(held.credit_limit, msg.credit)
                return
            tokens = self.reply(msg.prompt_token_ids, msg.params)[:msg.params["max_tokens"]]
            # A stream moved here from another worker goes on after what it produced there.
            prompt = tuple(msg.prompt_token_ids)
            is_cached = self.is_prefix_caching and prompt in self._seen_prompts
            self._seen_prompts.add(prompt)
            self.streams[msg.request_id] = FakeStream(
                msg.request_id, tokens, msg.params["max_tokens"], len(msg.prompt_token_ids),
                msg.credit, msg.params.get("logprobs"), num_sent=len(msg.output_token_ids),
                num_cached_tokens=len(prompt) if is_cached else 0,
                prompt_logprobs=_prompt_logprobs(prompt, msg.params.get("prompt_logprobs")),
                attempt=msg.attempt)
        elif isinstance(msg, Abort):
            attempts = msg.attempts or [0] * len(msg.request_ids)
            for rid, attempt in zip(msg.request_ids, attempts, strict=True):
                s = self.streams.get(rid)
                if s is not None and attempt in (0, s.attempt):
                    del self.streams[rid]
        elif isinstance(msg, Credit):
            for rid, limit, *attempt in msg.grants:
                s = self.streams.get(rid)
                if s is not None and attempt in ([], [s.attempt]):
                    s.credit_limit = max(s.credit_limit, limit)
        elif isinstance(msg, Shutdown):
            self.got_shutdown = True
        elif isinstance(msg, Heartbeat):
            self.gateway_heartbeats.append(msg)
            if msg.state == "unknown" and self.ready.is_set():
                # The gateway expired or forgot us: say HELLO again, keep the streams.
                with self._lock:
                    self._outbox.append(encode(self.hello()))
        elif isinstance(msg, Drain):
            pass

    def _step(self) -> list[TokenOutput]:
        outputs, self._refused = self._refused, []
        for rid, s in list(self.streams.items()):
            k = min(self.tokens_per_step, s.credit, len(s.tokens) - s.num_sent)
            if k <= 0 and s.num_sent < len(s.tokens):
                continue  # paused: out of credit
            new = s.tokens[s.num_sent:s.num_sent + k]
            s.num_sent += k
            self.num_sent[rid] = s.num_sent
            self.max_outstanding[rid] = max(self.max_outstanding.get(rid, 0), s.num_outstanding)
            finish = None
            if s.num_sent >= len(s.tokens):
                finish = "length" if len(s.tokens) >= s.max_tokens else "stop"
                del self.streams[rid]
            lps = None
            if s.logprobs is not None:
                lps = [[-0.25, [[t, -0.25]] + [[(t + j) % 256, -1.0 - j]
                                               for j in range(1, s.logprobs)]] for t in new]
            outputs.append(TokenOutput(rid, new, finish, s.num_prompt_tokens, s.num_sent,
                                       s.num_cached_tokens, lps, None,
                                       prompt_logprobs=s.prompt_logprobs, attempt=s.attempt))
            s.prompt_logprobs = None
        return outputs


def _prompt_logprobs(prompt: tuple[int, ...], k: int | None) -> list | None:
    """Per prompt token after the first: its logprob -1 - i and k alternatives (the token
    itself at -0.5 first)."""
    if k is None:
        return None
    return [[-1.0 - i, [[t, -0.5]] + [[(t + j) % 256, -1.0 - j] for j in range(1, k)]]
            for i, t in enumerate(prompt[1:])]


class GatewayServer:
    """The real app on a real uvicorn server in a background thread."""

    def __init__(self, tokenizer: TextTokenizer | None = None,
                 uvicorn_overrides: dict | None = None,
                 tokenizers: dict[str, TextTokenizer] | None = None, **overrides):
        self.port = free_port()
        defaults = dict(port=self.port, heartbeat_interval_s=0.05, worker_timeout_s=1.0,
                        queue_timeout_s=5.0)
        defaults.update(overrides)
        self.config = GatewayConfig(**defaults)
        self.app = build_app(self.config, tokenizer or byte_tokenizer(), tokenizers)
        # The product's uvicorn settings and server class (its HTTP protocol class, so
        # streamed chunks take the direct write path as they do in `zeroserve gateway`).
        settings = {"host": "127.0.0.1", "port": self.port, "log_level": "warning",
                    **(uvicorn_overrides or {})}
        self.server = GatewayHttpServer(uvicorn_config(self.app, self.config, **settings),
                                        self.app.state.gateway)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()),
                                        daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    def shrink_send_buffers(self, num_bytes: int = 4096) -> int:
        """Make every open client connection's server-side buffers tiny, so a client that
        stops reading blocks the server's writes after kilobytes instead of megabytes."""

        connections = list(self.server.server_state.connections)

        def shrink() -> None:
            for conn in connections:
                transport = conn.transport
                transport.set_write_buffer_limits(high=num_bytes)
                transport.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_SNDBUF, num_bytes)

        assert self.loop is not None
        self.loop.call_soon_threadsafe(shrink)
        return len(connections)

    def shrink_the_stream(self, worker) -> str:
        """For a test with one client connection: once `worker` has its stream's SUBMIT,
        shrink that connection's server-side buffers (shrink_send_buffers). Returns the
        stream's request id."""
        assert wait_until(lambda: worker.submits, 5)
        assert self.shrink_send_buffers() == 1
        return worker.submits[0].request_id

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def gateway(self):
        return self.app.state.gateway

    def worker(self, **kwargs) -> FakeWorker:
        router, tokens = self.config.endpoints
        return FakeWorker(router, tokens, **kwargs)

    def __enter__(self) -> GatewayServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(10)


def raw_completion(port: int, body: dict, rcvbuf: int | None = None):
    """POST /v1/completions on a plain socket (optionally with a tiny receive buffer) and
    return the socket, unread: for clients that stop reading."""
    import json

    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def one_shot(port: int, head: str, body: bytes = b"") -> bytes:
    """One request on a connection of its own (closed after it), as raw bytes: `head` is the
    request line and headers without the blank line; no client objects of this process's
    own (for the tests that count what the garbage collector finds)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode() + b"Connection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
