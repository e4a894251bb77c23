"""`--int8-activations` on a real engine: every row of the layers' projections (prompt rows
too) and the lm_head's decode rows take int8 activations; the promises of the fp32 path hold for it (greedy tokens
the same with speculation and without; the same answer alone, batched or from the prefix
cache is tests/worker/test_same_answer.py's float32+int8)."""

from __future__ import annotations

import gguf
import pytest
import torch

from tests.worker.arch_models import (
    make_model,
    one_thread,  # noqa: F401 - autouse
    quantize_like_file,
    write_gguf,
)
from tests.worker.test_quantizations import WIDE
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.engine import Engine
from zeroserve.worker.model.prepare import BLOCKS, packing
from zeroserve.worker.model.quant import BlockQ4, BlockQ8, int4_kernels_available
from zeroserve.worker.sequence import SamplingParams
from zeroserve.worker.speculative import SpeculativeConfig

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(packing(torch.device("cpu"), torch.float32) != BLOCKS,
                                reason="needs the native CPU kernels")

_TEXT = [1, 17, 250, 3, 99, 42, 8, 7, 128, 64, 5, 31]
# Prompts that repeat themselves (n-gram drafts), and one that does not.
PROMPTS = [_TEXT * 3, [1, 9, 8, 7] * 5 + [1, 9], [1, *range(30, 46)], _TEXT[:7] * 2]
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.fixture(scope="module")
def q4_1_model(tmp_path_factory):
    """Layers in Q4_1 and the lm_head in Q8_0, as SmolLM2-135M's file."""
    model = make_model("llama", seed=4, tie_word_embeddings=False, **WIDE)
    raws = quantize_like_file(
        model, lambda name, _: Q.Q8_0 if name == "lm_head.weight" else Q.Q4_1)
    return write_gguf(model, tmp_path_factory.mktemp("int8") / "tiny.gguf", raws)


def engine_for(path, int8: bool, speculative: SpeculativeConfig | None = None) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=4,
                               num_kv_blocks=256, max_num_batched_tokens=16, max_model_len=256,
                               weight_cache=False, int8_activations=int8,
                               speculative_config=speculative))


def test_every_block_product_of_decode_rows_takes_int8(q4_1_model):
    llama = engine_for(q4_1_model, int8=True).runner.model
    linears = [lin for layer in llama.layers
               for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    assert all(isinstance(lin.packed, BlockQ4) for lin in linears)
    assert isinstance(llama.lm_head.packed, BlockQ8)
    assert all(lin.packed.int8_activations for lin in [*linears, llama.lm_head])
    assert llama._fused.int8_activations
    off = engine_for(q4_1_model, int8=False).runner.model
    assert not any(lin.packed.int8_activations for layer in off.layers
                   for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))


def test_logits_of_decode_rows_take_int8_and_of_prompt_rows_fp32(q4_1_model):
    """compute_logits: each decode row's logits are the int8 kernel's, alone or beside prompt
    rows, in any order; a prompt row's are the fp32-activation kernel's."""
    llama = engine_for(q4_1_model, int8=True).runner.model
    hidden = torch.randn(5, llama.config.hidden_size, generator=torch.Generator().manual_seed(0))
    decode = torch.tensor([False, True, True, False, True])
    logits = llama.compute_logits(hidden, decode)
    h = llama.ops.rms_norm(hidden, llama.norm, llama.config.rms_norm_eps)
    head = llama.lm_head.packed
    for i in range(5):
        kernel = head.decode_mm if decode[i] else head.mm
        assert torch.equal(logits[i], kernel(h[i:i + 1])[0]), i
        alone = llama.compute_logits(hidden[i:i + 1], decode[i:i + 1])
        assert torch.equal(alone[0], logits[i]), i
    assert not torch.equal(head.decode_mm(h[:1]), head.mm(h[:1]))
    assert torch.equal(llama.compute_logits(hidden), head.mm(h))  # prompt logprobs: fp32


