"""`zeroserve serve --gateways 2`: two gateway processes share the HTTP port and every worker
serves both. Killing one gateway ends only its own clients' streams; the other gateway's
streams finish intact, the workers keep running, and the supervisor brings the dead gateway
back (fake backend, real processes)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.e2e.helpers import StreamResult, stream_in_thread
from zeroserve.cli.admin_client import AdminClient, restart

pytestmark = pytest.mark.slow

MAX_TOKENS = 400
BODY = {"prompt": "Tell me everything.", "max_tokens": MAX_TOKENS,
        "stream_options": {"include_usage": True}}


def pinned_client(url: str) -> tuple[httpx.Client, int]:
    """A client whose one kept-alive connection landed on some gateway process, and that
    process's pid (the kernel picks the gateway per connection: SO_REUSEPORT)."""
    client = httpx.Client(base_url=url, timeout=60, headers={"X-Zeroserve-Admin": "1"},
                          limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
    return client, client.get("/health/live").json()["pid"]


def clients_on_each_gateway(url: str, per_gateway: int, num_gateways: int = 2,
                            max_tries: int = 200) -> dict[int, list[httpx.Client]]:
    by_pid: dict[int, list[httpx.Client]] = {}
    for _ in range(max_tries):
        client, pid = pinned_client(url)
        group = by_pid.setdefault(pid, [])
        if len(group) < per_gateway:
            group.append(client)
        else:
            client.close()
        if len(by_pid) == num_gateways and all(len(g) == per_gateway for g in by_pid.values()):
            return by_pid
    raise AssertionError(f"connections did not land on {num_gateways} gateways: "
                         f"{ {pid: len(g) for pid, g in by_pid.items()} }")


def wait_for_workers_on_every_gateway(url: str, num_gateways: int, num_workers: int,
                                      timeout_s: float) -> set[int]:
    """Until every gateway process lists `num_workers` ready workers; their pids."""
    ready: set[int] = set()
    pids: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            client, pid = pinned_client(url)
            try:
                workers = client.get("/health").json().get("workers", [])
            finally:
                client.close()
        except (httpx.HTTPError, ValueError):
            time.sleep(0.2)
            continue
        pids.add(pid)
        if sum(w["status"] == "ready" for w in workers) >= num_workers:
            ready.add(pid)
        if len(ready) >= num_gateways:
            return ready
        time.sleep(0.05)
    raise AssertionError(f"gateways ready: {ready} of {pids}")


def incarnations(client: httpx.Client) -> dict[str, tuple[int, str]]:
    """Each worker's pid and incarnation, as the gateway behind `client` names them."""
    return {w["worker_id"]: (w["pid"], w["incarnation"])
            for w in client.get("/admin/workers").json()["workers"]}


def same_on_every_gateway(by_pid: dict[int, list[httpx.Client]]) -> dict[str, tuple[int, str]]:
    """The workers' names, asserted the same through every gateway (`zeroserve workers
    restart` polls whichever one answers)."""
    seen = {pid: incarnations(clients[0]) for pid, clients in by_pid.items()}
    first, *others = seen.values()
    assert all(names == first for names in others), seen
    return first


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_dead_gateway_ends_only_its_own_streams_and_comes_back(zeroserve):
    server = zeroserve(args=("--gateways", "2", "--workers", "2", "--backend", "fake",
                             "--device", "cpu", "--fake-forward-ms", "10",
                             "--num-kv-blocks", "1024"), num_workers=2, timeout_s=180)
    gateway_pids = wait_for_workers_on_every_gateway(server.url, 2, 2, timeout_s=120)
    worker_pids = {w["worker_id"]: w["pid"] for w in server.workers()}

    by_pid = clients_on_each_gateway(server.url, per_gateway=3)
    assert set(by_pid) == gateway_pids
    names = same_on_every_gateway(by_pid)
    assert sorted(names) == ["worker-0", "worker-1"]
    victim, survivor = sorted(by_pid)
    streams: dict[int, list[StreamResult]] = {}
    threads = []
    for pid, clients in by_pid.items():
        for client in clients:
            thread, result = stream_in_thread(server.url, BODY, client=client)
            threads.append(thread)
            streams.setdefault(pid, []).append(result)
    everything = [r for results in streams.values() for r in results]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(len(r.chunks) >= 5 for r in everything):
        time.sleep(0.05)
    assert all(len(r.chunks) >= 5 for r in everything), "streams did not start"
    assert not any(r.is_done for r in everything), "streams ended before the kill"

    os.kill(victim, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=120)

    # The dead gateway's clients lost their connections, mid-stream.
    for result in streams[victim]:
        assert not result.is_done and result.exception is not None
        assert len(result.chunks) < MAX_TOKENS
    # The other gateway's streams finished intact: every token, no error.
    for result in streams[survivor]:
        assert result.exception is None and result.error is None, result.error
        assert result.is_done and result.finish_reason == "length"
        assert result.usage["completion_tokens"] == MAX_TOKENS
    texts = {r.text for r in streams[survivor]}
    assert len(texts) == 1  # the same prompt gives the same tokens (fake backend)

    # The supervisor restarts the dead gateway; the workers never restarted.
    new_pids = wait_for_workers_on_every_gateway(server.url, 2, 2, timeout_s=120)
    assert survivor in new_pids and victim not in new_pids
    assert {w["worker_id"]: w["pid"] for w in server.workers()} == worker_pids
    # New requests succeed on the new gateway process, with the undisturbed run's text.
    (new_gateway,) = new_pids - {survivor}
    client = clients_on_each_gateway(server.url, per_gateway=1)[new_gateway][0]
    assert incarnations(client) == names  # the new gateway names the workers alike
    # (The undisturbed run's first 40 tokens: the same tokens, without 4 s more of them.)
    thread, result = stream_in_thread(server.url, {**BODY, "max_tokens": 40}, client=client)
    thread.join(timeout=120)
    client.close()
    assert result.exception is None and result.error is None and result.is_done
    assert result.usage["completion_tokens"] == 40 and result.text
    [undisturbed] = texts
    assert undisturbed.startswith(result.text)
    for clients in by_pid.values():
        for c in clients:
            c.close()


def tier_totals(client: httpx.Client) -> tuple[float, float]:
    """From one gateway's /metrics: finished requests summed over every gateway's series,
    and the ready workers (a worker figure: once for the tier, not once per gateway)."""
    from prometheus_client.parser import text_string_to_metric_families

    finished = ready = 0.0
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "zeroserve:request_success_total":
                finished += sample.value
            elif sample.name == "zeroserve:workers" and sample.labels["status"] == "ready":
                ready += sample.value
    return finished, ready


def statuses(by_pid: dict[int, list[httpx.Client]]) -> dict[int, str]:
    """worker-0's status as each gateway sees it."""
    return {pid: clients[0].get("/admin/workers").json()["workers"][0]["status"]
            for pid, clients in by_pid.items()}


def wait_for_status(by_pid: dict[int, list[httpx.Client]], status: str) -> dict[int, str]:
    deadline = time.monotonic() + 10
    seen = statuses(by_pid)
    while any(s != status for s in seen.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        seen = statuses(by_pid)
    return seen


def test_the_tier_answers_as_one_for_metrics_and_admin(zeroserve):
    """A scrape of the shared port reaches either gateway; both count all the requests.
    A drain through one gateway and the undrain through the other reach every gateway."""
    server = zeroserve(args=("--gateways", "2", "--workers", "1", "--backend", "fake",
                             "--device", "cpu", "--num-kv-blocks", "256"),
                       num_workers=1, timeout_s=180)
    wait_for_workers_on_every_gateway(server.url, 2, 1, timeout_s=120)
    by_pid = clients_on_each_gateway(server.url, per_gateway=1)
    body = {"prompt": "count me", "max_tokens": 4}
    for clients in by_pid.values():
        for _ in range(3):
            assert clients[0].post("/v1/completions", json=body).status_code == 200
    try:
        deadline = time.monotonic() + 10
        while True:  # each gateway writes its figures for the other every second
            totals = {pid: tier_totals(clients[0]) for pid, clients in by_pid.items()}
            if all(t == (6.0, 1.0) for t in totals.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert all(t == (6.0, 1.0) for t in totals.values()), totals

        first, second = sorted(by_pid)
        drain = by_pid[first][0].post("/admin/workers/worker-0/drain", json={"deadline_s": 30})
        assert drain.status_code == 200, drain.text
        assert set(wait_for_status(by_pid, "draining").values()) == {"draining"}
        undrain = by_pid[second][0].post("/admin/workers/worker-0/undrain", json={})
        assert undrain.status_code == 200, undrain.text
        assert set(wait_for_status(by_pid, "ready").values()) == {"ready"}

        # `zeroserve workers restart` against the shared port: whichever gateway each poll
        # reaches, it returns only once a new process is ready (the old one has exited).
        old_pid, old_incarnation = same_on_every_gateway(by_pid)["worker-0"]
        restart(AdminClient(server.url), "worker-0", deadline_s=5, timeout_s=60,
                say=lambda _: None)
        assert not is_alive(old_pid)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the other gateway may take its HELLO later
            seen = {incarnations(clients[0]).get("worker-0") for clients in by_pid.values()}
            if len(seen) == 1 and None not in seen:
                break
            time.sleep(0.1)
        new_pid, new_incarnation = same_on_every_gateway(by_pid)["worker-0"]
        assert new_pid != old_pid and new_incarnation != old_incarnation
    finally:
        for clients in by_pid.values():
            clients[0].close()


def test_a_tier_starts_on_a_fresh_machine(zeroserve, tmp_path):
    """A new container: no zeroserve-UID folder under the temp dir yet, umask 022. The
    metrics folder made it first with mode 755 and every gateway refused it (exit 1)."""
    fresh_tmp = tmp_path / "fresh-tmp"
    fresh_tmp.mkdir()
    previous = os.umask(0o022)
    try:
        server = zeroserve(args=("--gateways", "2", "--workers", "1", "--backend", "fake",
                                 "--device", "cpu", "--num-kv-blocks", "64"),
                           env={"TMPDIR": str(fresh_tmp)}, num_workers=1, timeout_s=120)
    finally:
        os.umask(previous)
    wait_for_workers_on_every_gateway(server.url, 2, 1, timeout_s=60)
    assert httpx.post(server.url + "/v1/completions", timeout=30,
                      json={"prompt": "hi", "max_tokens": 3}).status_code == 200
    ipc_dir = fresh_tmp / f"zeroserve-{os.getuid()}"
    for folder in (ipc_dir, ipc_dir / f"gw-{server.port}-metrics"):
        assert folder.stat().st_mode & 0o777 == 0o700, folder


def test_a_stored_response_is_found_through_either_gateway(zeroserve):
    """`serve --gateways 2`: a response stored through one gateway process is continued,
    read and deleted through the other (they share the tier's responses folder)."""
    server = zeroserve(args=("--gateways", "2", "--workers", "1", "--backend", "fake",
                             "--device", "cpu", "--num-kv-blocks", "256"),
                       num_workers=1, timeout_s=180)
    wait_for_workers_on_every_gateway(server.url, 2, 1, timeout_s=120)
    by_pid = clients_on_each_gateway(server.url, per_gateway=1)
    (first,), (second,) = by_pid.values()
    created = first.post("/v1/responses", json={"input": "remember me",
                                                "max_output_tokens": 4})
    assert created.status_code == 200, created.text
    response_id = created.json()["id"]
    follow = second.post("/v1/responses", json={
        "input": "and now?", "previous_response_id": response_id, "max_output_tokens": 4})
    assert follow.status_code == 200, follow.text
    assert follow.json()["previous_response_id"] == response_id
    assert second.get(f"/v1/responses/{response_id}").json()["id"] == response_id
    assert second.delete(f"/v1/responses/{response_id}").status_code == 200
    assert first.get(f"/v1/responses/{response_id}").status_code == 404
    for clients in by_pid.values():
        for client in clients:
            client.close()
