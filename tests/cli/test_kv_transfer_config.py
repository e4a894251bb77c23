"""`--kv-transfer-config` (cli/kv_transfer_config.py): vLLM's shape for an offloading
connector and LMCache's names map onto the KV tier's flags; anything else is a usage error
that names the field and says what to use."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tests.cli.test_cli import captured, invoke  # noqa: F401 - fixture
from zeroserve.cli import main as cli
from zeroserve.cli.child_args import engine_args
from zeroserve.cli.kv_transfer_config import KVTransferConfigError, parse_kv_transfer_config

GIB = 1 << 30


def parse(extra: dict | None = None, connector: str = "OffloadingConnector", **top) -> dict:
    config = {"kv_connector": connector, "kv_role": "kv_both", **top}
    if extra is not None:
        config["kv_connector_extra_config"] = extra
    return parse_kv_transfer_config(json.dumps(config), block_size=16)


@pytest.mark.parametrize(("extra", "connector", "expected"), [
    ({"cpu_bytes_to_use": 2 * GIB}, "OffloadingConnector", {"kv_offloading_size": 2.0}),
    ({"cpu_bytes_to_use": GIB, "spec_name": "CPUOffloadingSpec", "block_size": 16},
     "OffloadingConnector", {"kv_offloading_size": 1.0}),
    ({"local_cpu": True, "max_local_cpu_size": 4}, "LMCacheConnectorV1",
     {"kv_offloading_size": 4.0}),
    ({}, "LMCacheConnectorV1", {"kv_offloading_size": 5.0}),  # LMCache's own defaults
    ({"lmcache.max_local_cpu_size": 1.5, "lmcache.local_disk": "file:///var/kv/",
      "lmcache.max_local_disk_size": 100}, "LMCacheConnectorV1",
     {"kv_offloading_size": 1.5, "kv_tier_dir": "/var/kv/", "kv_tier_dir_size": 100.0}),
    ({"local_cpu": False, "local_disk": "/var/kv", "max_local_disk_size": 50},
     "LMCacheConnectorV1", {"kv_offloading_dir": "/var/kv", "kv_offloading_size": 50.0}),
    ({"local_cpu": False}, "LMCacheConnectorV1", {"kv_offloading_size": 0.0}),
])
def test_vllm_and_lmcache_configs_map_onto_the_tier(extra, connector, expected):
    assert parse(extra, connector) == expected


@pytest.mark.parametrize(("config", "fragment"), [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "kv_connector: 'NixlConnector'"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "kv_producer"}, "kv_role: 'kv_producer'"),
    ({"kv_connector": "OffloadingConnector", "kv_ip": "10.0.0.1"}, "kv_ip: not supported"),
    ({"kv_connector": "LMCacheConnectorV1",
      "kv_connector_extra_config": {"remote_url": "lm://cache:65432"}},
     "kv_connector_extra_config.remote_url: not supported: the KV tier is per box"),
    ({"kv_connector": "LMCacheConnectorV1",
      "kv_connector_extra_config": {"lmcache.local_disk": "s3://bucket/kv"}},
     "kv_connector_extra_config.lmcache.local_disk: 's3://bucket/kv': only a local folder"),
    ({"kv_connector": "OffloadingConnector",
      "kv_connector_extra_config": {"num_cpu_blocks": 1000}},
     "kv_connector_extra_config.num_cpu_blocks: not supported: give cpu_bytes_to_use"),
    ({"kv_connector": "OffloadingConnector",
      "kv_connector_extra_config": {"cpu_bytes_to_use": GIB, "block_size": 64}},
     "kv_connector_extra_config.block_size: 64: the tier keeps the KV pool's blocks"),
    ({"kv_connector": "OffloadingConnector",
      "kv_connector_extra_config": {"cpu_bytes_to_use": GIB,
                                    "spec_name": "TieringOffloadingSpec"}},
     "kv_connector_extra_config.spec_name: 'TieringOffloadingSpec' is not supported"),
    ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {}},
     "cpu_bytes_to_use (or max_local_cpu_size): the tier's size is required"),
    ({"kv_connector": "LMCacheConnectorV1",
      "kv_connector_extra_config": {"max_local_cpu_size": "lots"}},
     "kv_connector_extra_config.max_local_cpu_size: must be a number"),
    ({"kv_connector": "LMCacheConnectorV1",
      "kv_connector_extra_config": {"save_unfull_chunk": True}},
     "kv_connector_extra_config.save_unfull_chunk: not supported"),
    ({"kv_connector": "LMCacheConnectorV1",
      "kv_connector_extra_config": {"local_cpu": False, "local_disk": "/var/kv"}},
     "max_local_disk_size: required with local_cpu false"),
    ([1, 2], "must be a JSON object"),
])
def test_what_we_cannot_serve_is_an_error_naming_the_field(config, fragment):
    with pytest.raises(KVTransferConfigError) as raised:
        parse_kv_transfer_config(json.dumps(config), block_size=16)
    assert fragment in str(raised.value)


def test_not_json_is_an_error():
    with pytest.raises(KVTransferConfigError, match="not JSON"):
        parse_kv_transfer_config("{kv_connector: Offloading", block_size=16)


def test_the_flag_reaches_the_engine_config_and_serve_children(captured, tmp_path):  # noqa: F811
    config = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                         "kv_connector_extra_config": {
                             "max_local_cpu_size": 0.5, "local_disk": str(tmp_path),
                             "max_local_disk_size": 2}})
    result = invoke(["worker", "--kv-transfer-config", config])
    assert result.exit_code == 0, result.output
    engine = captured["worker"].engine
    assert (engine.kv_offloading_size, engine.kv_tier_dir, engine.kv_tier_dir_size) == (
        0.5, str(tmp_path), 2.0)
    assert invoke(["worker", *engine_args(engine)]).exit_code == 0  # what serve gives a child
    assert captured["worker"].engine == engine
    # The same from the environment, and a flag that agrees with it.
    env = {"ZEROSERVE_KV_TRANSFER_CONFIG": config}
    assert invoke(["worker", "--kv-offloading-size", "0.5"], env=env).exit_code == 0
    assert captured["worker"].engine == engine


@pytest.mark.parametrize(("args", "fragment"), [
    (["--kv-transfer-config", '{"kv_connector": "MooncakeConnectorV1"}'],
     "kv_connector: 'MooncakeConnectorV1' is not supported"),
    (["--kv-offloading-size", "2", "--kv-transfer-config",
      '{"kv_connector": "OffloadingConnector", '
      '"kv_connector_extra_config": {"cpu_bytes_to_use": 1073741824}}'],
     "--kv-offloading-size 2.0 and --kv-transfer-config's 1.0 disagree"),
])
def test_bad_configs_are_usage_errors(captured, args, fragment):  # noqa: F811
    result = CliRunner().invoke(cli.main, ["worker", *args])
    assert result.exit_code == 2, result.output
    assert "--kv-transfer-config" in result.output
    assert fragment in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output
