"""GGUF quantizations people download (Q8_0, Q4_K, Q5_K, Q6_K and Q4_K_M's mix of Q4_K and
Q6_K) load to the values the file holds: greedy tokens equal to transformers running the
dequantized weights in fp32. Q4_K stays 4-bit for the small-batch int4 kernel in bfloat16;
the startup notes say what the file held and what the weights take in memory."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.worker.arch_models import (
    hf_greedy,
    make_model,
    one_thread,  # noqa: F401 - autouse
    quantize_like_file,
    write_gguf,
)
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.engine import Engine
from zeroserve.worker.model.loader import load_model
from zeroserve.worker.model.prepare import BLOCKS, packing
from zeroserve.worker.model.quant import PackedInt4, int4_kernels_available
from zeroserve.worker.sequence import SamplingParams
from zeroserve.worker.startup import StartupTimer

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
# K-quant rows are whole blocks of 256.
WIDE = dict(hidden_size=256, intermediate_size=256, head_dim=64)
PROMPTS = [[1, 17, 250, 3, 99, 42, 42, 7, 128, 64, 5], [1, *range(30, 46)]]
NUM_TOKENS = 16


def q4_k_m(name: str, _param) -> Q:
    """llama.cpp's Q4_K_M: Q4_K, with V and the FFN down projection of some layers (here
    layer 0) and the output in Q6_K."""
    if name == "lm_head.weight" or (".0." in name and ("v_proj" in name or "down_proj" in name)):
        return Q.Q6_K
    return Q.Q4_K


MIXES = {
    "Q8_0": lambda name, param: Q.Q8_0,
    "Q4_K": lambda name, param: Q.Q4_K,
    "Q5_K": lambda name, param: Q.Q5_K,
    "Q6_K": lambda name, param: Q.Q6_K,
    "Q4_K_M": q4_k_m,
}


@pytest.fixture(scope="module", params=list(MIXES))
def quantized(request, tmp_path_factory):
    """(reference model holding the file's values, GGUF path, mix name)."""
    model = make_model("llama", seed=1, tie_word_embeddings=False, **WIDE)
    raws = quantize_like_file(model, MIXES[request.param])
    path = write_gguf(model, tmp_path_factory.mktemp("q") / f"tiny-{request.param}.gguf", raws)
    return model, path, request.param


def test_quantized_gguf_greedy_matches_transformers(quantized):
    model, path, mix = quantized
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2}
    assert types == ({"Q4_K", "Q6_K"} if mix == "Q4_K_M" else {mix})
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=4,
                                 num_kv_blocks=64, max_num_batched_tokens=8, weight_cache=False))
    expected = [hf_greedy(model, p, NUM_TOKENS) for p in PROMPTS]
    assert engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)) \
        == expected
    with torch.no_grad():
        reference = model(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(engine.runner.model.forward_unpaged(PROMPTS[0]), reference,
                               atol=2e-4, rtol=2e-4)


def test_startup_notes_report_file_types_and_memory(quantized):
    model, path, mix = quantized
    timer = StartupTimer()
    load_model(str(path), CPU, torch.float32, timer=timer)
    matrices = {"Q4_K_M": "Q4_K x13, Q6_K x3"}.get(mix, f"{mix} x16")
    assert timer.notes["file_tensor_types"] == f"F32 x5, {matrices}"  # norms stay F32
    # fp32: the dense part is exactly the reference model's parameters; beside it, where the
    # native kernels build, the file's own 4-bit or 8-bit blocks for decode rows.
    mib = sum(p.numel() for p in model.parameters()) * 4 / (1 << 20)
    memory = timer.notes["weights_memory"]
    blocks = {"Q8_0": "int8", "Q4_K": "int4", "Q4_K_M": "int4"}.get(mix)  # Q5_K, Q6_K: none
    if blocks and packing(CPU, torch.float32) == BLOCKS:
        assert f"(dense {mib:.1f}, {blocks} " in memory
    else:
        assert memory == f"{mib:.1f} MiB (dense {mib:.1f})"


@pytest.mark.skipif(not int4_kernels_available(), reason="this torch has no CPU int4 kernels")
@pytest.mark.parametrize("mix", ["Q4_K", "Q4_K_M"])
def test_q4_k_stays_4_bit_in_bfloat16(mix, tmp_path):
    model = make_model("llama", seed=1, tie_word_embeddings=False, **WIDE)
    path = write_gguf(model, tmp_path / "tiny.gguf", quantize_like_file(model, MIXES[mix]))
    timer = StartupTimer()
    ours, _info = load_model(str(path), CPU, torch.bfloat16, timer=timer)
    layer0, layer1 = ours.layers
    assert isinstance(layer1.qkv.packed, PackedInt4) and isinstance(layer1.down.packed, PackedInt4)
    assert isinstance(layer0.gate_up.packed, PackedInt4)
    if mix == "Q4_K_M":  # Q6_K V and down: no 4-bit kernel, dense
        assert layer0.qkv.packed is None and layer0.down.packed is None
    assert "int4" in timer.notes["weights_memory"]
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(layer1.qkv.packed.mm(x).float(),
                               torch.nn.functional.linear(x, layer1.qkv.dense).float(),
                               atol=3e-2, rtol=3e-2)
    with torch.inference_mode():
        logits = ours.forward_unpaged(PROMPTS[0])
    with torch.no_grad():
        reference = model(torch.tensor([PROMPTS[0]])).logits[0]
    assert torch.nn.functional.cosine_similarity(logits, reference, dim=-1).min() > 0.99


def test_unsupported_tensor_type_is_refused(tmp_path):
    from zeroserve.worker.model.llama_config import UnsupportedModelError

    model = make_model("llama")
    # Q8_1 (an intermediate type of llama.cpp's, never in released files): 64 inputs a row
    # are 2 blocks of 40 bytes.
    raws = {"model.layers.0.mlp.up_proj.weight": (np.zeros((128, 80), np.uint8), Q.Q8_1)}
    path = write_gguf(model, tmp_path / "odd.gguf", raws)
    with pytest.raises(UnsupportedModelError, match="ffn_up.weight has type Q8_1"):
        load_model(str(path), CPU, torch.float32)


def test_q4_k_blocks_reproduce_gguf_dequantization():
    from tests.worker.arch_models import random_quantized
    from zeroserve.worker.model.kquant import int4_blocks

    raw = random_quantized(6, 512, Q.Q4_K, np.random.default_rng(0))
    blocks = int4_blocks(raw, Q.Q4_K)
    np.testing.assert_array_equal(blocks.dequantize(torch.float32).numpy(),
                                  gguf.quants.dequantize(raw, Q.Q4_K))
    assert int4_blocks(random_quantized(6, 512, Q.Q6_K, np.random.default_rng(0)), Q.Q6_K) is None


@pytest.mark.skipif(packing(CPU, torch.float32) != BLOCKS, reason="needs the native CPU kernels")
@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8_activations"])
def test_decode_steps_call_the_kernels_directly_with_the_same_result(tmp_path, monkeypatch,
                                                                     int8):
    """A step of decode rows only runs all layers in one native call (decode_layers.cpp), or
    else each layer's LlamaLayer.decode_native (the kernels called directly): both bit for
    bit what forward() computes layer by layer for the same rows, three sequences at once;
    with int8 activations too (each of the three paths takes them for decode rows)."""
    model = make_model("llama", seed=2, tie_word_embeddings=False, **WIDE)
    path = write_gguf(model, tmp_path / "tiny.gguf", quantize_like_file(model, MIXES["Q4_K"]))
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=4,
                                 num_kv_blocks=64, weight_cache=False, int8_activations=int8))
    llama = engine.runner.model
    assert llama._fused.int8_activations is int8
    assert all(layer.native is not None for layer in llama.layers)
    steps = []
    forward = llama.forward

    def recording(input_ids, positions, meta, kv_caches):
        if not meta.prefills and kv_caches is not None:
            steps.append((input_ids, positions, meta, kv_caches))
        return forward(input_ids, positions, meta, kv_caches)

    monkeypatch.setattr(llama, "forward", recording)
    engine.generate([PROMPTS[0], PROMPTS[1], [1, 2, 3]],
                    SamplingParams(temperature=0.0, max_tokens=4))
    input_ids, positions, meta, kv_caches = steps[-1]
    assert len(input_ids) == 3 and meta.num_decode == 3
    assert llama._fused is not None
    called = []
    monkeypatch.setattr(llama, "_fused", RecordingFused(llama._fused, called))
    fused = forward(input_ids, positions, meta, kv_caches)
    assert called == [3]
    monkeypatch.setattr(llama, "_fused", None)
    direct = forward(input_ids, positions, meta, kv_caches)
    for layer in llama.layers:
        monkeypatch.setattr(layer, "native", None)
    layer_by_layer = forward(input_ids, positions, meta, kv_caches)
    assert torch.equal(direct, layer_by_layer)
    assert torch.equal(fused, layer_by_layer)
    if int8:  # and it is not the fp32-activation step
        for layer in llama.layers:
            for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                monkeypatch.setattr(lin.packed, "int8_activations", False)
        assert not torch.equal(forward(input_ids, positions, meta, kv_caches), layer_by_layer)


@pytest.mark.skipif(packing(CPU, torch.float32) != BLOCKS, reason="needs the native CPU kernels")
def test_fp32_runs_decode_steps_through_the_native_kernels(tmp_path):
    """An fp32 model chooses its kernels per row (the block kernels for decode rows in every
    step) and runs a step of decode rows through the native kernels, on every CPU class."""
    model = make_model("llama", seed=2, tie_word_embeddings=False, **WIDE)
    path = write_gguf(model, tmp_path / "tiny.gguf", quantize_like_file(model, MIXES["Q4_K"]))
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=4,
                                 num_kv_blocks=64, weight_cache=False))
    llama = engine.runner.model
    assert all(layer.native is not None for layer in llama.layers)
    assert llama._fused is not None


class RecordingFused:
    """A LlamaModel._fused that records the rows of each decode_layers call."""

    def __init__(self, fused, called: list[int]):
        self._fused = fused
        self.attention = fused.attention
        self.module = self
        self.weights, self.bits, self.out_features = fused.weights, fused.bits, fused.out_features
        self.int8_activations = fused.int8_activations
        self._called = called

    def decode_layers(self, x, *args):
        self._called.append(x.shape[0])
        return self._fused.module.decode_layers(x, *args)
