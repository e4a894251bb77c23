"""A class's share set through the admin API survives a gateway restart, until the limits
file changes that class's share (gateway/class_shares.py, issue 39)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.helpers import GatewayServer
from zeroserve.gateway.class_shares import ClassShares
from zeroserve.gateway.key_limits import load_priorities

pytestmark = pytest.mark.timeout(60)
ADMIN = {"Authorization": "Bearer sk-admin"}


def write_limits(path, sheddable_share: float, rps: float = 10.0) -> None:
    path.write_text(json.dumps({
        "classes": {"critical": {"share": 8}, "standard": {"share": 4},
                    "sheddable": {"share": sheddable_share}},
        "sk-a": {"requests_per_second": rps}}))


def shares_after_start(tmp_path) -> dict[str, float]:
    with GatewayServer(rate_limits_file=str(tmp_path / "limits.json"), api_keys=("sk-a",),
                       admin_keys=("sk-admin",),
                       class_shares_file=str(tmp_path / "state" / "shares.json")) as gw:
        r = httpx.get(gw.url + "/admin/classes", headers=ADMIN, timeout=10)
        assert r.status_code == 200, r.text
        return {c["name"]: c["share"] for c in r.json()["classes"]}


def test_an_admin_share_survives_a_restart_until_the_limits_file_changes_it(tmp_path):
    limits = tmp_path / "limits.json"
    write_limits(limits, 1)
    state = tmp_path / "state" / "shares.json"
    with GatewayServer(rate_limits_file=str(limits), api_keys=("sk-a",),
                       admin_keys=("sk-admin",), class_shares_file=str(state)) as gw:
        r = httpx.post(gw.url + "/admin/classes/sheddable/share", json={"share": 0.25},
                       headers=ADMIN, timeout=10)
        assert r.status_code == 200 and r.json()["kept_across_restart"] is True
    assert shares_after_start(tmp_path)["sheddable"] == 0.25  # restarted: still 0.25
    write_limits(limits, 1, rps=20)  # another setting edited: the admin's share holds
    assert shares_after_start(tmp_path)["sheddable"] == 0.25
    write_limits(limits, 2)  # the class's own share edited: the file wins from now on
    assert shares_after_start(tmp_path)["sheddable"] == 2
    write_limits(limits, 1)  # ... and the admin's old value does not come back
    assert shares_after_start(tmp_path)["sheddable"] == 1


def test_without_a_file_nothing_is_kept_and_a_bad_file_changes_nothing(tmp_path):
    classes = load_priorities(None, ()).classes
    assert ClassShares(None, classes).record("standard", 2.0) is False
    assert ClassShares(None, classes).restore() == {}
    bad = tmp_path / "shares.json"
    for text in ("not json", '{"shares": {"standard": {"share": -1, "file_share": 4}}}',
                 '{"shares": []}'):
        bad.write_text(text)
        assert ClassShares(bad, classes).restore() == {}
    kept = ClassShares(bad, classes)
    assert kept.record("standard", 3.0) and kept.record("nonexistent", 1.0)
    assert ClassShares(bad, classes).restore() == {"standard": 3.0}
