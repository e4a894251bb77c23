"""Gateways found by DNS (`zeroserve worker --gateway-dns NAME`): the worker links to every
address the name resolves to, links to new ones, and lets a vanished gateway's link end
with its last stream (or at once, failing its streams, when that gateway is silent too).
The resolver is a stub; the sockets are real tcp:// on loopback addresses, one per
"pod", every gateway on the same ports, as in a Kubernetes headless Service."""

from __future__ import annotations

import queue
import random
import threading
import time

import pytest
import zmq

from tests.worker.test_process import WORKER_ID, FakeGateway, ScriptedEngine
from zeroserve.cli.harness import free_ports_on
from zeroserve.common.protocol import Credit, Hello, Ready, Shutdown, Submit
from zeroserve.worker.config import WorkerConfig
from zeroserve.worker.discovery import GatewayDiscovery, GatewayDns, GatewaysFound
from zeroserve.worker.process import run_worker


def test_gateway_dns_builds_each_address_endpoints_and_refuses_bad_settings():
    dns = GatewayDns("zeroserve-gateway-plane", 5555, 5556)
    assert dns.endpoints("10.1.2.3") == ("tcp://10.1.2.3:5555", "tcp://10.1.2.3:5556")
    assert dns.endpoints("fd00::7") == ("tcp://[fd00::7]:5555", "tcp://[fd00::7]:5556")
    for bad in (dict(name="tcp://gw:5555"), dict(name="gw:5555"), dict(name="gw", router_port=0),
                dict(name="gw", router_port=7, tokens_port=7), dict(name="gw", interval_s=0)):
        with pytest.raises(ValueError):
            GatewayDns(**bad)


def test_a_config_takes_addresses_or_a_name_and_a_name_needs_keys_as_tcp_does():
    dns = GatewayDns("gw.example")
    WorkerConfig(WORKER_ID, (), (), gateway_dns=dns, insecure=True)
    with pytest.raises(ValueError, match="not both"):
        WorkerConfig(WORKER_ID, "tcp://a:1", "tcp://a:2", gateway_dns=dns, insecure=True)
    with pytest.raises(ValueError, match="CurveZMQ"):
        WorkerConfig(WORKER_ID, (), (), gateway_dns=dns)


def test_discovery_reports_only_changed_answers_and_a_failed_lookup_changes_nothing():
    answers = [["10.0.0.2", "10.0.0.1"], ["10.0.0.1", "10.0.0.2"], OSError("NXDOMAIN"),
               ["10.0.0.1", "not-an-ip"], ["10.0.0.1"]]
    num_lookups = [0]

    def resolver(name: str) -> list[str]:
        assert name == "gw"
        num_lookups[0] += 1
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    inbox: queue.Queue = queue.Queue()
    discovery = GatewayDiscovery(GatewayDns("gw", interval_s=0.01), inbox, WORKER_ID, resolver)
    discovery.start()
    # The five answers, then the last one three times more (no news): counted, not a nap
    # (a thread starved on a loaded machine gets through fewer lookups in a fixed 0.3 s).
    deadline = time.monotonic() + 20
    while num_lookups[0] < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert num_lookups[0] >= 8
    discovery.stop()
    discovery.join(1)
    found = []
    while not inbox.empty():
        index, msg = inbox.get_nowait()
        assert index is None and isinstance(msg, GatewaysFound)
        found.append([router for router, _ in msg.endpoints])
    # The same set in another order is no change; a failure and a bogus record are not news.
    assert found == [["tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"], ["tcp://10.0.0.1:5555"]]


# -- the worker loop against two tcp gateways on one name ------------------------------------


