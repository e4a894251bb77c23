"""Cache-aware routing with the box's KV tier (gateway/workers/routing.py, issue 37): a prefix
any worker of a tier was sent is a tier hit on every worker of that tier; a worker's own pool
beats its tier, its tier beats a miss, and the load bound still holds."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import httpx

from tests.gateway.helpers import FakeWorker, GatewayServer, cyclic_reply, wait_until
from tests.gateway.workers.test_routing import tokens
from zeroserve.common.protocol import PROTOCOL_VERSION, Hello
from zeroserve.gateway.workers.handle import WorkerStatus
from zeroserve.gateway.workers.prefix import Prefix
from zeroserve.gateway.workers.registry import WorkerRegistry
from zeroserve.gateway.workers.routing import MAX_TIER_INDEX_BLOCKS

BLOCK = 16
TIER = "a1b2c3d4e5f60718"


def hello(worker_id: str, tier: str = "", pid: int = 1) -> Hello:
    return Hello(PROTOCOL_VERSION, worker_id, "m", 4096, 1000, BLOCK, 64, "cpu", pid, {}, "",
                 "", tier, 10_000 if tier else 0)


def make_registry(tiers: dict[str, str]) -> WorkerRegistry:
    reg = WorkerRegistry()
    for i, (worker_id, tier) in enumerate(tiers.items()):
        reg.register(hello(worker_id, tier, i + 1), f"{worker_id}.{i}".encode(), 0.0)
    return reg


def route(reg: WorkerRegistry, request_id: str, prompt: list[int]) -> str:
    prefix = Prefix(prompt)
    worker = reg.pick(prefix)
    assert worker is not None
    reg.assign(worker, request_id, prefix)
    reg.release(worker.worker_id, request_id)
    worker.num_sent_since_heartbeat = 0  # (as its next heartbeat would say)
    return worker.worker_id


PROMPTS = [tokens(s, 8 * BLOCK + 5) for s in range(24)]


def test_a_prefix_one_worker_computed_goes_to_its_tier_not_to_a_miss():
    """w0 and w1 share a tier, w2 has none. Each prompt went first to one worker of the
    tier; with that worker draining, its next turn goes to the other worker of the tier
    (a tier hit), never to w2 (a miss), whatever rendezvous hashing would say."""
    num_checked = 0
    for i, prompt in enumerate(PROMPTS):
        reg = make_registry({"w0": TIER, "w1": TIER, "w2": ""})
        reg.get("w2").status = WorkerStatus.DRAINING
        first = route(reg, f"a{i}", prompt)
        reg.get("w2").status = WorkerStatus.READY
        reg.get(first).status = WorkerStatus.DRAINING
        other = "w1" if first == "w0" else "w0"
        assert route(reg, f"b{i}", prompt + tokens(100 + i, 30)) == other
        num_checked += 1
    assert num_checked == len(PROMPTS)


def test_the_own_pool_beats_the_tier():
    """All idle: a prompt's next turn goes back to the worker that computed it (its pool),
    though the tier makes every worker of it a hit."""
    reg = make_registry({"w0": TIER, "w1": TIER, "w2": TIER})
    for i, prompt in enumerate(PROMPTS):
        first = route(reg, f"a{i}", prompt)
        assert route(reg, f"b{i}", prompt + tokens(200 + i, 20)) == first


def test_a_whole_prompt_in_the_tier_beats_its_first_block_in_a_pool():
    """w2 (no tier) was sent only the prompt's first block; w0 computed it all (the tier
    holds it) and is draining: w1 loads 8 blocks from the tier rather than w2 computing 7."""
    for i, prompt in enumerate(PROMPTS):
        reg = make_registry({"w0": TIER, "w1": TIER, "w2": ""})
        reg.get("w2").prefix_index.add(Prefix(prompt).hashes(BLOCK)[:1])
        reg.router.on_assigned(reg.get("w0"), Prefix(prompt))
        reg.get("w0").status = WorkerStatus.DRAINING
        assert route(reg, f"a{i}", prompt) == "w1"


def test_the_tier_outlives_a_workers_restart_and_other_tiers_share_nothing():
    for i, prompt in enumerate(PROMPTS):
        reg = make_registry({"w0": TIER, "w1": "", "w2": "another-tier"})
        reg.router.on_assigned(reg.get("w0"), Prefix(prompt))
        reg.register(hello("w0", TIER, 9), b"w0.restarted", 1.0)  # its pool is empty now
        assert len(reg.get("w0").prefix_index) == 0
        assert route(reg, f"a{i}", prompt) == "w0"  # the tier still holds the prompt


def test_the_load_bound_still_holds_over_a_tier_hit():
    """The tier's other worker is beyond its bound: the prompt goes to the idle miss."""
    reg = make_registry({"w0": TIER, "w1": TIER, "w2": ""})
    prompt = PROMPTS[0]
    reg.router.on_assigned(reg.get("w0"), Prefix(prompt))
    reg.get("w0").status = WorkerStatus.DRAINING
    for n in range(6):
        reg.assign(reg.get("w1"), f"busy{n}")
    assert reg.pick(Prefix(prompt)).worker_id == "w2"


