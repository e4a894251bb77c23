"""ZEROSERVE_GATEWAY_CPU_PROFILE: a gateway profiled on request writes stats pstats reads."""

from __future__ import annotations

import pstats

from zeroserve.gateway.observability.cpu_profile import ENV_VAR, CpuProfile


def _busy() -> int:
    return sum(i * i for i in range(20_000))


def test_no_variable_no_profile(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert CpuProfile.from_env() is None


def test_profile_names_the_gateway_and_writes_once(monkeypatch, tmp_path):
    path = tmp_path / "gw.prof"
    monkeypatch.setenv(ENV_VAR, str(path))
    assert CpuProfile.from_env(2).path == f"{path}.2"  # a tier's other gateways
    profile = CpuProfile.from_env(0)
    profile.start()
    _busy()
    profile.stop()
    profile.stop()  # the server's shutdown and its run() both stop it: written once
    stats = pstats.Stats(str(path))
    assert any(name == "_busy" for _, _, name in stats.stats)
