"""Worker registry: who is connected, how loaded, who is alive; and routing.

A worker says HELLO once its model is loaded (and again after reconnecting); we answer
READY and from then on expect a HEARTBEAT every interval. A worker silent for
`worker_timeout_s` is lost, and so is one whose process its supervisor saw exit (a notice
naming the worker id and its pid: `remove_exited`). A HELLO from a known id replaces the
old incarnation (its requests are gone with it); the core first refuses one while the old
incarnation's connection is still open (two live processes with one id). A worker that says
DRAIN gets nothing new, and neither does one whose heartbeats say its engine made no progress for `stall_timeout_s` (UNHEALTHY:
its I/O thread is alive, its engine thread is stuck); it is READY again once it moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroserve.common.protocol import KV_TIER_COUNTER_NAMES, Heartbeat, Hello, WorkerState
from zeroserve.gateway.config import RoutingPolicy
from zeroserve.gateway.workers.flow_load import Flow
from zeroserve.gateway.workers.handle import WorkerHandle, WorkerStatus
from zeroserve.gateway.workers.models import Target
from zeroserve.gateway.workers.prefix import Prefix, PrefixIndex
from zeroserve.gateway.workers.routing import Router


@dataclass(frozen=True)
class LostWorker:
    """A worker expired for silence (or whose process exited), remembered until its id says
    HELLO again, so that `serve`'s supervisor can see which process went silent and replace
    it."""

    worker_id: str
    pid: int
    lost_at: float
    reason: str = "no heartbeat"

    def describe(self, now: float) -> dict:
        return {"worker_id": self.worker_id, "pid": self.pid,
                "lost_s": round(max(0.0, now - self.lost_at), 3), "reason": self.reason}


_MAX_LOST = 1024  # lost workers remembered (ids come from accepted HELLOs)


class WorkerRegistry:
    def __init__(self, max_waiting_per_worker: int | None = None,
                 stall_timeout_s: float = 30.0,
                 routing: RoutingPolicy | str = RoutingPolicy.CACHE_AWARE):
        self.max_waiting_per_worker = max_waiting_per_worker
        self.stall_timeout_s = stall_timeout_s
        self.router = Router(routing)
        self.workers: dict[str, WorkerHandle] = {}
        self.lost: dict[str, LostWorker] = {}  # expired, not back yet
        self.last_max_model_len: int | None = None
        self._last_len_of: dict[str, int] = {}  # served model -> its last worker's limit

    def register(self, hello: Hello, route: bytes, now: float,
                 model: str = "") -> WorkerHandle | None:
        """Add a worker; return the incarnation it replaces (whose requests are lost).

        A HELLO repeated by the same process (same route: its READY got lost or was late,
        or it thought the gateway gone) is not a restart: the worker keeps its place and its
        requests. Every process picks a new route, so a restart shows even where every
        worker is pid 1 (containers).
        """
        self.lost.pop(hello.worker_id, None)
        old = self.workers.get(hello.worker_id)
        if old is not None and old.route == route:
            old.hello, old.last_seen, old.model = hello, now, model
            old.status = WorkerStatus.DRAINING if old.is_drain_requested else WorkerStatus.READY
            self.last_max_model_len = self._last_len_of[model] = hello.max_model_len
            return None
        self.workers.pop(hello.worker_id, None)
        max_waiting = (hello.max_num_seqs if self.max_waiting_per_worker is None
                       else self.max_waiting_per_worker)
        self.workers[hello.worker_id] = WorkerHandle(
            hello=hello, route=route, last_seen=now, tokens_seq_at=now, max_waiting=max_waiting,
            num_free_blocks=hello.num_kv_blocks, num_total_blocks=hello.num_kv_blocks,
            prefix_index=PrefixIndex(hello.num_kv_blocks), model=model)
        self.last_max_model_len = self._last_len_of[model] = hello.max_model_len
        return old

    def get(self, worker_id: str) -> WorkerHandle | None:
        return self.workers.get(worker_id)

    def on_heartbeat(self, hb: Heartbeat, now: float) -> WorkerHandle | None:
        worker = self.workers.get(hb.worker_id)
        if worker is None:
            return None
        worker.last_seen = now
        worker.num_running, worker.num_waiting = hb.num_running, hb.num_waiting
        worker.num_paused = hb.num_paused
        worker.num_free_blocks, worker.num_total_blocks = hb.num_free_blocks, hb.num_total_blocks
        worker.num_sent_since_heartbeat = 0
        worker.num_steps, worker.progress_age_s = hb.num_steps, hb.progress_age_s
        num_held = hb.num_running + hb.num_waiting + hb.num_paused
        worker.num_foreign = max(0, num_held - len(hb.request_ids))
        worker.kv_tier = {name.removeprefix("kv_tier_"): value
                          for name, value in hb.counters.items() if name in KV_TIER_COUNTER_NAMES}
        # The worker's own word decides (it publishes "draining" before it says DRAIN, so a
        # heartbeat never contradicts a DRAIN sent before it). An operator's drain sent from
        # here holds until the worker's heartbeats say "draining": a heartbeat it sent before
        # the DRAIN reached it must not undo the drain. From then on the worker's state is
        # the truth, so an undrain through any gateway of `serve --gateways N` (each sees
        # the worker's heartbeats) ends the drain in all of them.
        if hb.state == WorkerState.DRAINING.value:
            worker.is_drain_requested = False  # acknowledged
            worker.status = WorkerStatus.DRAINING
        elif worker.is_drain_requested:
            worker.status = WorkerStatus.DRAINING
        else:
            is_stalled = hb.progress_age_s > self.stall_timeout_s
            worker.status = WorkerStatus.UNHEALTHY if is_stalled else WorkerStatus.READY
        return worker

    def on_tokens(self, worker_id: str, seq: int, now: float) -> None:
        """A TOKENS message (number `seq` of its process) was processed: any message from a
        worker proves it alive."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_seen = now
            if seq > worker.tokens_seq:
                worker.tokens_seq, worker.tokens_seq_at = seq, now

    def mark_draining(self, worker_id: str) -> WorkerHandle | None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.status = WorkerStatus.DRAINING
        return worker

    def expire(self, now: float, timeout_s: float) -> list[WorkerHandle]:
        """Remove and return the workers silent for longer than timeout_s."""
        lost = [w for w in self.workers.values() if now - w.last_seen > timeout_s]
        for w in lost:
            self._lose(w, now, "no heartbeat")
        return lost

    def remove_exited(self, worker_id: str, pid: int, now: float,
                      reason: str) -> WorkerHandle | None:
        """The process `pid` of this worker exited (its supervisor reaped it: cli/
        supervisor.py): remove and return the worker if `pid` is the process registered
        under its id now. None otherwise: the id is unknown (lost already), or the notice is
        about an older incarnation, late, and must not remove its successor."""
        worker = self.workers.get(worker_id)
        if worker is None or worker.hello.pid != pid:
            return None
        self._lose(worker, now, reason)
        return worker

    def _lose(self, worker: WorkerHandle, now: float, reason: str) -> None:
        del self.workers[worker.worker_id]
        if len(self.lost) >= _MAX_LOST:
            self.lost.clear()
        self.lost[worker.worker_id] = LostWorker(worker.worker_id, worker.hello.pid, now, reason)

    def remove(self, worker_id: str) -> WorkerHandle | None:
        return self.workers.pop(worker_id, None)

    def pick(self, prefix: Prefix | None = None, target: Target | None = None,
             is_priority: bool = False, flow: Flow | None = None) -> WorkerHandle | None:
        """The worker for a request with this prompt (gateway/workers/routing.py: the one holding
        its prefix within a load bound, else the least loaded), among those of its target
        (model, version; None: any) that can take it; None if none can. Without a prompt:
        the least loaded. `is_priority`: a class above the default (WorkerHandle.
        can_accept_priority); `flow`: its class and client, for a full worker where that
        flow is behind (`pick_for_flow`) when no worker has room."""
        if is_priority:
            return self.router.pick([w for w in self.workers.values() if w.can_accept_priority
                                     and (target is None or target.matches(w.model,
                                                                           w.version))], prefix)
        if target is None:
            worker = self.router.pick([w for w in self.workers.values() if w.can_accept],
                                      prefix)
        else:
            worker = self.router.pick([w for w in self.workers.values()
                                       if w.can_accept and target.matches(w.model, w.version)],
                                      prefix)
        if worker is None and flow is not None:
            return self.pick_for_flow(prefix, target, flow)
        return worker

    def pick_for_flow(self, prefix: Prefix | None, target: Target | None,
                      flow: Flow) -> WorkerHandle | None:
        """Among `target`'s workers, one where `flow` is behind (WorkerHandle.can_accept_flow):
        it starts there at once, in a slot of the flow holding the most."""
        return self.router.pick([w for w in self.workers.values() if w.can_accept_flow(flow)
                                 and (target is None or target.matches(w.model, w.version))],
                                prefix)

    def assign(self, worker: WorkerHandle, request_id: str,
               prefix: Prefix | None = None, flow: Flow | None = None) -> None:
        worker.request_ids.add(request_id)
        if flow is not None:
            worker.flows.add(request_id, flow)
        worker.num_sent_since_heartbeat += 1
        self.router.on_assigned(worker, prefix)

    def release(self, worker_id: str, request_id: str) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.request_ids.discard(request_id)
            worker.flows.discard(request_id)

    @property
    def num_live(self) -> int:
        return len(self.workers)

    @property
    def has_ready(self) -> bool:
        return any(w.status is WorkerStatus.READY for w in self.workers.values())

    def max_model_len(self, model: str | None = None) -> int | None:
        """The context limit live workers (of `model`, if given) enforce (the smallest), or
        the last one seen."""
        lens = [w.hello.max_model_len for w in self.workers.values()
                if model is None or w.model == model]
        if lens:
            return min(lens)
        return self.last_max_model_len if model is None else self._last_len_of.get(model)
