"""The compose stack on a real Docker engine, as a user runs it (docs/deployment/compose.md).

Run by `scripts/test-compose` (which `.ci/run` calls after the test suite): it installs and
starts the engine, makes the local base image, builds the image and sets COMPOSE_FILE to the
CPU configuration; here the steps of the docs page follow, in order: the keys, `up`, a
streamed answer from 127.0.0.1, a worker container killed (`docker kill`) and a worker
crashed in the middle of 8 streams each, `docker compose restart` and a rolling restart
through the admin API under streams, and `down`. Elsewhere (the plain suite) it is skipped:
it needs the engine and the image that script prepares.

The tests share one stack and run in file order; each leaves both workers ready.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.helpers import MODEL, StreamResult, stream_in_thread

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("ZEROSERVE_COMPOSE_STACK") != "1",
                       reason="needs a Docker engine: run by scripts/test-compose"),
]

PORT = os.environ.get("ZEROSERVE_HTTP_PORT", "8000")  # scripts/test-compose picks a free one
URL = f"http://127.0.0.1:{PORT}"
PROJECT = "zeroserve"  # the compose file's `name:`
WORKERS = ("worker-0", "worker-1")
# Long enough that a kill lands mid-stream; ignore_eos: every stream runs to max_tokens.
STREAM_BODY = {"messages": [{"role": "user", "content": "Tell me a long story."}],
               "max_tokens": 48, "ignore_eos": True, "stream_options": {"include_usage": True}}


def compose(*args: str, timeout_s: float = 300, check: bool = True) -> str:
    """`docker compose ARGS` in the repository (COMPOSE_FILE from the environment)."""
    done = subprocess.run(["docker", "compose", *args], capture_output=True, text=True,
                          timeout=timeout_s)
    if check and done.returncode != 0:
        raise AssertionError(f"docker compose {' '.join(args)}: exit {done.returncode}\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def docker(*args: str, timeout_s: float = 120) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


def container(service: str) -> str:
    return compose("ps", "-aq", service, timeout_s=60).strip()


def health_workers() -> dict[str, dict]:
    try:
        body = httpx.get(URL + "/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {w["worker_id"]: w for w in body.get("workers", [])}


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    """Poll `predicate` until it returns something true; its value. Fails after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}\n"
                         + compose("ps", "-a", check=False, timeout_s=60))


def incarnations() -> dict[str, str]:
    """Each worker's incarnation: new with every process (a pid is not: in its container a
    worker always has the same one)."""
    return {w: info["incarnation"] for w, info in health_workers().items()}


def wait_ready(worker_ids=WORKERS, timeout_s: float = 300, not_in: dict | None = None) -> None:
    """Until /health lists every worker of `worker_ids` ready (in an incarnation other than
    `not_in[id]`: a new process)."""
    def ready() -> bool:
        found = health_workers()
        return all(found.get(w, {}).get("status") == "ready"
                   and (not_in is None or found[w].get("incarnation") != not_in.get(w))
                   for w in worker_ids)
    wait_until(ready, timeout_s, f"workers {worker_ids} ready")


def start_streams(n: int = 8) -> list[tuple]:
    streams = [stream_in_thread(URL, STREAM_BODY, timeout_s=300) for _ in range(n)]
    # Every stream under way (a first token) before the fault.
    wait_until(lambda: all(r.chunks or r.exception or r.error for _, r in streams), 180,
               "every stream's first token")
    return streams


def assert_all_complete(streams: list[tuple[object, StreamResult]]) -> None:
    for thread, result in streams:
        thread.join(timeout=300)
        assert not thread.is_alive(), "a stream still running after 300 s"
        assert result.exception is None, repr(result.exception)
        assert result.error is None, result.error
        assert result.is_done and result.finish_reason == "length", result.chunks[-2:]
        assert result.usage["completion_tokens"] == STREAM_BODY["max_tokens"], result.usage


def measured(what: str, seconds: float) -> None:
    """A figure for docs/deployment/compose.md, printed (scripts/test-compose shows it)."""
    print(f"\nMEASURED {what}: {seconds:.1f} s", flush=True)


@pytest.fixture(scope="module")
def stack() -> Iterator[None]:
    """The docs' steps: the keys, then `docker compose up -d`; `down -v` at the end."""
    compose("run", "--rm", "keygen", timeout_s=180)
    started = time.monotonic()
    try:
        compose("up", "-d", timeout_s=300)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

        def answered() -> bool:
            try:
                return httpx.post(URL + "/v1/chat/completions", json=body,
                                  timeout=60).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(answered, 600, "a first answer after `docker compose up -d`", 1.0)
        measured("docker compose up -d to the first answer", time.monotonic() - started)
        wait_ready()
        yield
    finally:
        compose("down", "-v", "--timeout", "60", check=False, timeout_s=300)


def test_streams_a_chat_completion_on_loopback_only(stack):
    thread, result = stream_in_thread(URL, STREAM_BODY, timeout_s=300)
    thread.join(timeout=300)
    assert result.exception is None and result.error is None
    assert result.is_done and result.text and result.finish_reason == "length"
    # Published on 127.0.0.1 only.
    assert compose("port", "gateway", "8000").strip() == f"127.0.0.1:{PORT}"
    bindings = json.loads(docker("inspect", "-f", "{{json .HostConfig.PortBindings}}",
                                 container("gateway")))
    assert {b["HostIp"] for v in bindings.values() for b in v} == {"127.0.0.1"}


