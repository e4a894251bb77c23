"""The gateway <-> worker wire protocol: message types and their codec, nothing else.

Every message is two ZeroMQ frames: a one-byte type, then a msgpack array holding the
message's fields in declaration order. (A ROUTER socket prepends the peer identity.)
Decoding is defensive: a frame that is too large, of an unknown type, or with fields of
the wrong type raises `ProtocolError`, which receive loops log and drop.

Sockets (see docs/protocol.md):
- gateway ROUTER  <- worker DEALER : HELLO, HEARTBEAT, DRAIN, ERROR   (worker -> gateway)
                  -> worker DEALER : READY, SUBMIT, ABORT, CREDIT, HEARTBEAT, DRAIN, SHUTDOWN
- gateway PULL    <- worker PUSH   : TOKENS (one message per engine step, all streams)
- DEBUG_REQUEST (gateway -> worker) and DEBUG_REPLY (worker -> gateway) travel on the
  ROUTER/DEALER pair and are answered by the worker's link (I/O) thread, not its engine.
"""

from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import MISSING as _MISSING
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 5  # 5: SUBMIT.flow; 4: SUBMIT.priority; 3: attempt-tagged SUBMIT/ABORT/CREDIT/TokenOutput, TOKENS seq


# The ZMTP metadata property on a worker's TOKENS socket naming its process (the PULL side has
# no routes): a gateway lets only the incarnation it bound by its HELLO move that worker id's
# TOKENS sequence, so TOKENS still queued from a dead process of the same id cannot.
INCARNATION_PROPERTY = "X-Incarnation"


def incarnation(route: bytes) -> str:
    """The public name of the worker process of `route` (its DEALER routing id, a secret):
    what its TOKENS socket carries and what the gateways' admin APIs show."""
    return hashlib.sha256(route).hexdigest()[:12]
MAX_FRAME_BYTES = 16 * 1024 * 1024  # a 1M-token prompt still fits; anything bigger is garbage
MAX_LIST_ITEMS = 2_000_000
MAX_OUTPUTS_PER_STEP = 65_536  # streams one TOKENS message may carry
MAX_NAME_CHARS = 256  # worker ids, model names, devices
GRAMMAR_KINDS = ("json_schema", "lark", "regex")  # Submit.grammar kinds
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_PRIORITY = 255  # |SUBMIT.priority|: far more classes than any operator names
MAX_FLOW = 2**32 - 1  # SUBMIT.flow: a 32-bit hash of the client (0: none)


class ProtocolError(ValueError):
    """A frame we refuse to decode. Receivers log it and carry on."""


class MsgType(enum.IntEnum):
    HELLO = 1
    READY = 2
    SUBMIT = 3
    ABORT = 4
    CREDIT = 5
    TOKENS = 6
    HEARTBEAT = 7
    DRAIN = 8
    ERROR = 9
    SHUTDOWN = 10
    UNDRAIN = 11
    DEBUG_REQUEST = 12
    DEBUG_REPLY = 13


class WorkerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


# HEARTBEAT.state from the gateway meaning "I do not know you: say HELLO" (it restarted, or
# it expired the worker).
UNKNOWN_WORKER = "unknown"

# Finish reasons on the wire are the strings of worker.sequence.FinishReason.
FINISH_REASONS = ("stop", "length", "abort", "error")

# TokenOutput.error_code of a request that made the engine's step fail when it ran alone
# (its batch was retried one request at a time): it would fail any worker's batch, so the
# gateway fails it instead of moving it.
POISON_REQUEST = "poison_request"

# The box's KV tier (worker/kv_tier/), reported by a worker that has it on: blocks loaded
# from it, lookups that found no (or a bad) block, bytes read and written, blocks evicted to
# keep its bound, and the time spent reading and verifying blocks.
KV_TIER_COUNTER_NAMES = ("kv_tier_hits", "kv_tier_misses", "kv_tier_read_bytes",
                         "kv_tier_written_bytes", "kv_tier_evictions",
                         "kv_tier_load_microseconds")
# Heartbeat.counters a worker reports (others are ignored): prompt tokens looked up in the
# prefix cache and found there (at each request's first admission), sequences preempted, and
# speculative decoding's verified drafts, their tokens and the accepted ones.
COUNTER_NAMES = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                 "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens", *KV_TIER_COUNTER_NAMES)
# ... and the accepted drafts at each position of a proposal: this prefix + the position
# (0, 1, ...: at most worker.speculative.MAX_SPECULATIVE_TOKENS of them).
SPEC_DECODE_PER_POS_COUNTER = "spec_decode_num_accepted_tokens_per_pos_"


