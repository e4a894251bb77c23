"""Nothing waits on a lost message: the gateway's side of reconciliation with its workers.

Any SUBMIT, ABORT, CREDIT or TOKENS message may be lost (a peer that stalled past a queue
limit, a connection that broke and came back). Each loss shows in one of three ways:

- A worker's heartbeat lists the requests it holds with their attempts
  (`Heartbeat.request_ids`, `request_attempts`, a snapshot `request_ids_age_s` old). One it
  holds that we did not route to it, or in another attempt than the stream's current one
  (a lost ABORT, an old gateway's stream) is aborted again, that attempt only. One we
  routed to it that it does not list, although the SUBMIT left before the snapshot was
  taken (a lost SUBMIT, a lost final TOKENS), is lost: it continues on a worker (the
  gateway's failover). "Missing" is judged only against outputs we have processed: tokens
  travel on another socket than heartbeats, so a heartbeat can overtake a backlog of
  TOKENS. The snapshot names the last TOKENS message sent before it
  (`Heartbeat.tokens_seq`); until we have processed that one (`WorkerHandle.tokens_seq`),
  a missing request's final output may still be queued here and we wait, unless nothing
  from the worker has arrived for `MISSING_GRACE_S` (then what it names was lost). Even
  then it must be missing for `MISSING_GRACE_S` before it counts as lost.
- Every TokenOutput carries the stream's total output count, so a gap (lost TOKENS) or a
  repeat shows: `check_token_counts`.
- A stream that has credit but receives nothing for a while gets its credit limit sent
  again (limits are cumulative: a lost CREDIT is healed, a repeated one is harmless); past
  `idle_timeout_s` it fails with a clear error and its worker is told to abort it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from zeroserve.common.protocol import Heartbeat, TokenOutput
from zeroserve.gateway.streams import RequestPhase, RequestState, StreamTable, WorkerOutbox
from zeroserve.gateway.workers.handle import WorkerHandle

# A SUBMIT sent this long before a worker's snapshot must be in it (transit allowance), and a
# request must be missing from the reports for this long before it counts as lost.
MISSING_GRACE_S = 1.0
# An idle stream with credit gets its credit limit re-sent this often.
CREDIT_RESEND_S = 2.0


class TokenCheck(enum.Enum):
    OK = "ok"
    DUPLICATE = "duplicate"  # every token in it was delivered already: drop it
    GAP = "gap"  # tokens before it never arrived
    OVER_LIMIT = "over_limit"  # beyond the credit granted or max_tokens: the excess dropped


# The members under module names for the per-output path: on Python 3.11 reading a member off
# its enum class goes through EnumType's __getattr__ hook, ~0.3 us a read, and the receive
# loop made four of them per stream per engine step (one here, three in Gateway._on_tokens).
_OK, _DUPLICATE, _GAP, _OVER_LIMIT = (TokenCheck.OK, TokenCheck.DUPLICATE, TokenCheck.GAP,
                                      TokenCheck.OVER_LIMIT)
TOKENS_OK = _OK  # what Gateway._on_tokens compares with first


def check_token_counts(state: RequestState, out: TokenOutput) -> TokenCheck:
    """Compare a TokenOutput's running count with what this stream received. A partial
    overlap is trimmed in place to the tokens not seen yet, and so is anything beyond the
    stream's credit limit or max_tokens (an honest worker never sends that)."""
    # Once per stream per engine step: plain reads (no credit_limit property, no dict built
    # for a request without params) and the members by their module names (_OK ...).
    num_new = len(out.new_token_ids)
    received = state.num_received
    first = out.num_output_tokens - num_new  # index of its first new token
    if first != received:
        if first > received:
            return _GAP
        seen = received - first
        if seen >= num_new and out.finish_reason is None:
            return _DUPLICATE
        _keep(out, seen, num_new)
        num_new = len(out.new_token_ids)
    limit = state.num_credited + state.credit_window  # state.credit_limit
    params = state.params
    if params:
        max_tokens = params.get("max_tokens", limit)
        if max_tokens < limit:
            limit = max_tokens
    room = limit - received
    if num_new > room:
        _keep(out, 0, max(room, 0))
        return _OVER_LIMIT
    return _OK


def _keep(out: TokenOutput, start: int, end: int) -> None:
    out.new_token_ids = out.new_token_ids[start:end]
    if out.logprobs is not None:
        out.logprobs = out.logprobs[start:end]


class Reconciler:
    def __init__(self, streams: StreamTable, outbox: WorkerOutbox,
                 on_lost: Callable[[RequestState, str], None],
                 on_idle: Callable[[RequestState, float], None], idle_timeout_s: float):
        self.streams = streams
        self.outbox = outbox
        self.on_lost = on_lost  # the request is gone from its worker: retry or fail it
        self.on_idle = on_idle  # no output for idle_timeout_s: fail it
        self.idle_timeout_s = idle_timeout_s

    def on_worker_report(self, worker: WorkerHandle, report: Heartbeat, now: float) -> None:
        """A heartbeat from `worker` lists the requests it holds (a snapshot)."""
        # request id -> its attempt there (0: not named, taken as the current one)
        held = dict(zip(report.request_ids, report.request_attempts or
                        [0] * len(report.request_ids), strict=True))
        for request_id, attempt in held.items():
            state = self.streams.get(request_id)
            if state is None or state.worker_id != worker.worker_id or (
                    attempt and attempt != state.attempt):
                self.outbox.abort(worker.worker_id, request_id, attempt)  # nobody reads it
        submitted_before = now - report.request_ids_age_s - MISSING_GRACE_S
        # Outputs the worker had sent when it took the snapshot and we have not processed
        # (a backlog on our TOKENS socket), unless they stopped coming a while ago (lost).
        is_behind = (report.tokens_seq > worker.tokens_seq
                     and now - worker.tokens_seq_at < MISSING_GRACE_S)
        for request_id in list(worker.request_ids):
            state = self.streams.get(request_id)
            if state is None or state.phase is not RequestPhase.RUNNING:
                continue
            attempt = held.get(request_id)
            if attempt in (0, state.attempt) or state.submitted_at > submitted_before \
                    or is_behind:
                state.missing_since = None
            elif state.missing_since is None:
                state.missing_since = now
            elif now - state.missing_since >= MISSING_GRACE_S:
                self.on_lost(state, f"worker {worker.worker_id} no longer holds it")

    def check_idle(self, now: float) -> None:
        """Streams with credit and no news: re-send their credit; past the deadline, fail."""
        for state in list(self.streams.states.values()):
            if state.phase is not RequestPhase.RUNNING or state.num_undelivered > 0:
                continue  # not on a worker, or the client holds tokens (the SSE watchdog's)
            idle_s = now - state.last_activity
            if idle_s > self.idle_timeout_s:
                self.on_idle(state, idle_s)
            elif idle_s > CREDIT_RESEND_S and now - state.credit_resent_at > CREDIT_RESEND_S:
                state.credit_resent_at = now
                self.outbox.resend(state)
