"""Nothing waits on a lost message: the gateway's side of reconciliation with its workers.

Any SUBMIT, ABORT, CREDIT or TOKENS message may be lost (a peer that stalled past a queue
limit, a connection that broke and came back). Each loss shows in one of three ways:

- A worker's heartbeat lists the requests it holds (`Heartbeat.request_ids`, a snapshot
  `request_ids_age_s` old). One it holds that we did not route to it (a lost ABORT, an old
  gateway's stream) is aborted again. One we routed to it that it does not list, although
  the SUBMIT left before the snapshot was taken (a lost SUBMIT, a lost final TOKENS), is
  lost: retried if the client saw nothing yet, else failed. It must be missing from the
  reports for `MISSING_GRACE_S`, so a final TOKENS message still on its way (tokens travel
  on another socket than heartbeats) is not mistaken for a loss.
- Every TokenOutput carries the stream's total output count, so a gap (lost TOKENS) or a
  repeat shows: `check_token_counts`.
- A stream that has credit but receives nothing for a while gets its credit limit sent
  again (limits are cumulative: a lost CREDIT is healed, a repeated one is harmless); past
  `idle_timeout_s` it fails with a clear error and its worker is told to abort it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable

from zeroserve.common.protocol import TokenOutput
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


def check_token_counts(state: RequestState, out: TokenOutput) -> TokenCheck:
    """Compare a TokenOutput's running count with what this stream received. A partial
    overlap is trimmed in place to the tokens not seen yet, and so is anything beyond the
    stream's credit limit or max_tokens (an honest worker never sends that)."""
    first = out.num_output_tokens - len(out.new_token_ids)  # index of its first new token
    if first > state.num_received:
        return TokenCheck.GAP
    if first < state.num_received:
        seen = state.num_received - first
        if seen >= len(out.new_token_ids) and out.finish_reason is None:
            return TokenCheck.DUPLICATE
        _keep(out, seen, len(out.new_token_ids))
    max_tokens = (state.params or {}).get("max_tokens", state.credit_limit)
    room = min(state.credit_limit, max_tokens) - state.num_received
    if len(out.new_token_ids) > room:
        _keep(out, 0, max(room, 0))
        return TokenCheck.OVER_LIMIT
    return TokenCheck.OK


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

    def on_worker_report(self, worker: WorkerHandle, held_ids: Iterable[str],
                         snapshot_age_s: float, now: float) -> None:
        """A heartbeat from `worker` says it holds `held_ids` (as of snapshot_age_s ago)."""
        held = set(held_ids)
        for request_id in held:
            state = self.streams.get(request_id)
            if state is None or state.worker_id != worker.worker_id:
                self.outbox.abort(worker.worker_id, request_id)  # nobody here reads it
        submitted_before = now - snapshot_age_s - MISSING_GRACE_S
        for request_id in list(worker.request_ids):
            state = self.streams.get(request_id)
            if state is None or state.phase is not RequestPhase.RUNNING:
                continue
            if request_id in held or state.submitted_at > submitted_before:
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