@dataclass
class Message:
    TYPE: ClassVar[MsgType]
    # Field name -> accepted Python types after msgpack decoding. Checked on decode.
    SCHEMA: ClassVar[dict[str, tuple[type, ...]]]


_INT = (int,)
_STR = (str,)
_FLOAT = (float, int)
_OPT_STR = (str, type(None))
_OPT_INT = (int, type(None))
_LIST = (list,)
_DICT = (dict,)
_BOOL = (bool,)
_MAX_U32 = 2**32
MAX_COUNTERS = 32  # named counters one HEARTBEAT may carry


def _is_duration(value: Any, max_s: float = 1e9) -> bool:
    """A number of seconds: an int or float (not a bool), finite, in [0, max_s]."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and 0 <= value <= max_s)


@dataclass
class Hello(Message):
    """Worker -> gateway, once its model is loaded (and again after a reconnect)."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    SCHEMA: ClassVar = {
        "protocol_version": _INT, "worker_id": _STR, "model": _STR, "max_model_len": _INT,
        "num_kv_blocks": _INT, "block_size": _INT, "max_num_seqs": _INT, "device": _STR,
        "pid": _INT, "startup_phases": _DICT, "served_model_name": _STR, "model_version": _STR,
        "kv_tier": _STR, "kv_tier_num_blocks": _INT,
    }
    protocol_version: int
    worker_id: str
    model: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    device: str
    pid: int
    # Seconds each start-up phase took (e.g. {"load_weights": 0.4, "kv_cache": 0.1}).
    startup_phases: dict[str, float] = field(default_factory=dict)
    # The name clients use for this worker's model and its version label (a worker of
    # `--served-model-name smollm --model-version v2`). "" (an older worker, or none given):
    # the gateway's default model, version "".
    served_model_name: str = ""
    model_version: str = ""
    # The box's KV tier it reads and writes (worker/kv_tier/), "" with none: workers that
    # name the same one load each other's blocks (one folder, one model key), so routing
    # counts a prefix any of them computed as cheap on all of them. Its capacity in blocks.
    kv_tier: str = ""
    kv_tier_num_blocks: int = 0

    def validate(self) -> None:
        # A peer's claims feed routing and context checks: absurd values are refused here.
        ranges = {"max_model_len": (1, 2**24), "num_kv_blocks": (1, 2**32),
                  "block_size": (1, 4096), "max_num_seqs": (1, 2**20), "pid": (0, 2**32)}
        for name, (lo, hi) in ranges.items():
            if not lo <= getattr(self, name) <= hi:
                raise ProtocolError(f"Hello.{name} must be in [{lo}, {hi}]")
        for name in ("worker_id", "model", "device"):
            if not 0 < len(getattr(self, name)) <= MAX_NAME_CHARS:
                raise ProtocolError(f"Hello.{name} must have 1 to {MAX_NAME_CHARS} characters")
        if not 0 <= self.kv_tier_num_blocks <= 2**40:
            raise ProtocolError("Hello.kv_tier_num_blocks must be in [0, 2**40]")
        for name in ("served_model_name", "model_version", "kv_tier"):
            if len(getattr(self, name)) > MAX_NAME_CHARS:
                raise ProtocolError(f"Hello.{name} must have at most {MAX_NAME_CHARS} characters")
        phases = self.startup_phases
        if len(phases) > 32 or not all(
                isinstance(k, str) and len(k) <= 64 and _is_duration(v, math.inf)
                for k, v in phases.items()):
            raise ProtocolError("Hello.startup_phases must map up to 32 names to seconds")


@dataclass
class Ready(Message):
    """Gateway -> worker, the answer to HELLO. A refused worker exits with the reason."""

    TYPE: ClassVar[MsgType] = MsgType.READY
    SCHEMA: ClassVar = {"accepted": _BOOL, "reason": _STR, "heartbeat_interval_s": _FLOAT,
                        "gateway_id": _STR}
    accepted: bool
    reason: str = ""
    heartbeat_interval_s: float = 1.0
    # Random per gateway process: a worker that sees another one knows the gateway restarted
    # and that nobody reads its old streams any more.
    gateway_id: str = ""


