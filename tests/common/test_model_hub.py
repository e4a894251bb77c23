"""`--model org/name` from the Hugging Face Hub, against a local stand-in of the Hub's HTTP
endpoint (HF_ENDPOINT) serving a tiny Qwen2 model: downloaded into huggingface_hub's cache,
served from there, found again with HF_HUB_OFFLINE=1, and, under `serve`, fetched once for
the gateway and every worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.common.hub_stand_in import COMMIT, HubStandIn
from zeroserve.cli.harness import REPO_ROOT, child_env
from zeroserve.common.model_files import hub_repo, model_display_name

REPO = "tiny-org/tiny-qwen2"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_repo(directory: Path) -> Path:
    """A tiny Qwen2 model as a Hub repository holds it: config, safetensors, a byte-level
    tokenizer (256 bytes + 3 special tokens) and its config with a chat template, plus a file
    serving never needs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tests.worker.arch_models import make_model
    from zeroserve.gateway.text.tokenizer import byte_to_unicode

    model = make_model("qwen2", vocab_size=259, bos_token_id=None, eos_token_id=258)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = Tokenizer(models.BPE({c: b for b, c in byte_to_unicode().items()}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}))
    (directory / "pytorch_model.bin").write_bytes(b"not needed to serve")
    return directory


GGUF_REPO = "tiny-org/tiny-GGUF"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    repo = write_tiny_repo(tmp_path_factory.mktemp("repo"))
    gguf_repo = tmp_path_factory.mktemp("gguf-repo")
    for quant in ("Q4_K_M", "Q8_0"):  # stand-ins: only the file asked for may be fetched
        (gguf_repo / f"tiny.{quant}.gguf").write_bytes(b"GGUF" + quant.encode() * 1000)
    with HubStandIn({REPO: repo, GGUF_REPO: gguf_repo}) as stand_in:
        yield stand_in


def hub_env(hub: HubStandIn, home: Path, **extra: str) -> dict[str, str]:
    return child_env({"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_OFFLINE": "0",
                      "HF_HUB_DISABLE_TELEMETRY": "1", **extra})


def fetch(env: dict[str, str], model: str = REPO, revision: str | None = None):
    """common.model_files.fetch_model in a fresh process (huggingface_hub reads HF_ENDPOINT
    and HF_HUB_OFFLINE once, at import)."""
    code = ("import sys; from zeroserve.common.model_files import fetch_model; "
            "print(fetch_model(sys.argv[1], sys.argv[2] or None))")
    return subprocess.run([sys.executable, "-c", code, model, revision or ""], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def test_hub_ids_and_local_paths_are_told_apart(tmp_path):
    assert hub_repo("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert hub_repo("org/repo-GGUF/model.Q4_K_M.gguf") == ("org/repo-GGUF", "model.Q4_K_M.gguf")
    assert hub_repo("default") is None and hub_repo("model.gguf") is None
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub_repo(str(tmp_path / "org" / "name")) is None  # an existing path wins
    assert hub_repo("./org/name") is None
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    assert model_display_name(str(snapshot)) == "org/name" == model_display_name("org/name")


def test_download_into_the_hub_cache_then_offline(hub, tmp_path):
    env = hub_env(hub, tmp_path / "hf")
    before = hub.downloads("model.safetensors")  # other tests' caches share the stand-in
    done = fetch(env)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path == tmp_path / "hf" / "hub" / "models--tiny-org--tiny-qwen2" / "snapshots" / COMMIT
    assert {p.name for p in path.iterdir()} == {"config.json", "generation_config.json",
                                                "model.safetensors", "tokenizer.json",
                                                "tokenizer_config.json"}  # no *.bin
    assert hub.downloads("model.safetensors") == before + 1
    # Again: the cache answers, nothing is downloaded twice.
    assert fetch(env).stdout.strip().splitlines()[-1] == str(path)
    assert hub.downloads("model.safetensors") == before + 1
    # Offline, as transformers: served from the cache; a model never fetched is a clear error.
    offline = hub_env(hub, tmp_path / "hf", HF_HUB_OFFLINE="1")
    before = sum(hub.requests.values())
    assert fetch(offline).stdout.strip().splitlines()[-1] == str(path)
    assert sum(hub.requests.values()) == before
    missing = fetch(offline, "tiny-org/never-fetched")
    assert missing.returncode != 0 and "not in the Hugging Face cache" in missing.stderr


def test_one_gguf_file_of_a_repository(hub, tmp_path):
    done = fetch(hub_env(hub, tmp_path / "hf"), f"{GGUF_REPO}/tiny.Q4_K_M.gguf")
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path.name == "tiny.Q4_K_M.gguf" and path.read_bytes().startswith(b"GGUFQ4_K_M")
    assert hub.downloads("tiny.Q4_K_M.gguf") == 1 and hub.downloads("tiny.Q8_0.gguf") == 0
    assert model_display_name(str(path)) == "tiny.Q4_K_M"


def test_unknown_repository_and_revision_for_a_local_path_are_clear_errors(hub, tmp_path):
    env = hub_env(hub, tmp_path / "hf")
    unknown = fetch(env, "tiny-org/no-such-model")
    assert unknown.returncode != 0
    assert "cannot download tiny-org/no-such-model" in unknown.stderr
    local = fetch(env, "default", revision="v1")
    assert local.returncode != 0 and "--revision applies to Hub models" in local.stderr


@pytest.mark.slow
def test_serve_a_hub_model_fetched_once_for_gateway_and_workers(hub, tmp_path, zeroserve):
    """Two workers and a gateway from one download; the model's id is "org/name"; the tiny
    Qwen2 model answers a chat through its own chat template."""
    env = hub_env(hub, tmp_path / "hf")  # a fresh cache
    before = {f: hub.downloads(f) for f in ("model.safetensors", "tokenizer.json")}
    server = zeroserve(args=("--model", REPO, "--revision", "main", "--workers", "2",
                             "--device", "cpu", "--dtype", "float32", "--no-weight-cache"),
                       num_workers=2, env=env)
    assert {f: hub.downloads(f) - n for f, n in before.items()} == {
        "model.safetensors": 1, "tokenizer.json": 1}
    models = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [REPO]
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": REPO, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}]}).json()
    assert reply["usage"]["completion_tokens"] >= 1, reply
    assert reply["model"] == REPO
