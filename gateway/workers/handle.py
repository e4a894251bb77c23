"""One worker as this gateway sees it: its HELLO, its route (the process), its last reported
load, the requests this gateway has in flight there and the prompt blocks routed to it. The
registry owns the handles; routing, admission, metrics and health read them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from zeroserve.common.protocol import Hello, incarnation
from zeroserve.gateway.workers.flow_load import Flow, FlowLoad
from zeroserve.gateway.workers.prefix import PrefixIndex


class WorkerStatus(enum.Enum):
    READY = "ready"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"


@dataclass
class WorkerHandle:
    hello: Hello
    route: bytes  # the worker process's routing id (unique per process run)
    last_seen: float
    max_waiting: int  # requests it may hold beyond max_num_seqs
    status: WorkerStatus = WorkerStatus.READY
    # Last reported load.
    num_running: int = 0
    num_waiting: int = 0
    num_paused: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_steps: int = 0
    progress_age_s: float = 0.0
    # Requests the worker holds for other gateway processes (`serve --gateways N`): its
    # reported total less the ids it listed as ours. 0 behind a single gateway.
    num_foreign: int = 0
    # An operator drained it through this gateway and its heartbeats do not say so yet.
    is_drain_requested: bool = False
    # Requests routed here since its last heartbeat (not yet in the reported counts).
    num_sent_since_heartbeat: int = 0
    request_ids: set[str] = field(default_factory=set)  # in flight here, as we see it
    # Those of them with a flow (class and client), counted by it (gateway/workers/flow_load.py).
    flows: FlowLoad = field(default_factory=FlowLoad)
    # The highest TOKENS seq processed from this process, and when it last grew: a
    # heartbeat naming a higher one was sent while its outputs were still on their way.
    tokens_seq: int = 0
    tokens_seq_at: float = 0.0
    # The prompt blocks routed here, which its prefix cache likely holds (gateway/workers/routing.py).
    prefix_index: PrefixIndex = field(default_factory=lambda: PrefixIndex(1))
    # The served model it runs (the HELLO's name as this gateway calls it: "" -> the
    # default model) and its version label (gateway/workers/models.py).
    model: str = ""
    # The box's KV tier as its heartbeats last reported it (common/protocol.py's
    # KV_TIER_COUNTER_NAMES, without the prefix); empty with its tier off.
    kv_tier: dict[str, int] = field(default_factory=dict)

    @property
    def version(self) -> str:
        return self.hello.model_version

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    @property
    def capacity(self) -> int:
        return self.hello.max_num_seqs + self.max_waiting

    @property
    def incarnation(self) -> str:
        """A short name for this worker process (its route is a secret; this is not). A
        worker uses one route on all its gateways, so each of them names it alike."""
        return incarnation(self.route)

    @property
    def can_accept(self) -> bool:
        # Streams paused for credit hold KV blocks, not batch slots (the worker preempts
        # them when it needs the blocks), so they do not count against capacity.
        num_active = len(self.request_ids) + self.num_foreign - self.num_paused
        return self.status is WorkerStatus.READY and num_active < self.capacity

    @property
    def can_accept_priority(self) -> bool:
        """`can_accept` for a class above the default one: up to max_num_seqs more, so that
        it reaches the worker's queue, which admits it ahead of the lower classes and takes
        a full batch's slot from the worst of them (worker/priority_policy.py)."""
        num_active = len(self.request_ids) + self.num_foreign - self.num_paused
        return (self.status is WorkerStatus.READY
                and num_active < self.capacity + self.hello.max_num_seqs)

    def can_accept_flow(self, flow: Flow) -> bool:
        """`can_accept_priority` for a request whose flow holds at least 2 requests fewer here
        than its class's flow holding the most: the worker gives it a slot of that flow's
        (worker/priority_policy.py), so it need not wait for one to free."""
        return self.can_accept_priority and self.flows.is_behind(flow)

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting + self.num_sent_since_heartbeat

    def describe(self) -> dict:
        return {
            "worker_id": self.worker_id, "status": self.status.value, "pid": self.hello.pid,
            "incarnation": self.incarnation,
            "device": self.hello.device, "model": self.hello.model,
            "served_model_name": self.model, "version": self.version,
            "max_model_len": self.hello.max_model_len, "num_running": self.num_running,
            "num_waiting": self.num_waiting, "num_paused": self.num_paused,
            "num_free_blocks": self.num_free_blocks, "num_total_blocks": self.num_total_blocks,
            "num_in_flight": len(self.request_ids), "num_steps": self.num_steps,
            "progress_age_s": round(self.progress_age_s, 3),
            "startup_phases_s": self.hello.startup_phases,
            "kv_tier": dict(self.kv_tier) or None,
            # The box's KV tier it shares (an opaque id: equal ids, one tier), None: none.
            "kv_tier_id": self.hello.kv_tier or None,
        }
