"""The Kubernetes pods, run as local processes: deploy/kubernetes/overlays/cpu rendered, and
each pod's own init script, command and environment launched on this machine.

Two gateway "pods", each with an address of its own (a loopback address, all ports the
same, as pods have), two worker pods (`--backend fake`) that find the gateways by the name
of the headless Service, resolved by a stub DNS whose answer the test changes (what the
cluster's DNS does as pods come and go). Requests are served through both gateways; one
gateway pod is deleted (gone from DNS, then SIGTERM, as the kubelet does) while streams run
on both: the other's streams all finish, its own finish during its drain; then a new pod
takes its place and the workers link to it again.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.kube import Manifests, container
from tests.e2e.helpers import MODEL, stream_in_thread
from zeroserve.cli.harness import REPO_ROOT, ServerProcess, child_env, free_ports_on, zeroserve_argv

pytestmark = pytest.mark.slow

API_KEY = "sk-test-serving"
ADMIN_KEY = "sk-test-admin"
SECRET_VALUES = {("zeroserve-api-keys", "api-keys"): API_KEY,
                 ("zeroserve-api-keys", "metrics-key"): API_KEY,
                 ("zeroserve-api-keys", "admin-key"): ADMIN_KEY}

# `zeroserve` with getaddrinfo answering from a JSON file ({name: [address, ...]}), re-read
# on every lookup: the cluster DNS, as the test makes it.
DNS_STUB = """
import json, os, socket, sys
_real = socket.getaddrinfo
def _lookup(host, *args, **kwargs):
    with open(os.environ["TEST_DNS_TABLE"]) as f:
        table = json.load(f)
    if host not in table:
        return _real(host, *args, **kwargs)
    if not table[host]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    return [info for address in table[host] for info in _real(address, *args, **kwargs)]
