"""Cache-aware routing (gateway/workers/routing.py): a prompt goes to the worker that holds its prefix,
within a bound on load imbalance; least-loaded otherwise or when asked."""

from __future__ import annotations

import concurrent.futures
import math
import random

import httpx

from tests.gateway.helpers import GatewayServer, cyclic_reply
from zeroserve.common.protocol import PROTOCOL_VERSION, Hello
from zeroserve.gateway.workers.prefix import Prefix, block_hashes
from zeroserve.gateway.workers.registry import WorkerRegistry
from zeroserve.gateway.workers.routing import LOAD_BOUND, LOAD_SLACK, load_of

BLOCK = 16


def make_registry(num_workers: int = 2, routing: str = "cache_aware",
                  max_num_seqs: int = 64) -> WorkerRegistry:
    reg = WorkerRegistry(routing=routing)
    for i in range(num_workers):
        hello = Hello(PROTOCOL_VERSION, f"w{i}", "m", 4096, 1000, BLOCK, max_num_seqs, "cpu",
                      i + 1)
        reg.register(hello, f"w{i}.{i + 1}".encode(), 0.0)
    return reg


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def route(reg: WorkerRegistry, request_id: str, prompt: list[int]) -> str:
    prefix = Prefix(prompt)
    worker = reg.pick(prefix)
    assert worker is not None
    reg.assign(worker, request_id, prefix)
    return worker.worker_id


def bound(reg: WorkerRegistry) -> int:
    """The most requests a worker may hold (equal capacities) with everything in flight."""
    total = sum(load_of(w) for w in reg.workers.values())
    return math.ceil(LOAD_BOUND * total / len(reg.workers)) + LOAD_SLACK


def test_block_hashes_cover_full_blocks_and_chain():
    a = tokens(1, 40)
    assert len(block_hashes(a, BLOCK)) == 2  # the partial third block is not cacheable
    b = a[:BLOCK] + [t + 1 for t in a[BLOCK:]]
    ha, hb = block_hashes(a, BLOCK), block_hashes(b, BLOCK)
    assert ha[0] == hb[0] and ha[1] != hb[1]
    # The same block after a different first block is a different block.
    c = [t + 1 for t in a[:BLOCK]] + a[BLOCK:]
    assert block_hashes(c, BLOCK)[1] != ha[1]


def test_turns_of_a_chat_stay_on_one_worker_and_load_stays_bounded():
    """16 chats of 5 turns over 2 workers, every turn of every chat in flight at once, in a
    shuffled order: each chat's turns all land on one worker, and no worker ever holds more
    than its bound."""
    reg = make_registry()
    rng = random.Random(7)
    system = tokens(0, 40)  # a shared system prompt (2.5 blocks)
    chats = {c: system + tokens(100 + c, 30) for c in range(16)}
    placed: dict[int, set[str]] = {c: set() for c in chats}
    for turn in range(5):
        order = list(chats)
        rng.shuffle(order)
        for c in order:
            placed[c].add(route(reg, f"c{c}t{turn}", chats[c]))
            assert max(load_of(w) for w in reg.workers.values()) <= bound(reg)
        for c in chats:  # the turn ends; the next prompt extends this one
            worker_id = next(iter(placed[c]))
            reg.release(worker_id, f"c{c}t{turn}")
            reg.get(worker_id).num_sent_since_heartbeat = 0
            chats[c] = chats[c] + tokens(1000 * turn + c, 25)
    assert all(len(workers) == 1 for workers in placed.values()), placed
    per_worker = [sum(1 for ws in placed.values() if w in ws) for w in reg.workers]
    assert min(per_worker) >= 5, per_worker  # both share the chats


def test_a_hot_prefix_spills_over_at_the_bound():
    """Every request shares one long prefix: cache affinity alone would send all of them to
    one worker; the bound spreads them and keeps both within it."""
    reg = make_registry()
    shared = tokens(3, 200)
    for i in range(60):
        route(reg, f"r{i}", shared + tokens(500 + i, 5))
        assert max(load_of(w) for w in reg.workers.values()) <= bound(reg)
    loads = sorted(load_of(w) for w in reg.workers.values())
    assert loads[0] >= 20, loads


def test_longest_held_prefix_wins():
    reg = make_registry(3)
    base = tokens(5, 64)
    first = route(reg, "a", base)
    reg.release(first, "a")
    # A prompt extending `base` goes where base went, though all are idle.
    assert route(reg, "b", base + tokens(6, 40)) == first


