"""The Kubernetes manifests (deploy/kubernetes), rendered with `kubectl kustomize` and read
back as objects, for tests that run without a cluster."""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from zeroserve.cli.harness import REPO_ROOT

KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "second-model")
# Every kustomization there is: the base, and each overlay.
TARGETS = ("base", *(f"overlays/{name}" for name in OVERLAYS))


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed: the manifests cannot be rendered "
                    "(https://kubernetes.io/docs/tasks/tools/)")
    return path


@functools.cache
def _render(target: str) -> str:
    result = subprocess.run([kubectl(), "kustomize", str(KUBERNETES / target)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {target}: {result.stderr}"
    return result.stdout


def render(target: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(_render(target)) if doc]


class Manifests:
    """One rendered target's objects, found by kind and name."""

    def __init__(self, target: str):
        self.target = target
        self.objects = render(target)

    def get(self, kind: str, name: str) -> dict:
        found = [o for o in self.objects
                 if o["kind"] == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.target}: {kind}/{name} x {len(found)}"
        return found[0]

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    @property
    def gateway(self) -> dict:
        return self.get("Deployment", "gateway")

    @property
    def worker(self) -> dict:
        return self.get("StatefulSet", "worker")


def container(workload: dict, name: str | None = None) -> dict:
    containers = workload["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def env_value(c: dict, name: str) -> str | None:
    """A plain `value` of the container's environment (None if absent or from a ref)."""
    for var in c.get("env", []):
        if var["name"] == name:
            return var.get("value")
    return None


def setting(c: dict, name: str) -> str | None:
    """A flag's value from the command, else from its ZEROSERVE_* variable."""
    from zeroserve.cli.main import env_name

    return flag(c["command"], name) or env_value(c, env_name(name))


def named_ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def load_yaml(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