socket.getaddrinfo = _lookup
sys.argv[0] = "zeroserve"
from zeroserve.cli.main import main
main()
"""


class Cluster:
    """What Kubernetes would do for these pods: addresses, ports, Secrets, DNS."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.m = Manifests("overlays/cpu")
        base = f"127.{random.randint(1, 250)}.{random.randint(1, 250)}"
        self.pod_ips = [f"{base}.{i}" for i in range(1, 4)]
        gw = container(self.m.gateway)
        # The manifest's ports (8000, 5555, 5556) may be taken on this shared machine: use
        # free ones, the same on every pod address, as the manifests' ports are.
        self.ports = dict(zip([p["containerPort"] for p in gw["ports"]],
                              free_ports_on(self.pod_ips, len(gw["ports"])), strict=True))
        self.dns_table = tmp_path / "dns.json"
        self.dns: dict[str, list[str]] = {}
        self.keys = tmp_path / "keyset"
        subprocess.run(zeroserve_argv("keys", "generate", str(self.keys), "--workers", "2"),
                       env=child_env(), check=True, capture_output=True, timeout=60)
        self.processes: list[ServerProcess] = []

    def set_dns(self, name: str, addresses: list[str]) -> None:
        self.dns[name] = addresses
        tmp = self.dns_table.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.dns))
        tmp.replace(self.dns_table)  # atomically: a lookup never reads half a file

    # -- a pod's pieces ----------------------------------------------------------------------

    def secret_volume(self, name: str, pod: str) -> Path:
        """The Secret's items as a volume: flat files named by key."""
        folder = self.tmp / pod / "secret"
        folder.mkdir(parents=True)
        workers = self.keys / "workers"
        if name == "zeroserve-gateway-keys":
            files = [self.keys / "gateway.key_secret", *workers.glob("*.key")]
        else:
            files = [self.keys / "gateway.key", *workers.glob("*.key_secret")]
        for f in files:
            (folder / f.name).write_bytes(f.read_bytes())
            (folder / f.name).chmod(0o440)
        return folder

    def run_init(self, workload: dict, pod: str) -> Path:
        """The pod's init container: its script with the mounts at local paths."""
        (init,) = workload["spec"]["template"]["spec"]["initContainers"]
        mounts = {v["name"]: v["mountPath"] for v in init["volumeMounts"]}
        secret_name = next(v for v in workload["spec"]["template"]["spec"]["volumes"]
                           if "secret" in v)["secret"]["secretName"]
        secret = self.secret_volume(secret_name, pod)
        keys = self.tmp / pod / "keys"
        keys.mkdir()
        secret_mount = next(path for n, path in mounts.items() if n != "keys")
        script = init["command"][2].replace(secret_mount, str(secret)) \
            .replace(mounts["keys"], str(keys))
        subprocess.run(["sh", "-c", script], env={"POD_NAME": pod, "PATH": "/usr/bin:/bin"},
                       check=True, timeout=10)
        return keys

    def env(self, c: dict, pod: str) -> dict[str, str]:
        env = {"TEST_DNS_TABLE": str(self.dns_table)}
        for var in c.get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
            elif "fieldRef" in var["valueFrom"]:
                assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
                env[var["name"]] = pod
            else:
                ref = var["valueFrom"]["secretKeyRef"]
                env[var["name"]] = SECRET_VALUES[ref["name"], ref["key"]]
        return env

    def localize(self, command: list[str], pod_ip: str | None, keys: Path) -> list[str]:
        out = []
        for arg in command:
            # A port at the end of an address, or alone as a flag's value.
            arg = re.sub(r"(?<=:)(\d+)$|^(\d+)$",
                         lambda m: str(self.ports.get(int(m.group(0)), m.group(0))), arg)
            if pod_ip is not None:
                arg = arg.replace("0.0.0.0", pod_ip)
            out.append(str(keys) if arg == "/run/zeroserve-keys" else arg)
        assert out[0] == "zeroserve"
        return out

    # -- pods --------------------------------------------------------------------------------

    def start_gateway(self, pod: str, pod_ip: str) -> ServerProcess:
        keys = self.run_init(self.m.gateway, pod)
        c = container(self.m.gateway)
        argv = zeroserve_argv(*self.localize(c["command"], pod_ip, keys)[1:])
        # Bound to a loopback "pod address", the gateway would answer only loopback Host
        # names (gateway/http/host_check.py); bound to 0.0.0.0 in its pod, it answers any,
        # such as the Service name the workers' readiness probe uses.
        env = {**self.env(c, pod), "ZEROSERVE_ALLOWED_HOSTS": "*"}
        process = ServerProcess(argv, self.ports[8000], self.tmp / f"{pod}.log", env)
        process.url = f"http://{pod_ip}:{self.ports[8000]}"
        self.processes.append(process)
        return process

    def start_worker(self, pod: str) -> ServerProcess:
        keys = self.run_init(self.m.worker, pod)
        c = container(self.m.worker)
        command = self.localize(c["command"], None, keys)
        assert "--gateway-dns" in command and "--device" in command
        # The fake backend: this checks the wiring, not the model.
        argv = [sys.executable, "-c", DNS_STUB, *command[1:], "--backend", "fake",
                "--fake-forward-ms", "20", "--num-kv-blocks", "512"]
        process = ServerProcess(argv, 0, self.tmp / f"{pod}.log", self.env(c, pod))
        self.processes.append(process)
        return process

    def readiness_probe(self, worker_pod: str) -> int:
        """The worker pod's own readiness probe, run as the kubelet would."""
        c = container(self.m.worker)
        command = self.localize(c["readinessProbe"]["exec"]["command"], None, Path("/"))
        result = subprocess.run([sys.executable, "-c", DNS_STUB, *command[1:]],
                                env=child_env(self.env(c, worker_pod)), cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=30)
        return result.returncode

    def stop(self) -> None:
        for process in self.processes:
            process.stop(timeout_s=5)


def client() -> httpx.Client:
    return httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)


def ready_workers(gateway: ServerProcess) -> set[str]:
    try:
        body = client().get(gateway.url + "/health").json()
    except (httpx.HTTPError, ValueError):
        return set()
    return {w["worker_id"] for w in body.get("workers", []) if w.get("status") == "ready"}


