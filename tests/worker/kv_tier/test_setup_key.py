"""The KV tier's key names what changes a prompt's K/V bits: with int8 activations every
prompt row of the layers' projections takes the int8 kernels (Linear.int8_all_rows), so a
block written before that change (dense prompt rows under the same int8 flag) must not match."""

from __future__ import annotations

import torch

from zeroserve.worker.config import EngineConfig
from zeroserve.worker.kv_tier.setup import _kernels


def test_the_key_names_the_prompt_rows_kernel():
    on = _kernels(EngineConfig(model="default", dtype="float32", int8_activations=True), torch.float32, "cpu")
    off = _kernels(EngineConfig(model="default", dtype="float32", int8_activations=False), torch.float32, "cpu")
    auto = _kernels(EngineConfig(model="default", dtype="auto"), torch.float32, "cpu")
    assert "prompt_projections=int8" in on.split(",")
    assert "prompt_projections=dense" in off.split(",")
    assert auto == on != off