@dataclass
class Submit(Message):
    """Gateway -> worker: start generating. `params` holds SamplingParams fields by name."""

    TYPE: ClassVar[MsgType] = MsgType.SUBMIT
    SCHEMA: ClassVar = {"request_id": _STR, "prompt_token_ids": _LIST, "params": _DICT,
                        "credit": _INT, "output_token_ids": _LIST,
                        "grammar": (list, type(None)), "attempt": _INT, "priority": _INT,
                        "flow": _INT}
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    credit: int  # initial credit limit: output tokens the worker may send before CREDIT
    # A stream moving from another worker (failover): the output tokens it already produced.
    # The worker continues after them as if it had generated them itself (same counts,
    # penalties and seeded sampling), so the continuation is exact.
    output_token_ids: list[int] = field(default_factory=list)
    # Constrained decoding: [kind, source] with kind one of GRAMMAR_KINDS (a JSON schema as
    # JSON text, a Lark grammar in llguidance's dialect, or a regex); None: unconstrained.
    grammar: list[str] | None = None
    # Which submission of this request this is (1, 2, ... per gateway request id): every
    # output of it echoes the number, and only the stream's current attempt counts.
    attempt: int = 1
    # Lower is served first (vLLM's convention): the request's class relative to the
    # gateway's default class (critical -1, standard 0, sheddable 1 by default). The worker
    # admits by it and preempts the worst first (worker/priority_policy.py). Left off the
    # wire at 0, so a SUBMIT of the default class is the one of protocol 3 before it.
    priority: int = 0
    # The client it serves (an API key, or an address without keys) as a 32-bit hash the
    # gateway makes, 0 for none: the worker shares a full batch's slots fairly across flows
    # of one priority (worker/priority_policy.py). Left off the wire at 0.
    flow: int = 0

    def to_wire(self) -> list:
        # By hand, in declaration order (fields() costs more than the rest: one per request).
        body = [self.request_id, self.prompt_token_ids, self.params, self.credit,
                self.output_token_ids, self.grammar, self.attempt, self.priority, self.flow]
        if self.flow:
            return body
        return body[:-1] if self.priority else body[:-2]  # trailing defaults stay off

    def validate(self) -> None:
        if not 1 <= self.attempt < _MAX_U32:
            raise ProtocolError("attempt must be in [1, 2^32)")
        if not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ProtocolError(f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
        if not 0 <= self.flow <= MAX_FLOW:
            raise ProtocolError("flow must be in [0, 2^32)")
        for ids in (self.prompt_token_ids, self.output_token_ids):
            if not all(type(t) is int and 0 <= t < _MAX_U32 for t in ids):
                raise ProtocolError("token ids must be non-negative 32-bit ints")
        if not 1 <= self.credit < _MAX_U32:
            raise ProtocolError("credit must be in [1, 2^32)")
        g = self.grammar
        if g is not None and not (
                len(g) == 2 and g[0] in GRAMMAR_KINDS and isinstance(g[1], str)
                and 0 < len(g[1]) <= MAX_GRAMMAR_CHARS):
            raise ProtocolError(f"grammar must be [kind, source] with kind in {GRAMMAR_KINDS} "
                                f"and 1 to {MAX_GRAMMAR_CHARS} characters")


@dataclass
class Abort(Message):
    """Gateway -> worker: drop these requests now and free their KV blocks. `attempts`, when
    given, names each one's attempt (same order): the worker ignores an abort of an attempt
    it no longer runs, so a late ABORT of attempt 1 never ends attempt 2."""

    TYPE: ClassVar[MsgType] = MsgType.ABORT
    SCHEMA: ClassVar = {"request_ids": _LIST, "attempts": _LIST}
    request_ids: list[str]
    attempts: list[int] = field(default_factory=list)  # [] or 0: whatever attempt it runs

    def validate(self) -> None:
        if not all(isinstance(r, str) for r in self.request_ids):
            raise ProtocolError("request_ids must be strings")
        if self.attempts and (len(self.attempts) != len(self.request_ids) or not all(
                type(a) is int and 0 <= a < _MAX_U32 for a in self.attempts)):
            raise ProtocolError("attempts must be one attempt in [0, 2^32) per request id")


@dataclass
class Credit(Message):
    """Gateway -> worker: new credit limits. Each grant says "you may have sent up to `limit`
    output tokens of this stream in all". Limits are cumulative (a high-water mark), so a lost
    or repeated CREDIT is healed by the next one and never grants twice."""

    TYPE: ClassVar[MsgType] = MsgType.CREDIT
    SCHEMA: ClassVar = {"grants": _LIST}
    grants: list[list]  # [[request_id, limit, attempt], ...] (attempt optional: any)

    def validate(self) -> None:
        for g in self.grants:
            if not (isinstance(g, list) and len(g) in (2, 3) and isinstance(g[0], str)
                    and type(g[1]) is int and 0 < g[1] < _MAX_U32
                    and (len(g) == 2 or (type(g[2]) is int and 0 < g[2] < _MAX_U32))):
                raise ProtocolError("grants must be [request_id, 0 < limit < 2^32, attempt]")


@dataclass
class TokenOutput:
    """One stream's news from one engine step (an element of Tokens.outputs)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # one of FINISH_REASONS, or None while running
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    # Per new token: [logprob, [[token_id, logprob], ...]] when logprobs were asked for.
    logprobs: list | None = None
    error: str | None = None
    # On the output that carries a stream's first token from this worker: [seconds it waited
    # in the worker's queue, seconds from its first scheduling to that token (the prefill)].
    # Durations, not timestamps, so the gateway needs no shared clock.
    timings: list | None = None
    # Once, on a stream's first output, when SamplingParams.prompt_logprobs was set: per
    # prompt token after the first, [logprob, [[token_id, logprob], ...]] as in `logprobs`.
    prompt_logprobs: list | None = None
    # The SUBMIT attempt this output belongs to (Submit.attempt); 0: none named, which the
    # gateway never takes for a stream's current attempt.
    attempt: int = 0
    # With finish "error": a machine-readable reason (POISON_REQUEST), or None. Sent only
    # when set (an 11-item row otherwise).
    error_code: str | None = None

    def to_wire(self) -> list:
        row = [
            self.request_id, self.new_token_ids, self.finish_reason, self.num_prompt_tokens,
            self.num_output_tokens, self.num_cached_tokens, self.logprobs, self.error,
            self.timings, self.prompt_logprobs, self.attempt,
        ]
        if self.error_code is not None:
            row.append(self.error_code)
        return row

    @staticmethod
    def wire_row(request_id: str, new_token_ids: list[int], finish_reason: str | None,
                 num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0,
                 logprobs: list | None = None, error: str | None = None,
                 timings: list | None = None, prompt_logprobs: list | None = None,
                 attempt: int = 0, error_code: str | None = None) -> list:
        """What to_wire() gives, without the object: a worker emits one per stream per step,
        and the dataclass cost ~1.6 us of each (Tokens takes either form)."""
        if error_code is not None:
            return [request_id, new_token_ids, finish_reason, num_prompt_tokens,
                    num_output_tokens, num_cached_tokens, logprobs, error, timings,
                    prompt_logprobs, attempt, error_code]
        return [request_id, new_token_ids, finish_reason, num_prompt_tokens, num_output_tokens,
                num_cached_tokens, logprobs, error, timings, prompt_logprobs, attempt]

    @classmethod
    def from_wire(cls, item: Any) -> TokenOutput:
        # Once per stream per engine step in the gateway's receive loop, so the usual row (11
        # items: a running stream's tokens, nothing optional) is checked in one chained test.
        # It returns only what the full checks below would accept, built the same way;
        # anything else, good or bad, goes through them.
        if type(item) is list and len(item) == 11:
            (request_id, token_ids, finish_reason, num_prompt, num_output, num_cached,
             logprobs, error, timings, prompt_logprobs, attempt) = item
            if (finish_reason is logprobs is error is timings is prompt_logprobs is None
                    and type(request_id) is str and type(token_ids) is list
                    and type(num_prompt) is int and type(num_output) is int
                    and type(num_cached) is int and type(attempt) is int
                    and num_prompt >= 0 and num_output >= 0 and num_cached >= 0
                    and 0 <= attempt < _MAX_U32):
                for t in token_ids:
                    if type(t) is not int:
                        break
                else:
                    return cls(*item)
        return cls._from_wire_checked(item)

    @classmethod
    def _from_wire_checked(cls, item: Any) -> TokenOutput:
        if not isinstance(item, list) or not 8 <= len(item) <= 12:
            raise ProtocolError("token output must be an 8- to 12-item array")
        out = cls(*item)
        if not isinstance(out.request_id, str) or not isinstance(out.new_token_ids, list):
            raise ProtocolError("bad token output")
        # Loops and chained tests, not all() over generators: this runs once per stream per
        # engine step in the gateway's receive loop.
        for t in out.new_token_ids:
            if type(t) is not int:
                raise ProtocolError("new_token_ids must be ints")
        if out.finish_reason is not None and (
            not isinstance(out.finish_reason, str) or out.finish_reason not in FINISH_REASONS
        ):
            raise ProtocolError(f"unknown finish reason {out.finish_reason!r}")
        num_prompt, num_output, num_cached, attempt = (
            out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens, out.attempt)
        if not (type(num_prompt) is int and type(num_output) is int and type(num_cached) is int
                and type(attempt) is int and num_prompt >= 0 and num_output >= 0
                and num_cached >= 0 and 0 <= attempt < _MAX_U32):
            raise ProtocolError("token counts and the attempt must be non-negative ints")
        if not isinstance(out.logprobs, (list, type(None))) or not isinstance(
                out.prompt_logprobs, (list, type(None))):
            raise ProtocolError("logprobs and prompt_logprobs must be arrays or nil")
        if (out.error is not None or out.error_code is not None) and not (
                isinstance(out.error, (str, type(None)))
                and (out.error_code is None
                     or (isinstance(out.error_code, str) and len(out.error_code) <= 64))):
            raise ProtocolError("error and error_code must be strings or nil")
        if out.timings is not None and not (
                isinstance(out.timings, list) and len(out.timings) == 2
                and all(_is_duration(t) for t in out.timings)):
            raise ProtocolError("timings must be nil or [queue_s, prefill_s]")
        return out


@dataclass
class Tokens(Message):
    """Worker -> gateway over PUSH: every stream's new tokens from one engine step."""

    TYPE: ClassVar[MsgType] = MsgType.TOKENS
    SCHEMA: ClassVar = {"worker_id": _STR, "step": _INT, "outputs": _LIST, "seq": _INT}
    worker_id: str
    step: int
    outputs: list[TokenOutput] = field(default_factory=list)
    # TOKENS messages this worker process has sent this gateway, this one included (1, 2,
    # ...): heartbeats name the last one (Heartbeat.tokens_seq), so the gateway can tell a
    # final output still queued on its PULL socket from one that was lost. 0: not counted.
    seq: int = 0

    def to_wire(self) -> list:
        # Built by hand: astuple deep-copies, which costs ~25 us a stream at every step.
        # Outputs already in wire form (TokenOutput.wire_row) go as they are.
        return [self.worker_id, self.step,
                [o if type(o) is list else o.to_wire() for o in self.outputs], self.seq]

    def validate(self) -> None:
        if len(self.outputs) > MAX_OUTPUTS_PER_STEP:
            raise ProtocolError(f"more than {MAX_OUTPUTS_PER_STEP} outputs in one TOKENS")
        from_wire = TokenOutput.from_wire
        self.outputs = [from_wire(o) for o in self.outputs]


@dataclass
class Heartbeat(Message):
    """Both ways. From a worker it carries its load, its progress and the requests it holds
    (so the gateway can reconcile); from the gateway the counts are 0 and `gateway_id` says
    which gateway process is speaking."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    SCHEMA: ClassVar = {
        "worker_id": _STR, "state": _STR, "num_running": _INT, "num_waiting": _INT,
        "num_paused": _INT, "num_free_blocks": _INT, "num_total_blocks": _INT,
        "time": _FLOAT, "gateway_id": _STR, "num_steps": _INT, "progress_age_s": _FLOAT,
        "request_ids": _LIST, "request_ids_age_s": _FLOAT, "counters": _DICT,
        "request_attempts": _LIST, "tokens_seq": _INT,
    }
    worker_id: str
    state: str = WorkerState.READY.value
    num_running: int = 0
    num_waiting: int = 0
    num_paused: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    time: float = 0.0
    gateway_id: str = ""  # gateway -> worker only
    num_steps: int = 0  # engine steps run so far
    # Seconds since the engine thread last finished a loop iteration while it had work:
    # grows without bound only when the engine is stuck.
    progress_age_s: float = 0.0
    # The requests the worker holds, as of `request_ids_age_s` seconds ago (the engine
    # thread takes the snapshot; the I/O thread sends it).
    request_ids: list[str] = field(default_factory=list)
    request_ids_age_s: float = 0.0
    # The worker process's cumulative counters since it started, by name (see
    # COUNTER_NAMES); they start again from 0 in a new process, which the gateway sees by the
    # new route and so keeps its own totals monotonic.
    counters: dict[str, int] = field(default_factory=dict)
    # The attempt of each of `request_ids` (same order; [] : not named), and the seq of the
    # last TOKENS message sent to this gateway when the snapshot was taken: every output of
    # a request missing from the snapshot left in that message or an earlier one.
    request_attempts: list[int] = field(default_factory=list)
    tokens_seq: int = 0

    def validate(self) -> None:
        if not all(isinstance(r, str) for r in self.request_ids):
            raise ProtocolError("request_ids must be strings")
        if self.request_attempts and (
                len(self.request_attempts) != len(self.request_ids) or not all(
                    type(a) is int and 0 < a < _MAX_U32 for a in self.request_attempts)):
            raise ProtocolError("request_attempts must be one attempt per request id")
        if len(self.counters) > MAX_COUNTERS or not all(
                isinstance(k, str) and len(k) <= 64 and type(v) is int and 0 <= v < 2**63
                for k, v in self.counters.items()):
            raise ProtocolError(f"counters must map up to {MAX_COUNTERS} names to counts")
        counts = (self.num_running, self.num_waiting, self.num_paused, self.num_free_blocks,
                  self.num_total_blocks, self.num_steps, self.tokens_seq)
        if not all(0 <= n < 2**63 for n in counts):
            raise ProtocolError("heartbeat counts must be non-negative 64-bit ints")
        ages = (self.progress_age_s, self.request_ids_age_s)
        if not all(math.isfinite(a) and a >= 0 for a in ages):
            raise ProtocolError("heartbeat ages must be finite and >= 0")


@dataclass
class Drain(Message):
    """Gateway -> worker: take no new work; streams still running at deadline_s are handed
    back (finish reason "abort", so the gateway moves them to another worker); then exit 0
    if `exit_when_drained` (a restart), else stay idle until UNDRAIN. Worker -> gateway: I am
    draining (route nothing new here)."""

    TYPE: ClassVar[MsgType] = MsgType.DRAIN
    SCHEMA: ClassVar = {"worker_id": _STR, "deadline_s": _FLOAT, "exit_when_drained": _BOOL}
    worker_id: str
    deadline_s: float = 30.0
    exit_when_drained: bool = True

    def validate(self) -> None:
        if not (math.isfinite(self.deadline_s) and 0 <= self.deadline_s <= 86_400):
            raise ProtocolError("deadline_s must be in [0, 86400]")


@dataclass
class Undrain(Message):
    """Gateway -> worker: a drain without exit is over; take new work again."""

    TYPE: ClassVar[MsgType] = MsgType.UNDRAIN
    SCHEMA: ClassVar = {"worker_id": _STR}
    worker_id: str


@dataclass
class Error(Message):
    """Either way: a failure not tied to one stream's tokens (those travel in TOKENS)."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    SCHEMA: ClassVar = {"request_id": _OPT_STR, "code": _STR, "message": _STR,
                        "attempt": _INT}
    request_id: str | None
    code: str
    message: str
    attempt: int = 0  # the request's attempt, when it names one (0: none)


