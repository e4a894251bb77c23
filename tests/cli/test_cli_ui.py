"""`--disable-ui` (and ZEROSERVE_DISABLE_UI) on `gateway` and `serve`: the web console off."""

from __future__ import annotations

from tests.cli.test_cli import captured, invoke  # noqa: F401 (captured is a fixture)


def test_the_console_is_on_by_default(captured):  # noqa: F811
    assert invoke(["gateway"]).exit_code == 0
    assert captured["gateway"].disable_ui is False


def test_disable_ui_flag_and_variable(captured):  # noqa: F811
    assert invoke(["gateway", "--disable-ui"]).exit_code == 0
    assert captured["gateway"].disable_ui is True
    assert invoke(["gateway"], {"ZEROSERVE_DISABLE_UI": "1"}).exit_code == 0
    assert captured["gateway"].disable_ui is True


def test_serve_passes_it_to_its_gateways(captured):  # noqa: F811
    assert invoke(["serve", "--backend", "fake", "--device", "cpu", "--disable-ui"]).exit_code == 0
    gateway_spec = captured["children"][0]
    assert "--disable-ui" in gateway_spec.argv
    assert invoke(list(gateway_spec.argv[3:])).exit_code == 0
    assert captured["gateway"].disable_ui is True