def wait_workers(gateway: ServerProcess, expected: set[str], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gateway._check_running()
        if ready_workers(gateway) >= expected:
            return
        time.sleep(0.2)
    raise AssertionError(f"{gateway.url}: workers {ready_workers(gateway)}, not {expected}:\n"
                         f"{gateway.log_tail()}")


def complete(gateway: ServerProcess) -> dict:
    r = client().post(gateway.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "Hello", "max_tokens": 5})
    assert r.status_code == 200, r.text
    return r.json()


def test_pods_serve_through_both_gateways_and_a_deleted_gateway_spares_the_others_streams(
        tmp_path):
    cluster = Cluster(tmp_path)
    name = plane_name(cluster)
    ip_a, ip_b, ip_c = cluster.pod_ips
    cluster.set_dns(name, [ip_a, ip_b])
    cluster.set_dns("gateway", [ip_a, ip_b])  # the HTTP Service (for the workers' probe)
    try:
        gw_a = cluster.start_gateway("gateway-a", ip_a)
        gw_b = cluster.start_gateway("gateway-b", ip_b)
        workers = [cluster.start_worker(f"worker-{i}") for i in range(2)]
        ids = {"worker-0", "worker-1"}
        for gw in (gw_a, gw_b):
            wait_workers(gw, ids, timeout_s=90)
        assert complete(gw_a)["usage"]["completion_tokens"] == 5
        assert complete(gw_b)["usage"]["completion_tokens"] == 5
        assert all(cluster.readiness_probe(w) == 0 for w in ids)

        # Streams on both gateways (about 4 s each at 20 ms a step); then gateway a's pod
        # is deleted: it leaves the DNS answer, and after its preStop gets SIGTERM.
        body = {"prompt": "count", "max_tokens": 200, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        on_b = [stream_in_thread(gw_b.url, body, client=client()) for _ in range(6)]
        on_a = [stream_in_thread(gw_a.url, body, client=client()) for _ in range(2)]
        time.sleep(1.0)
        cluster.set_dns(name, [ip_b])
        cluster.set_dns("gateway", [ip_b])
        gw_a.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        # Once the gateway has taken the signal, a new request to it is refused at once (a
        # client retries on another replica) or finds the listener closed; one that arrives
        # before the signal is handled is still served whole.
        deadline = time.monotonic() + 10
        while True:
            try:
                r = client().post(gw_a.url + "/v1/completions",
                                  json={"model": MODEL, "prompt": "late", "max_tokens": 2})
            except httpx.TransportError:
                break
            if r.status_code == 503:
                break
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            assert time.monotonic() < deadline, "the draining gateway kept taking new requests"
            time.sleep(0.05)
        for thread, result in on_b + on_a:
            thread.join(60)
            assert result.exception is None and result.error is None, result
            assert result.is_done and result.finish_reason == "length"
            assert result.usage["completion_tokens"] == 200
        code = gw_a.process.wait(timeout=60)
        assert code in (0, -signal.SIGTERM), gw_a.log_tail()
        grace = cluster.m.gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert time.monotonic() - started < grace
        assert complete(gw_b)["usage"]["completion_tokens"] == 5
        # Both workers let the gone gateway's link end; gateway b kept them all along.
        for w in workers:
            assert _wait_log(w, "link to a gateway closed", 20), w.log_tail()
        assert ready_workers(gw_b) == ids

        # A new pod takes its place, at another address: the workers link to it.
        gw_c = cluster.start_gateway("gateway-c", ip_c)
        cluster.set_dns(name, [ip_b, ip_c])
        cluster.set_dns("gateway", [ip_b, ip_c])
        wait_workers(gw_c, ids, timeout_s=60)
        assert complete(gw_c)["usage"]["completion_tokens"] == 5
        assert all(w.process.poll() is None for w in workers)
    finally:
        cluster.stop()


def plane_name(cluster: Cluster) -> str:
    """The name workers resolve to find the gateways (--gateway-dns)."""
    command = container(cluster.m.worker)["command"]
    return command[command.index("--gateway-dns") + 1]


def _wait_log(process: ServerProcess, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in process.log_tail(400):
            return True
        time.sleep(0.2)
    return False