def test_the_image_runs_unprivileged_with_its_kernels_built_in(stack):
    for service in WORKERS:
        assert compose("exec", "-T", service, "id", "-u").strip() == "1000"
        # No compiler in the image: a worker that had to build its kernels would log that
        # they are unavailable; it loads the ones the build compiled.
        assert compose("exec", "-T", service, "sh", "-c",
                       "command -v g++ c++ gcc || echo none").strip() == "none"
        logs = compose("logs", "--no-color", service)
        assert "native CPU kernels for" in logs, logs[-2000:]
        assert "native CPU kernels unavailable" not in logs, logs[-2000:]


def test_a_docker_killed_worker_loses_no_stream_and_comes_back(stack):
    """`docker kill` mid-stream: every stream moves on and completes. Docker never restarts
    a container an operator stopped or killed (whatever the restart policy), so it comes
    back with `docker compose up -d`, as the docs say; a crash comes back by itself (next)."""
    old = incarnations()
    streams = start_streams()
    docker("kill", container("worker-0"))
    assert_all_complete(streams)
    started = time.monotonic()
    compose("up", "-d", "worker-0")
    wait_ready(not_in={"worker-0": old["worker-0"]})
    measured("worker container back after docker kill + docker compose up -d",
             time.monotonic() - started)
    serves_alone("worker-0")


def test_a_crashed_worker_loses_no_stream_and_restarts_by_policy(stack):
    """The worker process SIGKILLed (as the OOM killer does) mid-stream: every stream
    completes, and compose's restart policy brings the container back."""
    worker = container("worker-0")
    restarts = int(docker("inspect", "-f", "{{.RestartCount}}", worker))
    old = incarnations()
    pid = health_workers()["worker-0"]["pid"]
    streams = start_streams()
    compose("exec", "-T", "worker-0", "sh", "-c", f"kill -9 {pid}")
    killed = time.monotonic()
    wait_until(lambda: int(docker("inspect", "-f", "{{.RestartCount}}", worker)) > restarts,
               120, "the restart policy restarting worker-0")
    wait_ready(not_in={"worker-0": old["worker-0"]})
    measured("worker container restart after its process is SIGKILLed, to ready",
             time.monotonic() - killed)
    assert_all_complete(streams)
    serves_alone("worker-0")


def serves_alone(worker_id: str) -> None:
    """With every other worker drained, a request is answered: `worker_id` serves."""
    others = [w for w in WORKERS if w != worker_id]
    for other in others:
        compose("exec", "-T", "gateway", "zeroserve", "workers", "drain", other, timeout_s=120)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        response = httpx.post(URL + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
    finally:
        for other in others:
            compose("exec", "-T", "gateway", "zeroserve", "workers", "undrain", other,
                    timeout_s=120)
    wait_ready()


def test_compose_restart_of_a_worker_under_streams(stack):
    old = incarnations()
    streams = start_streams()
    compose("restart", "worker-1", timeout_s=180)
    assert_all_complete(streams)
    wait_ready(not_in={"worker-1": old["worker-1"]})


def test_rolling_restart_through_the_admin_api_under_streams(stack):
    old = incarnations()
    streams = start_streams()
    # Exit 0 when every worker is back (the containers exit 0; compose restarts them).
    compose("exec", "-T", "gateway", "zeroserve", "workers", "restart", "--all", timeout_s=600)
    assert_all_complete(streams)
    wait_ready(not_in=old)


def test_monitoring_profile_where_its_images_can_be_had(stack):
    """Prometheus and Grafana (profile `monitoring`) come from a registry. The test uses them
    where the engine already has them (`docker compose --profile monitoring pull` where a
    registry is reachable) and never reaches out for them itself: where they are missing it
    says so and skips them (and only them)."""
    images = ("prom/prometheus:latest", "grafana/grafana:latest")
    missing = [image for image in images
               if subprocess.run(["docker", "image", "inspect", image], capture_output=True,
                                 timeout=60).returncode != 0]
    if missing:
        pytest.skip(f"monitoring profile skipped: {', '.join(missing)} not on this engine "
                    "(no registry reachable here)")
    compose("--profile", "monitoring", "up", "-d", "--pull", "never", "prometheus", "grafana")
    wait_until(lambda: get_ok("http://127.0.0.1:9090/-/ready"), 180, "Prometheus ready")
    wait_until(lambda: get_ok("http://127.0.0.1:3000/api/health"), 180, "Grafana ready")


def get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_down_leaves_nothing_running(stack):
    compose("--profile", "monitoring", "down", "-v", "--timeout", "60", timeout_s=300)
    label = f"label=com.docker.compose.project={PROJECT}"
    assert docker("ps", "-aq", "--filter", label).strip() == ""
    assert docker("network", "ls", "-q", "--filter", label).strip() == ""
    assert docker("volume", "ls", "-q", "--filter", label).strip() == ""
    with pytest.raises(httpx.HTTPError):
        httpx.get(URL + "/health", timeout=5)
