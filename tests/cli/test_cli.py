"""The `zeroserve` CLI: flags and ZEROSERVE_* variables become the right frozen configs, bad
values are clean usage errors, and `serve` hands its children flags that rebuild its configs."""

from __future__ import annotations

import sys
import types

import click
import pytest
from click.testing import CliRunner

from zeroserve.cli import main as cli
from zeroserve.cli.child_args import engine_args, gateway_args
from zeroserve.cli.devices import count_cuda_devices, worker_devices
from zeroserve.cli.params import ENV_PREFIX, ByteSize
from zeroserve.cli.supervisor import Supervisor
from zeroserve.cli.worker import worker
from zeroserve.worker.config import BatchingMode, EngineConfig
from zeroserve.worker.speculative import SpeculativeConfig


@pytest.fixture
def captured(monkeypatch):
    """Replace the blocking entry points; record the configs they were given."""
    seen: dict[str, object] = {}
    from zeroserve.worker import process as worker_process

    def fake_run_worker(config, engine=None):
        seen["worker"] = config
        return 0

    monkeypatch.setattr(worker_process, "run_worker", fake_run_worker)
    monkeypatch.setattr(worker_process, "build_engine", lambda config: None)
    server = types.ModuleType("zeroserve.gateway.server")
    server.run_gateway = lambda config: seen.__setitem__("gateway", config)
    monkeypatch.setitem(sys.modules, "zeroserve.gateway.server", server)

    def fake_supervise(self):
        seen["children"] = [c.spec for c in self.children]
        return 0

    monkeypatch.setattr(Supervisor, "run", fake_supervise)
    for name in list(__import__("os").environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    return seen


def invoke(args, env=None):
    return CliRunner().invoke(cli.main, args, env=env or {}, catch_exceptions=False)


@pytest.mark.parametrize("command", [[], ["serve"], ["gateway"], ["worker"]])
def test_help(command):
    result = invoke([*command, "--help"])
    assert result.exit_code == 0
    assert "Usage:" in result.output
    if command:
        assert "ZEROSERVE_" in result.output


def test_worker_flags_build_the_configs(captured):
    result = invoke([
        "worker", "--worker-id", "w7", "--router-address", "tcp://gw:5555",
        "--tokens-address", "tcp://gw:5556", "--device", "cpu", "--dtype", "float32",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--max-model-len", "1024",
        "--block-size", "32", "--kv-cache-memory", "512MiB", "--no-enable-prefix-caching",
        "--batching-mode", "dynamic", "--batch-wait-ms", "20", "--num-threads", "2",
        "--backend", "fake", "--seed", "5", "--drain-timeout", "7", "--insecure",
    ])
    assert result.exit_code == 0, result.output
    config = captured["worker"]
    assert config.worker_id == "w7" and config.backend == "fake"
    assert config.router_address == "tcp://gw:5555" and config.tokens_address == "tcp://gw:5556"
    assert config.drain_timeout_s == 7.0
    assert config.engine == EngineConfig(
        model="default", device="cpu", dtype="float32", max_num_seqs=8,
        max_num_batched_tokens=128, max_model_len=1024, block_size=32,
        kv_cache_memory=512 * 2**20, enable_prefix_caching=False,
        batching_mode=BatchingMode.DYNAMIC, batch_wait_ms=20.0, num_threads=2, seed=5,
        speculative_config=SpeculativeConfig(),  # on unless --speculative-config null
    )


def test_environment_variables_fill_in_flags(captured):
    env = {"ZEROSERVE_MAX_NUM_SEQS": "3", "ZEROSERVE_NUM_KV_BLOCKS": "99",
           "ZEROSERVE_ENABLE_PREFIX_CACHING": "false", "ZEROSERVE_WORKER_ID": "from-env",
           "ZEROSERVE_PORT": "9123", "ZEROSERVE_KV_CACHE_MEMORY": "1GB"}
    assert invoke(["worker"], env).exit_code == 0
    config = captured["worker"]
    assert config.engine.max_num_seqs == 3 and config.engine.num_kv_blocks == 99
    assert config.engine.kv_cache_memory == 10**9
    assert not config.engine.enable_prefix_caching and config.worker_id == "from-env"
    from zeroserve.gateway.config import default_endpoints

    assert (config.router_address, config.tokens_address) == default_endpoints(9123)


def test_the_step_budget_follows_max_num_seqs_unless_given(captured):
    """1,000 sequences under the old fixed budget of 512 tokens decoded 512 a step: half
    the throughput asked for, silently."""
    assert invoke(["worker", "--max-num-seqs", "1000"]).exit_code == 0
    assert captured["worker"].engine.max_num_batched_tokens == 1000
    assert invoke(["worker", "--max-num-seqs", "8"]).exit_code == 0
    assert captured["worker"].engine.max_num_batched_tokens == 512
    assert invoke(["worker", "--max-num-seqs", "1000", "--max-num-batched-tokens", "300"]
                  ).exit_code == 0
    assert captured["worker"].engine.max_num_batched_tokens == 300


def test_the_prefill_cap_beside_decodes_is_a_flag_and_0_turns_it_off(captured):
    assert invoke(["worker"]).exit_code == 0
    assert captured["worker"].engine.max_prefill_tokens_with_decodes == 256
    assert invoke(["worker", "--max-prefill-tokens-with-decodes", "64"]).exit_code == 0
    assert captured["worker"].engine.max_prefill_tokens_with_decodes == 64
    assert invoke(["worker"], {"ZEROSERVE_MAX_PREFILL_TOKENS_WITH_DECODES": "0"}).exit_code == 0
    assert captured["worker"].engine.max_prefill_tokens_with_decodes is None


def test_a_flag_wins_over_its_variable(captured):
    assert invoke(["worker", "--max-num-seqs", "5"], {"ZEROSERVE_MAX_NUM_SEQS": "3"}).exit_code == 0
    assert captured["worker"].engine.max_num_seqs == 5


def test_gateway_flags_and_variables(captured):
    result = invoke(["gateway", "--port", "9001", "--credit-window", "8",
                     "--slow-client-timeout", "2.5", "--served-model-name", "tiny",
                     "--log-format", "json"],
                    {"ZEROSERVE_HOST": "0.0.0.0", "ZEROSERVE_MAX_QUEUED_REQUESTS": "4"})
    assert result.exit_code == 0, result.output
    config = captured["gateway"]
    assert (config.host, config.port, config.credit_window) == ("0.0.0.0", 9001, 8)
    assert config.slow_client_timeout_s == 2.5 and config.max_queued_requests == 4
    assert config.served_model_name == "tiny" and config.log_format == "json"


@pytest.mark.parametrize("args,env,fragment", [
    (["worker", "--block-size", "24"], {}, "power of two"),
    (["worker", "--max-num-seqs", "0"], {}, "max-num-seqs"),
    (["worker", "--kv-cache-memory", "lots"], {}, "not a size"),
    (["worker", "--device", "tpu"], {}, "cuda:N"),
    (["worker", "--backend", "magic"], {}, "backend"),
    (["worker", "--batching-mode", "eager"], {}, "batching-mode"),
    (["worker"], {"ZEROSERVE_MAX_NUM_SEQS": "many"}, "max-num-seqs"),
    (["gateway", "--port", "70000"], {}, "port"),
    (["gateway"], {"ZEROSERVE_PORT": "http"}, "port"),
    (["gateway", "--slow-client-timeout", "0"], {}, "must be > 0"),
    (["gateway", "--log-format", "xml"], {}, "log-format"),
    (["serve", "--workers", "0"], {}, "workers"),
])
def test_bad_values_are_usage_errors(captured, args, env, fragment):
    result = CliRunner().invoke(cli.main, args, env=env)
    assert result.exit_code == 2, result.output
    assert fragment in result.output
    assert "Traceback" not in result.output
    assert "worker" not in captured and "gateway" not in captured


def test_serve_children_rebuild_the_same_configs(captured, monkeypatch):
    result = invoke(["serve", "--workers", "2", "--device", "cpu", "--port", "9005",
                     "--max-num-seqs", "4", "--num-kv-blocks", "64", "--backend", "fake",
                     "--credit-window", "16", "--drain-timeout", "3",
                     "--fake-forward-ms", "2.5"])
    assert result.exit_code == 0, result.output
    gateway_spec, *worker_specs = captured["children"]
    assert gateway_spec.name == "gateway" and len(worker_specs) == 2
    assert [s.name for s in worker_specs] == ["worker-0", "worker-1"]
    # Workers stop (drain) before the gateway.
    assert all(s.stop_phase < gateway_spec.stop_phase for s in worker_specs)

    # Feed each child's argv back through the CLI: the configs must come out as serve meant.
    assert gateway_spec.argv[1:4] == ("-m", "zeroserve.cli", "gateway")
    assert invoke(list(gateway_spec.argv[3:])).exit_code == 0
    gateway = captured["gateway"]
    assert gateway.port == 9005 and gateway.credit_window == 16
    for spec in worker_specs:
        assert spec.argv[1:4] == ("-m", "zeroserve.cli", "worker")
        assert invoke(list(spec.argv[3:])).exit_code == 0
        config = captured["worker"]
        assert config.worker_id == spec.name and config.backend == "fake"
        assert config.engine.device == "cpu" and config.engine.max_num_seqs == 4
        assert config.engine.num_kv_blocks == 64 and config.drain_timeout_s == 3.0
        assert config.fake_forward_s == 0.0025
        assert (config.router_address, config.tokens_address) == gateway.endpoints


def test_engine_args_round_trip(captured):
    config = EngineConfig(model="/m.gguf", device="cuda:1", dtype="bfloat16", max_num_seqs=3,
                          max_num_batched_tokens=99, max_model_len=77, block_size=8,
                          num_kv_blocks=12, kv_cache_memory=4096, enable_prefix_caching=False,
                          batching_mode=BatchingMode.STATIC, batch_wait_ms=1.5,
                          num_threads=3, seed=11, batch_invariant=True,
                          int8_activations=True)
    assert invoke(["worker", *engine_args(config)]).exit_code == 0
    assert captured["worker"].engine == config
    assert invoke(["worker", *engine_args(EngineConfig())]).exit_code == 0
    assert captured["worker"].engine == EngineConfig()


def test_batch_invariance_is_off_unless_asked_for(captured, monkeypatch):
    assert invoke(["worker", "--device", "cpu"]).exit_code == 0
    assert captured["worker"].engine.batch_invariant is False
    monkeypatch.setenv("ZEROSERVE_BATCH_INVARIANT", "1")
    assert invoke(["worker", "--device", "cpu"]).exit_code == 0
    assert captured["worker"].engine.batch_invariant is True


@pytest.mark.parametrize("device,num_workers,num_gpus,expected", [
    ("auto", None, 0, ["cpu"]),
    ("auto", None, 2, ["cuda:0", "cuda:1"]),
    ("auto", 3, 2, ["cuda:0", "cuda:1", "cuda:0"]),
    ("cpu", 2, 4, ["cpu", "cpu"]),
    ("cuda", None, 1, ["cuda:0"]),
    ("cuda:1", 2, 2, ["cuda:1", "cuda:1"]),
])
def test_worker_devices(device, num_workers, num_gpus, expected):
    assert worker_devices(device, num_workers, num_gpus) == expected


def test_cuda_without_gpus_is_a_usage_error():
    with pytest.raises(click.UsageError):
        worker_devices("cuda", None, 0)


def test_cuda_visible_devices_is_respected(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert count_cuda_devices() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert count_cuda_devices() == 0


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
    ("1000", 1000), ("2k", 2000), ("3 KiB", 3072),
])
def test_byte_sizes(text, expected):
    assert ByteSize().convert(text, None, None) == expected


