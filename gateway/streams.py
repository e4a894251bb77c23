"""Per-request state inside the gateway, and the batched outbox of credits and aborts.

One `RequestState` per engine request (an HTTP request with n choices has n). The receive
loop puts each TOKENS output, or a failure, on the request's sink queue; the HTTP handler
consumes it. Several choices of one HTTP request share one sink, so one task serves them.

Credit: the worker may have at most `credit_window` tokens of a stream sent and not
credited. The handler credits tokens once they reached the client socket (or, for
non-stream requests, once it consumed them); `WorkerOutbox` batches the grants of a short
window (`CREDIT_DELAY_S`) and the aborts of one event-loop iteration into one CREDIT (and
ABORT) message per worker. A grant is a cumulative limit ("you may have sent up to token
N"), so sending one again is harmless and a lost one is healed by the next.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from zeroserve.common.protocol import TokenOutput
from zeroserve.gateway.admission import Ticket
from zeroserve.gateway.errors import APIError
from zeroserve.gateway.workers.models import Target


class Sink:
    """A request group's inbox: the receive loop puts, the group's one handler task takes.

    A deque and one waiter future instead of an asyncio.Queue (its size limit, task
    counting, waiter deque and loop checks): with 1,000 streams the receive loop puts one
    item per stream per engine step, and the queue was ~14% of the gateway's CPU. Unbounded,
    as the queue was: what a stream may have in flight is bounded by its credit window. One
    consumer at a time, taking everything queued at once (`get_batch`).

    `direct`, when set, is offered each item that arrives while the consumer is parked with
    nothing queued; it returns True when it handled the item then and there (a streamed
    response writing it to its client from the receive loop: gateway/http/streaming.py), False to
    leave it to the consumer. Items stay in order: once one is queued, the rest queue behind
    it until the consumer has taken them.
    """

    __slots__ = ("_items", "_waiter", "direct", "_loop")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self.direct: Callable[[tuple], bool] | None = None
        # The consumer's loop, looked up once (on Python 3.11 each lookup is a getpid()).
        self._loop: asyncio.AbstractEventLoop | None = None

    def put_nowait(self, item) -> None:
        waiter = self._waiter
        if self.direct is not None and waiter is not None and not self._items \
                and not waiter.done() and self.direct(item):
            return
        self._items.append(item)
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def wake(self) -> None:
        """Let a parked consumer run with nothing new (something it checks has changed)."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get_batch(self) -> list:
        """Everything queued, waiting for at least one item or a `wake` (then maybe [])."""
        if not self._items:
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


class RequestPhase(enum.Enum):
    QUEUED = "queued"  # waiting in admission for a worker
    RUNNING = "running"  # submitted to a worker
    DONE = "done"  # finished, aborted or failed; removed from the table