def on_loop(gw: GatewayServer, call, *args) -> None:
    """Call a gateway method on its own event loop, as its admin API would, and wait."""
    done = threading.Event()
    gw.loop.call_soon_threadsafe(lambda: (call(*args), done.set()))
    assert done.wait(5)


@dataclass
class TierWorker(FakeWorker):
    """A fake worker whose HELLO names a KV tier."""

    tier: str = ""

    def hello(self) -> Hello:
        plain = super().hello()
        plain.kv_tier, plain.kv_tier_num_blocks = self.tier, 10_000 if self.tier else 0
        return plain


def test_through_the_gateway_a_drained_workers_prefix_goes_to_its_tier():
    """Real sockets and HELLOs: prompts served by one worker of a tier, that worker drained
    through the admin path; each prompt's next turn goes to the other worker of the tier."""
    with GatewayServer() as gw:
        router, tokens_address = gw.config.endpoints
        workers = {worker_id: TierWorker(router, tokens_address, worker_id=worker_id,
                                         reply=cyclic_reply("ok "), tier=tier).start()
                   for worker_id, tier in (("t0", TIER), ("t1", TIER), ("solo", ""))}
        try:
            assert all(w.ready.wait(5) for w in workers.values())
            assert gw.gateway.registry.get("t0").describe()["kv_tier_id"] == TIER
            on_loop(gw, gw.gateway.drain_worker, "solo", 30, False)
            prompts = [f"Conversation {i}: " + "a long shared system prompt. " * 6
                       for i in range(8)]
            for p in prompts:
                assert httpx.post(gw.url + "/v1/completions", timeout=20, json={
                    "prompt": p, "max_tokens": 2}).status_code == 200
            on_loop(gw, gw.gateway.undrain_worker, "solo")
            assert wait_until(lambda: gw.gateway.registry.get("solo").can_accept)
            first = {p: w.worker_id for w in workers.values() for s in w.submits
                     for p in prompts if bytes(s.prompt_token_ids).decode() == p}
            assert set(first.values()) <= {"t0", "t1"} and len(first) == len(prompts)
            on_loop(gw, gw.gateway.drain_worker, "t0", 30, False)
            for p in prompts:
                if first[p] == "t0":
                    r = httpx.post(gw.url + "/v1/completions", timeout=20, json={
                        "prompt": p + " And then?", "max_tokens": 2})
                    assert r.status_code == 200
            later = [bytes(s.prompt_token_ids).decode() for s in workers["t1"].submits]
            moved = [p for p in prompts if first[p] == "t0"]
            assert moved and all(p + " And then?" in later for p in moved)
            assert not workers["solo"].submits
        finally:
            for w in workers.values():
                w.stop()


def test_a_tier_index_is_bounded_by_its_tier_and_by_the_gateway():
    reg = WorkerRegistry()
    reg.register(Hello(PROTOCOL_VERSION, "w0", "m", 4096, 1000, BLOCK, 64, "cpu", 1, {}, "",
                       "", TIER, 50), b"w0.0", 0.0)
    reg.register(Hello(PROTOCOL_VERSION, "w1", "m", 4096, 1000, BLOCK, 64, "cpu", 2, {}, "",
                       "", "huge", 2**40), b"w1.0", 0.0)
    for i in range(10):
        reg.router.on_assigned(reg.get("w0"), Prefix(tokens(i, 16 * 20)))
    assert len(reg.router.tier_index(reg.get("w0"))) == 50
    assert reg.router.tier_index(reg.get("w1")).capacity == MAX_TIER_INDEX_BLOCKS