def test_short_prompts_and_least_loaded_policy_balance_by_load():
    reg = make_registry()
    # Below one block nothing can be reused: least loaded.
    assert {route(reg, f"s{i}", [1, 2, 3]) for i in range(2)} == {"w0", "w1"}
    reg = make_registry(routing="least_loaded")
    prompt = tokens(8, 100)
    assert {route(reg, f"l{i}", prompt) for i in range(2)} == {"w0", "w1"}


def test_a_restarted_worker_holds_nothing():
    reg = make_registry()
    prompt = tokens(9, 64)
    first = route(reg, "a", prompt)
    assert len(reg.get(first).prefix_index) == 4
    hello = reg.get(first).hello
    reg.register(hello, b"new-route", 1.0)  # a new process: its cache is empty
    assert len(reg.get(first).prefix_index) == 0


def test_index_is_bounded_by_the_workers_kv_blocks():
    reg = make_registry()
    worker = reg.get("w0")
    for i in range(40):
        reg.router.on_assigned(worker, Prefix(tokens(i, 16 * 50)))
    assert len(worker.prefix_index) == worker.hello.num_kv_blocks


def chat(gw: GatewayServer, chat_id: int, num_turns: int) -> None:
    messages = [{"role": "system", "content": f"Chat {chat_id}. You are a helpful assistant."}]
    for turn in range(num_turns):
        messages.append({"role": "user",
                         "content": f"Turn {turn}: tell me more."})
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=20, json={
            "messages": messages, "max_tokens": 40})
        assert r.status_code == 200, r.text
        messages.append({"role": "assistant",
                         "content": r.json()["choices"][0]["message"]["content"]})


def test_chats_stick_to_workers_through_the_gateway():
    """Six concurrent chats of three turns over two fake workers through the real gateway:
    every turn of a chat reaches the worker that served its first turn, and both workers
    serve chats."""
    with GatewayServer() as gw:
        workers = [gw.worker(worker_id=f"fake-{i}", step_s=0.005,
                             reply=cyclic_reply("Some words. ")).start() for i in range(2)]
        try:
            assert all(w.ready.wait(5) for w in workers)
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                list(pool.map(lambda c: chat(gw, c, 3), range(6)))
        finally:
            for w in workers:
                w.stop()
    placed: dict[int, set[str]] = {}
    for worker in workers:
        for submit in worker.submits:
            text = bytes(t for t in submit.prompt_token_ids if t < 256).decode()
            chat_id = int(text.split("Chat ", 1)[1].split(".", 1)[0])
            placed.setdefault(chat_id, set()).add(worker.worker_id)
    assert sorted(placed) == list(range(6))
    assert all(len(ws) == 1 for ws in placed.values()), placed
    assert all(len(w.submits) >= 3 for w in workers), [len(w.submits) for w in workers]


def test_a_cache_key_keeps_each_conversation_on_its_own_worker():
    """Conversations behind one long system prompt that every worker holds: a first turn
    shorter than a block ties on the shared prefix everywhere, so without a key they all go
    to the one worker its last block hashes to; with prompt_cache_key each goes where its
    key hashes (they spread) and stays there turn after turn."""
    reg = make_registry(4)
    system = tokens(0, 8 * BLOCK)
    for worker in reg.workers.values():  # a warm tier: every worker cached the prompt
        worker.prefix_index.add(Prefix(system).hashes(BLOCK))

    def place(prompt: list[int], key: str | None, request_id: str) -> str:
        prefix = Prefix(prompt, cache_key=key)
        worker = reg.pick(prefix)
        reg.assign(worker, request_id, prefix)
        reg.release(worker.worker_id, request_id)
        worker.num_sent_since_heartbeat = 0  # (as its next heartbeat would say)
        return worker.worker_id

    unkeyed = {place(system + tokens(100 + s, 5), None, f"u{s}") for s in range(12)}
    assert len(unkeyed) == 1
    placed: dict[int, set[str]] = {}
    for turn in range(3):
        for s in range(12):
            prompt = system + tokens(100 + s, 5 + turn * BLOCK)
            placed.setdefault(s, set()).add(place(prompt, f"session-{s}", f"r{turn}-{s}"))
    assert all(len(workers) == 1 for workers in placed.values())  # each sticks
    assert len(set().union(*placed.values())) > 1  # and they spread