class TcpGateway(FakeGateway):
    """A FakeGateway bound on tcp:// at one loopback address (a pod IP), ports shared."""

    def __init__(self, ip: str, router_port: int, tokens_port: int):  # not super(): it binds ipc
        self.ctx = zmq.Context()
        self.worker_id = WORKER_ID
        self.route = None
        self.router_address = f"tcp://{ip}:{router_port}"
        self.tokens_address = f"tcp://{ip}:{tokens_port}"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(self.router_address)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.tokens_address)
        self.heartbeats = []

    def goes_silent(self, quiet_s: float = 0.5, within_s: float = 3.0) -> bool:
        """Nothing (not even a heartbeat) from the worker for `quiet_s`, starting within
        `within_s`: its link to us is closed."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if not self.router.poll(int(quiet_s * 1000)):
                return True
            self.router.recv_multipart()
        return False


class Answer:
    """The stub DNS: what the name resolves to now."""

    def __init__(self, ips: list[str]):
        self.ips = list(ips)
        self.lock = threading.Lock()

    def set(self, ips: list[str]) -> None:
        with self.lock:
            self.ips = list(ips)

    def __call__(self, name: str) -> list[str]:
        with self.lock:
            if not self.ips:
                raise OSError("Name or service not known")
            return list(self.ips)


@pytest.fixture
def tier():
    base = f"127.{random.randint(1, 250)}.{random.randint(1, 250)}"
    ips = [f"{base}.1", f"{base}.2"]
    router_port, tokens_port = free_ports_on(ips, 2)
    gateways = [TcpGateway(ip, router_port, tokens_port) for ip in ips]
    dns = GatewayDns("zeroserve-gateway-plane", router_port, tokens_port, interval_s=0.05)
    yield ips, gateways, dns
    for gw in gateways:
        gw.close()


def start_worker(dns: GatewayDns, answer: Answer, **overrides):
    engine = ScriptedEngine()
    config = WorkerConfig(WORKER_ID, (), (), gateway_dns=dns, insecure=True,
                          heartbeat_interval_s=0.05, **overrides)
    result: dict[str, int] = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("exit", run_worker(config, engine, resolver=answer)),
        daemon=True)
    thread.start()
    return thread, result, engine


def ready(gw: TcpGateway, gateway_id: str) -> None:
    gw.recv(Hello)
    gw.send(Ready(True, "", 0.05, gateway_id))


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_a_worker_links_to_every_gateway_of_the_name_and_follows_it_as_gateways_come_and_go(
        tier):
    ips, (a, b), dns = tier
    answer = Answer(ips)
    thread, result, engine = start_worker(dns, answer, gateway_timeout_s=3.0)
    ready(a, "gw-a")
    ready(b, "gw-b")
    a.send(Submit("on-a", [1], {"max_tokens": 1000}, 2))
    b.send(Submit("on-b", [1], {"max_tokens": 4}, 2))
    assert tokens_of(a.collect_n("on-a", 2)) == [101, 102]
    assert tokens_of(b.collect_n("on-b", 2)) == [101, 102]

    # b's pod is deleted: gone from the answer, but it still talks (it drains), so its
    # stream finishes there; then its link closes. a's stream is untouched.
    answer.set([ips[0]])
    time.sleep(0.3)
    b.send(Credit([["on-b", 4]]))
    outs_b = b.collect({"on-b"})["on-b"]
    assert tokens_of(outs_b) == [103, 104] and outs_b[-1].finish_reason == "length"
    assert b.goes_silent()
    a.send(Credit([["on-a", 5]]))
    assert tokens_of(a.collect_n("on-a", 3)) == [103, 104, 105]

    # b comes back (a new pod at an address of the name): the worker says HELLO there again.
    answer.set(ips)
    ready(b, "gw-b2")
    b.send(Submit("on-b2", [1], {"max_tokens": 2}, 2))
    outs = b.collect({"on-b2"})["on-b2"]
    assert tokens_of(outs) == [101, 102] and outs[-1].finish_reason == "length"

    a.send(Shutdown("test over"))
    thread.join(5)
    assert result["exit"] == 0


def test_a_gateway_gone_from_the_name_and_silent_costs_only_its_own_streams(tier):
    ips, (a, b), dns = tier
    answer = Answer(ips)
    # A long grace: without the DNS answer, a's stream would be kept for a minute.
    thread, result, engine = start_worker(dns, answer, gateway_timeout_s=0.4,
                                          gateway_grace_s=60.0)
    ready(a, "gw-a")
    ready(b, "gw-b")
    a.send(Submit("on-a", [1], {"max_tokens": 1000}, 2))
    b.send(Submit("on-b", [1], {"max_tokens": 1000}, 2))
    a.collect_n("on-a", 2)
    b.collect_n("on-b", 2)
    answer.set([ips[1]])  # a vanished (its pod is gone) and says nothing more
    started = time.monotonic()
    # Generous for a loaded machine (it ends within a second or so here), and far short of
    # the 60 s grace that would apply without the DNS answer.
    keep_b_talking = time.monotonic() + 20
    outs_a: list = []
    while time.monotonic() < keep_b_talking:  # b is alive: it keeps granting credit
        b.send(Credit([["on-b", 2 + int((time.monotonic() - started) * 10)]]))
        msg = a.tokens(timeout_s=0.05)
        if msg is not None:
            outs_a += [o for o in msg.outputs if o.request_id == "on-a"]
        if outs_a and outs_a[-1].finish_reason is not None:
            break
    assert outs_a and outs_a[-1].finish_reason == "abort"
    assert "lost contact" in outs_a[-1].error
    assert time.monotonic() - started < 20
    assert "on-a" not in engine.reqs and "on-b" in engine.reqs
    b.send(Shutdown("test over"))
    thread.join(5)
    assert result["exit"] == 0


def test_a_worker_started_before_any_gateway_links_once_the_name_resolves(tier):
    ips, (a, b), dns = tier
    answer = Answer([])  # NXDOMAIN: no gateway pod exists yet
    thread, result, engine = start_worker(dns, answer)
    time.sleep(0.3)
    assert thread.is_alive()
    answer.set([ips[1]])
    ready(b, "gw-b")
    b.send(Submit("first", [1], {"max_tokens": 2}, 2))
    assert tokens_of(b.collect({"first"})["first"]) == [101, 102]
    b.send(Shutdown("test over"))
    thread.join(5)
    assert result["exit"] == 0