@dataclass
class Shutdown(Message):
    """Gateway -> worker: exit now (after freeing everything)."""

    TYPE: ClassVar[MsgType] = MsgType.SHUTDOWN
    SCHEMA: ClassVar = {"reason": _STR}
    reason: str = ""


# A live look inside a worker (common/introspection.py): what DEBUG_REQUEST may ask for.
DEBUG_KINDS = ("stacks", "profile", "memory", "torch_profile")
# Why a DEBUG_REPLY carries no result: busy (a profile runs already: the gateway's 409),
# bad_args (400), failed (the worker could not do it), unavailable (e.g. no torch profiler).
DEBUG_ERROR_CODES = ("busy", "bad_args", "failed", "unavailable", "timeout")
MAX_DEBUG_TOKEN_CHARS = 64
MAX_DEBUG_ARGS = 16
# A reply's encoded body stays below this (the worker cuts or refuses a bigger answer).
MAX_DEBUG_REPLY_BYTES = 12 * 1024 * 1024


@dataclass
class DebugRequest(Message):
    """Gateway -> worker: look inside the process (stacks, a CPU or torch profile, memory).
    `token` pairs the reply with the request; `args` are the kind's arguments by name
    (numbers and strings only; the worker checks their ranges again)."""

    TYPE: ClassVar[MsgType] = MsgType.DEBUG_REQUEST
    SCHEMA: ClassVar = {"token": _STR, "kind": _STR, "args": _DICT}
    token: str
    kind: str
    args: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if not 0 < len(self.token) <= MAX_DEBUG_TOKEN_CHARS:
            raise ProtocolError(f"token must have 1 to {MAX_DEBUG_TOKEN_CHARS} characters")
        if self.kind not in DEBUG_KINDS:
            raise ProtocolError(f"kind must be one of {DEBUG_KINDS}")
        if len(self.args) > MAX_DEBUG_ARGS or not all(
                isinstance(k, str) and len(k) <= 64 and (
                    isinstance(v, (int, float, bool, type(None)))
                    or (isinstance(v, str) and len(v) <= 4096))
                for k, v in self.args.items()):
            raise ProtocolError(f"args must map up to {MAX_DEBUG_ARGS} names to scalars")


