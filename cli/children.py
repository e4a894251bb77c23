"""Which of `zeroserve serve`'s children have become ready, asked of the gateway over HTTP.

The supervisor cannot see readiness itself: a worker is ready once the gateway has answered
its HELLO with READY, which happens inside the gateway. So the supervisor's readiness probe
asks the gateway, on loopback:

- a gateway child is ready once `GET /health/live` answers with the pid we started (a
  different process on that port, the classic "port in use", does not count). Several
  gateways share the port (`serve --gateways N`, SO_REUSEPORT) and the kernel picks which
  one answers a new connection, so the probe asks a few times per round;
- a worker child is ready once `GET /health` lists its id as `ready` with the pid we started
  (a stale entry of an earlier incarnation does not count for a new one).

The probe runs only until every child has been ready once (see cli/supervisor.py), so in
steady state it costs nothing. A second probe (`GatewayWorkerWatch`) runs all along, every
few seconds: it names the worker children that the gateway reports lost (in `/health`'s
`lost_workers`) or stalled (`unhealthy`) with the pid we started, and the supervisor kills
and restarts one that stays so past `--worker-replace-timeout`. With API keys on, the gateway shows pids and worker ids only
to callers with a key, so the probe sends one (`serve` gives it the first key).

A third (`GatewayExitNotice`) runs when the supervisor reaps a worker child: it tells the
gateway at once (`POST /admin/workers/{id}/exited` with the pid that exited, with admin
rights: the admin key, or keyless from loopback with this user's admin token), so that the
gateway takes that process out and moves its streams on at once instead of when its
heartbeats lapse; the gateway ignores a notice whose pid is not the process it holds under
that id. With `--gateways N` sharing the port, the kernel picks the gateway each new
connection reaches, so the notice is sent until every gateway (by its pid) has answered, a
bounded number of times.

It imports nothing from the CLI but its admin client (the notice is an admin call, sent as
`zeroserve workers` sends its own: the admin key, and this user's admin token to a loopback
gateway), so the dependency runs one way: cli/main.py -> cli/children.py, cli/main.py ->
cli/supervisor.py.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from zeroserve.cli.admin_client import AdminClient, AdminError

GATEWAY_CHILD = "gateway"
_TIMEOUT_S = 1.0
_LIVE_ASKS_PER_GATEWAY = 3  # per probe round, while some gateway has not answered yet
# An exit notice is sent up to this many times per gateway until each one has answered
# (`serve --gateways N`: the kernel spreads new connections over them at random).
_NOTICE_ASKS_PER_GATEWAY = 6
# A notice waits longer for its answer than a probe: a gateway under load answers late, and
# a notice given up on leaves the worker's streams waiting for its heartbeats to lapse.
_NOTICE_TIMEOUT_S = 5.0


def gateway_child_names(num_gateways: int) -> list[str]:
    """"gateway" for one (as ever), "gateway-0" ... "gateway-(N-1)" for several."""
    if num_gateways == 1:
        return [GATEWAY_CHILD]
    return [f"{GATEWAY_CHILD}-{i}" for i in range(num_gateways)]


def is_gateway_child(name: str) -> bool:
    return name == GATEWAY_CHILD or name.startswith(GATEWAY_CHILD + "-")


def local_url(host: str, port: int) -> str:
    """The URL a process on this machine reaches a server bound to `host:port` at."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _get_json(url: str, api_key: str | None = None) -> dict | None:
    """The JSON body of a GET, whatever the status (503 carries a body too); None if none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=_TIMEOUT_S) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        body = e.read()
    except OSError:
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


class GatewayReadiness:
    """A `ReadinessProbe` for `serve`: pids by child name -> names of the ready ones."""

    def __init__(self, base_url: str, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key

    def __call__(self, pids: dict[str, int]) -> set[str]:
        ready = set()
        gateways = {pid: name for name, pid in pids.items() if is_gateway_child(name)}
        for _ in range(_LIVE_ASKS_PER_GATEWAY * len(gateways)):
            live = _get_json(self.base_url + "/health/live", self.api_key)
            if live is None:
                break
            if live.get("pid") in gateways:
                ready.add(gateways[live.get("pid")])
            if len(ready) == len(gateways):
                break
        workers = {name: pid for name, pid in pids.items() if not is_gateway_child(name)}
        if workers:
            health = _get_json(self.base_url + "/health", self.api_key) or {}
            for entry in health.get("workers") or []:
                if not isinstance(entry, dict):
                    continue
                name = entry.get("worker_id")
                if (entry.get("status") == "ready" and name in workers
                        and entry.get("pid") == workers[name]):
                    ready.add(name)
        return ready


# What /health says of a worker that the gateway holds but cannot use: "unhealthy" is a
# worker whose engine made no progress for the gateway's stall timeout.
_STALLED_STATUSES = ("unhealthy",)


class GatewayWorkerWatch:
    """An `UnresponsiveProbe` for `serve`: pids of the running worker children by name ->
    the names the gateway reports lost (expired for silence: SIGSTOPped, hung with its I/O
    thread, cut off) or stalled (its heartbeats say its engine makes no progress), each with
    the very pid we started, so that an old incarnation's entry never condemns a new one.
    Unlike readiness this runs for the supervisor's whole life."""

    def __init__(self, base_url: str, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key

    def __call__(self, pids: dict[str, int]) -> set[str] | None:
        """None when the gateway did not answer (nothing is known, nothing is condemned)."""
        workers = {name: pid for name, pid in pids.items() if not is_gateway_child(name)}
        if not workers:
            return set()
        health = _get_json(self.base_url + "/health", self.api_key)
        if health is None or "workers" not in health:
            return None
        bad = set()
        for entry in [*(health.get("lost_workers") or []), *(health.get("workers") or [])]:
            if not isinstance(entry, dict):
                continue
            name = entry.get("worker_id")
            is_bad = "lost_s" in entry or entry.get("status") in _STALLED_STATUSES
            if is_bad and name in workers and entry.get("pid") == workers[name]:
                bad.add(name)
        return bad


class GatewayExitNotice:
    """An `ExitNotice` for `serve`: a worker child's process exited (reaped, so certainly
    dead): each gateway takes that process out now and fails its streams over, as when its
    heartbeats lapse, only sooner. A gateway child's exit is nobody's to tell."""

    def __init__(self, base_url: str, admin_key: str | None = None, num_gateways: int = 1):
        self.base_url = base_url.rstrip("/")
        self.admin_key = admin_key
        self.num_gateways = num_gateways

    def __call__(self, name: str, pid: int, exit_code: int) -> set[int]:
        """The pids of the gateways that heard it (at most `num_gateways`)."""
        if is_gateway_child(name):
            return set()
        client = AdminClient(self.base_url, self.admin_key, timeout_s=_NOTICE_TIMEOUT_S)
        told: set[int] = set()
        for _ in range(_NOTICE_ASKS_PER_GATEWAY * self.num_gateways):
            try:
                answer = client.worker_exited(name, pid, exit_code)
            except (AdminError, ValueError):
                break  # refused or not answering: the heartbeat path remains
            if not isinstance(answer, dict):
                break
            told.add(answer.get("gateway_pid"))
            if len(told) >= self.num_gateways:
                break
        return told
