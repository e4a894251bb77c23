"""`serve` with several models: a worker group per --add-model, aliases and versions reaching
the gateway and the workers as serve meant them; `zeroserve models` against a gateway."""

from __future__ import annotations

from click.testing import CliRunner

from tests.cli.test_cli import captured, invoke  # noqa: F401  (a fixture)
from zeroserve.cli import main as cli


def test_serve_starts_a_worker_group_per_model(captured, tmp_path):  # noqa: F811
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(b"")
    result = invoke(["serve", "--device", "cpu", "--backend", "fake", "--port", "9011",
                     "--served-model-name", "smollm", "--model-version", "v1",
                     "--add-model", f"smollm@v2={tiny}", "--add-model", f"tiny={tiny}:2",
                     "--model-alias", "chat=smollm@v1:90,smollm@v2:10"])
    assert result.exit_code == 0, result.output
    gateway_spec, *worker_specs = captured["children"]
    assert [s.name for s in worker_specs] == ["worker-0", "smollm-v2-0", "tiny-v1-0",
                                              "tiny-v1-1"]
    assert invoke(list(gateway_spec.argv[3:])).exit_code == 0
    gateway = captured["gateway"]
    assert gateway.extra_models == (f"smollm@v2={tiny}", f"tiny={tiny}")
    assert gateway.model_aliases == ("chat=smollm@v1:90,smollm@v2:10",)
    announced = []
    for spec in worker_specs:
        assert invoke(list(spec.argv[3:])).exit_code == 0
        worker = captured["worker"]
        announced.append((worker.served_model_name, worker.model_version, worker.engine.model))
    assert announced == [("", "v1", "default"), ("smollm", "v2", str(tiny)),
                         ("tiny", "v1", str(tiny)), ("tiny", "v1", str(tiny))]


def test_serve_takes_model_repeated_with_a_worker_count_each(captured, tmp_path,  # noqa: F811
                                                              monkeypatch):
    tiny = tmp_path / "tiny model.gguf"  # a space: the environment variable is read whole
    tiny.write_bytes(b"")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"")
    monkeypatch.setenv("ZEROSERVE_MODEL", str(tiny))
    assert invoke(["serve", "--device", "cpu", "--backend", "fake", "--port", "9012"]
                  ).exit_code == 0
    assert [s.name for s in captured["children"][1:]] == ["worker-0"]
    assert invoke(list(captured["children"][0].argv[3:])).exit_code == 0
    assert captured["gateway"].model == str(tiny)
    monkeypatch.delenv("ZEROSERVE_MODEL")
    result = invoke(["serve", "--device", "cpu", "--backend", "fake", "--port", "9013",
                     "--model", "default", "--model", str(tiny),
                     "--model", f"second@v3={other}:2"])
    assert result.exit_code == 0, result.output
    gateway_spec, *worker_specs = captured["children"]
    assert [s.name for s in worker_specs] == ["worker-0", "tiny-model-v1-0", "second-v3-0",
                                              "second-v3-1"]
    assert invoke(list(gateway_spec.argv[3:])).exit_code == 0
    assert captured["gateway"].model == "default"
    assert captured["gateway"].extra_models == (f"tiny model={tiny}", f"second@v3={other}")


def test_bad_models_and_aliases_are_usage_errors(captured, tmp_path):  # noqa: F811
    for args, fragment in [
            (["--add-model", "no-path"], "NAME[@VERSION]=PATH"),
            (["--add-model", "tiny=/x.gguf:0"], "WORKERS >= 1"),
            (["--model-alias", "chat=gpt:1"], "not a served model"),
            (["--model-alias", "chat=default:x"], "not a number")]:
        result = CliRunner().invoke(cli.main, ["gateway", *args])
        assert result.exit_code == 2 and fragment in result.output, result.output


def test_models_commands_talk_to_the_admin_api():
    from tests.gateway.helpers import GatewayServer, byte_tokenizer

    with GatewayServer(served_model_name="smollm", extra_models=("tiny=/none.gguf",),
                       model_aliases=("chat=smollm:1,tiny:3",),
                       tokenizers={"tiny": byte_tokenizer()}) as gw:
        worker = gw.worker(worker_id="tiny-0", served_model_name="tiny",
                           model_version="v7").start()
        assert worker.ready.wait(5)
        listing = CliRunner().invoke(cli.main, ["models", "list", "--url", gw.url])
        assert listing.exit_code == 0, listing.output
        assert "smollm [default]" in listing.output and "@v7" in listing.output
        assert "tiny-0 (ready)" in listing.output
        assert "alias chat: smollm 25.0%, tiny 75.0%" in listing.output
        changed = CliRunner().invoke(cli.main, ["models", "set-weights", "chat", "smollm=1",
                                                "tiny=1", "--url", gw.url, "--url", gw.url])
        assert changed.exit_code == 0, changed.output
        assert changed.output.count("alias chat: smollm 50.0%, tiny 50.0%") == 2
        refused = CliRunner().invoke(cli.main, ["models", "set-weights", "chat", "gpt=1",
                                                "--url", gw.url])
        assert refused.exit_code == 1 and "not a served model" in refused.output
        worker.stop()