@dataclass
class DebugReply(Message):
    """Worker -> gateway: the answer to the DEBUG_REQUEST with the same `token`: `result`
    (the kind's answer) when `ok`, else `error` and its `code` (one of DEBUG_ERROR_CODES)."""

    TYPE: ClassVar[MsgType] = MsgType.DEBUG_REPLY
    SCHEMA: ClassVar = {"token": _STR, "ok": _BOOL, "result": _DICT, "error": _STR,
                        "code": _STR}
    token: str
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    code: str = ""

    def validate(self) -> None:
        if not 0 < len(self.token) <= MAX_DEBUG_TOKEN_CHARS:
            raise ProtocolError(f"token must have 1 to {MAX_DEBUG_TOKEN_CHARS} characters")
        if not self.ok and self.code not in DEBUG_ERROR_CODES:
            raise ProtocolError(f"a failed reply's code must be one of {DEBUG_ERROR_CODES}")
        if len(self.error) > 4096:
            raise ProtocolError("error must have at most 4096 characters")


MESSAGE_CLASSES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Ready, Submit, Abort, Credit, Tokens, Heartbeat, Drain, Error, Shutdown,
                Undrain, DebugRequest, DebugReply)
}


# Per message class: its field names in declaration order and how many have no default
# (fields() per message cost as much as the checks of a small one).
_FIELDS: dict[type[Message], tuple[tuple[str, ...], int]] = {
    cls: (tuple(f.name for f in fields(cls)),
          sum(1 for f in fields(cls) if f.default is f.default_factory is _MISSING))
    for cls in MESSAGE_CLASSES.values()
}