@dataclass(eq=False)
class RequestState:
    request_id: str
    index: int  # choice index within its HTTP request
    prompt_token_ids: list[int]
    sink: Sink  # items: (RequestState, TokenOutput | APIError)
    phase: RequestPhase = RequestPhase.QUEUED
    worker_id: str | None = None
    num_received: int = 0  # tokens the worker sent us
    # Every output token received, so the stream can continue on another worker.
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens that reached the client (or were consumed), and the part of those given back
    # to the worker as credit: it lags by less than `credit_step` (see WorkerOutbox.grant).
    num_delivered: int = 0
    num_credited: int = 0
    params: dict | None = None  # as sent in SUBMIT (kept to resubmit elsewhere)
    num_submits: int = 0
    resubmit_task: asyncio.Task | None = None
    credit_window: int = 32
    # Monotonic times: the last SUBMIT, the last sign of life from the worker for this
    # request (a SUBMIT or tokens), the last re-sent credit, and since when the worker's
    # heartbeats have not listed it (reconciliation).
    submitted_at: float = 0.0
    last_activity: float = 0.0
    credit_resent_at: float = 0.0
    missing_since: float | None = None
    # The client's name for the conversation (prompt_cache_key, a session header): routing
    # keeps its requests on one worker where their prefixes tie (gateway/workers/routing.py).
    cache_key: str | None = None
    # The workers it may run on (gateway/workers/models.py): its model, and from its first
    # SUBMIT on the version of the worker that took it (failover stays on that pair).
    target: Target | None = None
    # Its priority class and client (gateway/admission.py): where it queues, and the
    # priority its SUBMITs carry; a failover keeps both. None: the default class.
    ticket: Ticket | None = None

    @property
    def attempt(self) -> int:
        """The current submission's number (Submit.attempt): every output of the stream
        names its attempt, and those of any other are stale (dropped and counted)."""
        return self.num_submits

    def deliver(self, item: TokenOutput | APIError) -> None:
        self.sink.put_nowait((self, item))

    @property
    def num_undelivered(self) -> int:
        """Tokens received and not yet on the client's socket."""
        return self.num_received - self.num_delivered

    @property
    def credit_step(self) -> int:
        return max(1, self.credit_window // 2)

    @property
    def credit_limit(self) -> int:
        """How many output tokens in all the worker may have sent us."""
        return self.num_credited + self.credit_window


@dataclass
class StreamTable:
    """request id -> state. Everything that ends a request goes through `remove`."""

    states: dict[str, RequestState] = field(default_factory=dict)

    def add(self, state: RequestState) -> None:
        if state.request_id in self.states:
            raise ValueError(f"duplicate request id {state.request_id}")
        self.states[state.request_id] = state

    def get(self, request_id: str) -> RequestState | None:
        return self.states.get(request_id)

    def remove(self, request_id: str) -> RequestState | None:
        state = self.states.pop(request_id, None)
        if state is not None:
            state.phase = RequestPhase.DONE
        return state

    def on_worker(self, worker_id: str) -> list[RequestState]:
        return [s for s in self.states.values() if s.worker_id == worker_id]

    def __len__(self) -> int:
        return len(self.states)


# Grants wait this long for company. One TOKENS message per engine step wakes every
# stream's handler, and they write (and grant) over several loop iterations; sent one
# iteration at a time that was ~4 CREDIT messages per step, each waking the worker's I/O
# thread, which then takes the GIL from the engine thread. A window far below a step (and
# far below the time a window of credit lasts) gathers them into one.
CREDIT_DELAY_S = 0.002


class WorkerOutbox:
    """Batches the small messages every stream produces (credit grants, aborts): one CREDIT
    and one ABORT per worker, however many streams moved. Aborts leave on the next loop
    iteration (a vanished client's KV blocks should free at once), taking any pending
    grants along; grants alone wait up to CREDIT_DELAY_S. Grants to a request aborted in the
    same batch are dropped."""

    def __init__(self, send_credit: Callable[[str, list[list]], None],
                 send_abort: Callable[[str, list[str], list[int]], None]):
        self._send_credit = send_credit  # (worker_id, [[request_id, limit, attempt], ...])
        self._send_abort = send_abort  # (worker_id, [request_id, ...], [attempt, ...])
        # worker id -> request id -> [limit, attempt]; worker id -> [(request id, attempt)]
        self._grants: dict[str, dict[str, list[int]]] = {}
        self._aborts: dict[str, list[tuple[str, int]]] = {}
        self._flush_soon: asyncio.Handle | None = None
        self._flush_later: asyncio.TimerHandle | None = None

    def grant(self, state: RequestState, n: int) -> None:
        """`n` more of the stream's tokens reached its client. Credit goes back in steps of
        half the window (as TCP acknowledges): the worker, allowed a whole window ahead,
        never waits for a step that is on its way, and a stream costs a CREDIT entry every
        `credit_step` tokens instead of every token (with 1,000 streams, 1,000 entries per
        engine step for the gateway to queue and the worker to apply)."""
        if n <= 0:
            return
        state.num_delivered += n
        # (state.credit_step without the property: once per output.)
        if state.num_delivered - state.num_credited >= (state.credit_window // 2 or 1):
            self.resend(state)

    def resend(self, state: RequestState) -> None:
        """Give back everything delivered and queue the stream's credit limit (again:
        limits are idempotent)."""
        if state.worker_id is None or state.phase is not RequestPhase.RUNNING:
            return
        state.num_credited = state.num_delivered
        self._grants.setdefault(state.worker_id, {})[state.request_id] = [
            state.credit_limit, state.attempt]
        if self._flush_later is None and self._flush_soon is None:
            self._flush_later = asyncio.get_running_loop().call_later(CREDIT_DELAY_S, self.flush)

    def abort(self, worker_id: str, request_id: str, attempt: int) -> None:
        """End attempt `attempt` of the request on the worker (0: whichever it runs)."""
        self._aborts.setdefault(worker_id, []).append((request_id, attempt))
        if self._flush_soon is None:
            self._flush_soon = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        for handle in (self._flush_soon, self._flush_later):
            if handle is not None:
                handle.cancel()
        self._flush_soon = self._flush_later = None
        grants, self._grants = self._grants, {}
        aborts, self._aborts = self._aborts, {}
        for worker_id, per_request in grants.items():
            dropped = set(aborts.get(worker_id, ()))
            triples = [[rid, limit, attempt] for rid, (limit, attempt) in per_request.items()
                       if (rid, attempt) not in dropped]
            if triples:
                self._send_credit(worker_id, triples)
        for worker_id, pairs in aborts.items():
            self._send_abort(worker_id, [rid for rid, _ in pairs],
                             [attempt for _, attempt in pairs])