def test_prompt_rows_of_the_layers_take_int8_and_the_first_token_changes(q4_1_model):
    """A prompt's rows take int8 activations in every layer's projections too (Linear.
    int8_all_rows), whatever `low_bit` says: so the first generated token's logprobs differ
    from those without the flag, while the lm_head keeps fp32 activations for prompt rows."""
    llama = engine_for(q4_1_model, int8=True).runner.model
    x = torch.randn(5, llama.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for layer in llama.layers:
        qkv = layer.qkv
        assert qkv.int8_all_rows
        for low_bit in (0, 2, None):
            assert torch.equal(qkv(x, low_bit, 0), qkv.packed.decode_mm(x)), low_bit
        assert not torch.equal(qkv(x, 0, 0), qkv.packed.mm(x))
    assert not llama.lm_head.int8_all_rows
    off = engine_for(q4_1_model, int8=False).runner.model
    assert not any(lin.int8_all_rows for layer in off.layers
                   for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)

    def run(engine: Engine) -> list[list]:
        engine.add_request("r", PROMPTS[2], params)
        entries = []
        while engine.has_unfinished():
            for out in engine.step():
                entries += out.logprobs or []
        return entries

    fp32, int8 = run(engine_for(q4_1_model, False)), run(engine_for(q4_1_model, True))
    assert len(fp32) == len(int8) == 6
    assert int8[0] != fp32[0]


def test_greedy_tokens_are_the_same_with_speculation(q4_1_model):
    """Verify rows are decode rows: with int8 activations they compute what plain decoding
    computes for the same positions, so the greedy tokens are the same with drafts or not."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    expected = engine_for(q4_1_model, True).generate(PROMPTS, greedy)
    spec = engine_for(q4_1_model, True, SPEC)
    assert spec.generate(PROMPTS, greedy) == expected
    assert spec.generate([PROMPTS[0]], greedy) == [expected[0]]
    assert spec.stats().spec_decode.num_accepted_tokens > 0


def test_the_flag_says_where_it_changes_nothing(q4_1_model, caplog):
    """bfloat16 decode rows run torch's int4 kernels, which have no int8 path: the worker
    says so at start instead of silently serving without it."""
    if not int4_kernels_available():
        pytest.skip("torch has no int4 weight kernel here")
    with caplog.at_level("WARNING", logger="zeroserve.worker.model_runner"):
        engine = Engine(EngineConfig(model=str(q4_1_model), device="cpu", dtype="bfloat16",
                                     block_size=4, num_kv_blocks=64, weight_cache=False,
                                     int8_activations=True))
    assert "--int8-activations: no 4-bit or 8-bit block copies" in caplog.text
    assert engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=2))


@pytest.mark.parametrize("dtype,flag,expected", [
    ("auto", None, True),  # the default: passed the quality gate (benchmarks/bench_quality.py)
    ("auto", False, False),  # --no-int8-activations
    ("float32", None, False),  # an explicit float32 stays the exact reference path
    ("float32", True, True),
])
def test_int8_activations_are_on_by_default_only_with_dtype_auto(q4_1_model, dtype, flag,
                                                                  expected):
    config = EngineConfig(model=str(q4_1_model), device="cpu", dtype=dtype, block_size=4,
                          num_kv_blocks=64, max_model_len=64, weight_cache=False,
                          int8_activations=flag)
    llama = Engine(config).runner.model
    if dtype == "auto" and llama.dtype != torch.float32:
        pytest.skip("auto is bf16 throughout here (no block kernels): nothing to quantize")
    assert config.uses_int8_activations is expected
    assert llama._fused.int8_activations is expected


def test_int8_activations_load_no_dense_copy_of_the_projections(q4_1_model):
    """Every row of the projections takes the block copy, so none of their dense copies is
    loaded (on the default model 203 MiB of bf16 on a CPU with native bf16, 406 MiB of fp32
    without); the lm_head keeps its dense weight for prompt rows (fp32 activations)."""
    def linears(model):
        return [lin for layer in model.layers
                for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]

    on = engine_for(q4_1_model, int8=True).runner.model
    assert all(lin.dense is None for lin in linears(on))
    assert on.lm_head.dense is not None
    off = engine_for(q4_1_model, int8=False).runner.model
    assert all(lin.dense is not None for lin in linears(off))


def test_the_same_logits_without_the_dense_copies(q4_1_model):
    """What is served does not change: a model loaded without the projections' dense copies
    computes, prompt and decode rows alike, the very logits of one that loaded them and then
    turned int8 activations on."""
    from zeroserve.worker.model.loader import load_model

    cpu = torch.device("cpu")
    with_dense, _ = load_model(str(q4_1_model), cpu, torch.float32)
    without, _ = load_model(str(q4_1_model), cpu, torch.float32, int8_activations=True)
    assert with_dense.layers[0].qkv.dense is not None and without.layers[0].qkv.dense is None
    for model in (with_dense, without):
        model.use_int8_activations()
    prompt = PROMPTS[0]
    assert torch.equal(with_dense.forward_unpaged(prompt), without.forward_unpaged(prompt))
    hidden = torch.randn(3, without.config.hidden_size, generator=torch.Generator().manual_seed(2))
    decode = torch.tensor([True, False, True])
    assert torch.equal(with_dense.compute_logits(hidden, decode),
                       without.compute_logits(hidden, decode))
