"""Gateway config validation and ipc endpoint preparation."""

from __future__ import annotations

import socket

import pytest

from zeroserve.gateway.config import (
    EndpointInUseError,
    GatewayConfig,
    default_endpoints,
    prepare_ipc_endpoint,
)


def test_default_endpoints_are_per_port_ipc():
    router, tokens = default_endpoints(8000)
    assert router.startswith("ipc://") and tokens.startswith("ipc://")
    assert router != tokens and "8000" in router and default_endpoints(8001)[0] != router
    cfg = GatewayConfig(port=9000, tokens_address="tcp://127.0.0.1:5555", insecure=True)
    assert cfg.endpoints == (default_endpoints(9000)[0], "tcp://127.0.0.1:5555")


@pytest.mark.parametrize("bad", [dict(credit_window=0), dict(port=70000),
                                 dict(log_format="xml"), dict(worker_timeout_s=0.1),
                                 dict(max_queued_requests=-1), dict(queue_timeout_s=0)])
def test_invalid_config_is_refused(bad):
    with pytest.raises(ValueError):
        GatewayConfig(**bad)


def test_stale_socket_file_is_removed_but_a_live_one_is_not(tmp_path):
    path = tmp_path / "sub" / "gw.sock"
    prepare_ipc_endpoint(f"ipc://{path}")  # creates the folder
    assert path.parent.is_dir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    with pytest.raises(EndpointInUseError):
        prepare_ipc_endpoint(f"ipc://{path}")
    server.close()  # the process "died": its file stays behind, stale
    assert path.exists()
    prepare_ipc_endpoint(f"ipc://{path}")
    assert not path.exists()
    prepare_ipc_endpoint("tcp://127.0.0.1:1")  # not a file: nothing to do


def test_tcp_without_keys_is_refused_unless_insecure():
    from zeroserve.common.keys import InsecurePlaneError

    with pytest.raises(InsecurePlaneError, match="--keys-dir"):
        GatewayConfig(router_address="tcp://0.0.0.0:5555")
    GatewayConfig(router_address="tcp://0.0.0.0:5555", insecure=True)
    GatewayConfig(router_address="tcp://0.0.0.0:5555", keys_dir="/some/keys")


def test_an_ipc_folder_open_to_others_is_refused(tmp_path):
    from zeroserve.common.keys import InsecurePlaneError

    folder = tmp_path / "shared"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with pytest.raises(InsecurePlaneError, match="mode 700"):
        prepare_ipc_endpoint(f"ipc://{folder}/gw.sock")
    folder.chmod(0o700)
    prepare_ipc_endpoint(f"ipc://{folder}/gw.sock")
