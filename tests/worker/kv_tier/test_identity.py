"""What a worker's HELLO says of its KV tier (worker/kv_tier/identity.py), for the gateway's
routing: workers on one tier folder with one model name the same tier, whatever path each was
given; another model or another folder is another tier; no tier, no fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.arch_models import (
    make_model,
    one_thread,  # noqa: F401 - autouse
    write_gguf,
)
from tests.worker.kv_tier.test_engine_tier import engine
from zeroserve.worker.kv_tier.identity import hello_fields


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("models")
    return (write_gguf(make_model("llama", seed=4), folder / "a.gguf"),
            write_gguf(make_model("llama", seed=5), folder / "b.gguf"))


def test_workers_on_one_folder_and_model_name_one_tier(models, tmp_path):
    model, other_model = models
    first = engine(model, tmp_path / "tier")
    (tmp_path / "link").symlink_to(tmp_path / "tier")
    same = hello_fields(engine(model, tmp_path / "link").tier)  # another path to it
    fields = hello_fields(first.tier)
    assert same == fields and len(fields["kv_tier"]) == 16
    block_bytes = first.tier.block_bytes
    assert fields["kv_tier_num_blocks"] == int(0.01 * (1 << 30)) // block_bytes
    assert hello_fields(engine(other_model, tmp_path / "tier").tier)["kv_tier"] != \
        fields["kv_tier"]
    assert hello_fields(engine(model, tmp_path / "elsewhere").tier)["kv_tier"] != \
        fields["kv_tier"]


def test_a_worker_without_a_tier_names_none(models):
    assert engine(models[0], None).tier is None
    assert hello_fields(None) == {}