def encode(msg: Message) -> list[bytes]:
    """Message -> [type frame, body frame]."""
    if isinstance(msg, Tokens | Submit):
        body = msg.to_wire()
    else:
        body = [getattr(msg, f.name) for f in fields(msg)]
    return [bytes([msg.TYPE]), msgpack.packb(body, use_bin_type=True)]


def decode(frames: list[bytes]) -> Message:
    """[type frame, body frame] -> Message, or ProtocolError. Never anything else."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames, got {len(frames)}")
    type_frame, body = frames
    if len(type_frame) != 1:
        raise ProtocolError("type frame must be one byte")
    try:
        cls = MESSAGE_CLASSES[MsgType(type_frame[0])]
    except ValueError:
        raise ProtocolError(f"unknown message type {type_frame[0]}") from None
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{cls.__name__} body of {len(body)} bytes exceeds the limit")
    try:
        values = msgpack.unpackb(
            body, raw=False, strict_map_key=True, max_array_len=MAX_LIST_ITEMS,
            max_map_len=1024, max_str_len=MAX_FRAME_BYTES, max_bin_len=MAX_FRAME_BYTES,
        )
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"{cls.__name__}: undecodable body: {e}") from None
    if not isinstance(values, list):
        raise ProtocolError(f"{cls.__name__}: body must be an array")
    names, required = _FIELDS[cls]
    if not required <= len(values) <= len(names):
        raise ProtocolError(f"{cls.__name__}: expected {len(names)} fields, got {len(values)}")
    for name, value in zip(names, values, strict=False):
        accepted = cls.SCHEMA[name]
        # bool is an int subclass; keep them apart so True never passes as a count.
        if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
            raise ProtocolError(f"{cls.__name__}.{name}: unexpected {type(value).__name__}")
    msg = cls(*values)
    validate = getattr(msg, "validate", None)
    if validate is not None:
        validate()
    return msg