def test_every_engine_field_has_a_flag():
    flags = {p.name for p in worker.params}
    assert {f for f in EngineConfig.__dataclass_fields__} <= flags


@pytest.mark.slow  # imports torch and the model runner
def test_a_missing_model_is_a_clean_error(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    result = CliRunner().invoke(cli.main, ["worker", "--model", missing, "--device", "cpu"])
    assert result.exit_code == 1
    assert "cannot load the model" in result.output and missing in result.output
    assert "Traceback" not in result.output


def test_serve_with_two_gateways_gives_each_its_endpoints_and_every_worker_both(captured):
    result = invoke(["serve", "--gateways", "2", "--workers", "2", "--device", "cpu",
                     "--port", "9006", "--backend", "fake"])
    assert result.exit_code == 0, result.output
    *gateway_specs, worker_a, worker_b = captured["children"]
    assert [s.name for s in gateway_specs] == ["gateway-0", "gateway-1"]
    endpoints = []
    for spec in gateway_specs:
        assert invoke(list(spec.argv[3:])).exit_code == 0
        gateway = captured["gateway"]
        assert gateway.port == 9006 and gateway.reuse_port
        endpoints.append(gateway.endpoints)
    assert len(set(endpoints)) == 2
    for spec in (worker_a, worker_b):
        assert invoke(list(spec.argv[3:])).exit_code == 0
        assert captured["worker"].gateway_endpoints == endpoints


def test_serve_with_two_gateways_needs_an_address_per_gateway(captured):
    result = CliRunner().invoke(cli.main, ["serve", "--gateways", "2",
                                           "--router-address", "tcp://127.0.0.1:5555"])
    assert result.exit_code == 2 and "one per gateway" in result.output


def test_reasoning_tool_argument_and_store_flags_reach_the_gateway_and_its_children(captured):
    assert invoke(["gateway", "--reasoning-parser", "deepseek_r1",
                   "--allow-extra-tool-arguments", "--responses-dir", "/srv/responses",
                   "--response-store-size", "5", "--response-store-ttl", "60"]).exit_code == 0
    config = captured["gateway"]
    assert config.reasoning_parser == "deepseek_r1" and config.allow_extra_tool_arguments
    assert (config.responses_dir, config.response_store_size,
            config.response_store_ttl_s) == ("/srv/responses", 5, 60.0)
    assert invoke(["gateway", *gateway_args(config)]).exit_code == 0  # as serve's child
    child = captured["gateway"]
    names = ("reasoning_parser", "allow_extra_tool_arguments", "responses_dir",
             "response_store_size", "response_store_ttl_s")
    assert [getattr(child, n) for n in names] == [getattr(config, n) for n in names]
    assert invoke(["gateway"]).exit_code == 0
    assert captured["gateway"].reasoning_parser is None
    assert not captured["gateway"].allow_extra_tool_arguments
    result = CliRunner().invoke(cli.main, ["gateway", "--reasoning-parser", "gpt"])
    assert result.exit_code == 2 and "reasoning-parser" in result.output


@pytest.mark.parametrize("args, env, expected", [
    ([], {}, None),  # decided by device (worker/model/compiled.py)
    (["--enforce-eager"], {}, True),
    (["--no-enforce-eager"], {}, False),
    ([], {"ZEROSERVE_ENFORCE_EAGER": "1"}, True),
    ([], {"ZEROSERVE_ENFORCE_EAGER": "false"}, False),
])
def test_enforce_eager_flag_and_variable(captured, args, env, expected):
    base = ["worker", "--worker-id", "w", "--router-address", "ipc:///tmp/r",
            "--tokens-address", "ipc:///tmp/t"]
    assert invoke([*base, *args, "--max-capture-batch-size", "8"], env=env).exit_code == 0
    engine = captured["worker"].engine
    assert (engine.enforce_eager, engine.max_capture_batch_size) == (expected, 8)
    assert invoke(["worker", *engine_args(engine), *base[1:]]).exit_code == 0
    assert captured["worker"].engine == engine
def test_speculative_config_flag_and_variable(captured):
    text = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
            '"prompt_lookup_min": 2, "disable_by_batch_size": 4}')
    assert invoke(["worker", "--speculative-config", text]).exit_code == 0
    expected = SpeculativeConfig("ngram", 3, 5, 2, 4)
    assert captured["worker"].engine.speculative_config == expected
    assert invoke(["worker"], {"ZEROSERVE_SPECULATIVE_CONFIG": text}).exit_code == 0
    assert captured["worker"].engine.speculative_config == expected
    assert invoke(["worker", "--speculative-config", "null"], {
        "ZEROSERVE_SPECULATIVE_CONFIG": text}).exit_code == 0
    assert captured["worker"].engine.speculative_config is None
    # On by default: n-gram speculation that steps aside for batches above 8.
    assert invoke(["worker"]).exit_code == 0
    assert captured["worker"].engine.speculative_config == SpeculativeConfig()
    assert SpeculativeConfig().disable_by_batch_size == 8
    # Children get it explicitly, on or off.
    for value in (expected, None):
        config = EngineConfig(speculative_config=value)
        assert invoke(["worker", *engine_args(config)]).exit_code == 0
        assert captured["worker"].engine == config


@pytest.mark.parametrize("text, fragment", [
    ("{not json", "not valid JSON"),
    ('{"method": "eagle"}', "method"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
])
def test_bad_speculative_configs_are_usage_errors(captured, text, fragment):
    result = CliRunner().invoke(cli.main, ["worker", "--speculative-config", text])
    assert result.exit_code == 2, result.output
    assert fragment in result.output and "Traceback" not in result.output


def test_kv_tier_flags_reach_the_engine_config_and_serve_children(captured, tmp_path):
    result = invoke(["worker", "--kv-offloading-size", "0.5", "--kv-tier-dir", str(tmp_path),
                     "--kv-tier-dir-size", "2"])
    assert result.exit_code == 0, result.output
    engine = captured["worker"].engine
    assert (engine.kv_offloading_size, engine.kv_tier_dir, engine.kv_tier_dir_size) == (
        0.5, str(tmp_path), 2.0)
    assert engine.kv_offloading_dir is None
    assert EngineConfig().kv_offloading_size == 0  # off unless asked for
    assert invoke(["worker", *engine_args(engine)]).exit_code == 0  # what serve gives a child
    assert captured["worker"].engine == engine
