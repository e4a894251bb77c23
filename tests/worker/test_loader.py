"""Loading tiny random Llama models from a HF directory and from GGUF (every supported tensor
type), checked against transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from tests.worker.conftest import make_tiny_hf_model, save_hf_dir, write_gguf
from zeroserve.worker.model.gguf_weights import unpermute_qk
from zeroserve.worker.model.llama_config import UnsupportedModelError
from zeroserve.worker.model.loader import load_model

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
TOKENS = [1, 17, 250, 3, 99, 42, 42, 7, 128, 64, 5, 200]


def hf_logits(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def our_logits(path, tokens=TOKENS, dtype=torch.float32) -> torch.Tensor:
    model, _info = load_model(str(path), CPU, dtype)
    with torch.inference_mode():
        return model.forward_unpaged(tokens)


def roundtrip(model, qtype):
    """A copy of `model` whose matrices went through qtype and back (what GGUF stores)."""
    copy = make_tiny_hf_model(tie_word_embeddings=model.config.tie_word_embeddings)
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for _name, param in copy.named_parameters():
            if param.ndim == 2:
                array = param.numpy()
                restored = gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)
                param.copy_(torch.from_numpy(np.asarray(restored, dtype=np.float32)))
    return copy


def test_hf_directory_matches_transformers(tiny_hf_model, tiny_hf_dir):
    torch.testing.assert_close(our_logits(tiny_hf_dir), hf_logits(tiny_hf_model),
                               atol=1e-4, rtol=1e-4)


def test_untied_lm_head_and_odd_head_dim(tmp_path):
    # head_dim 32 with hidden 64 and 4 heads: q_proj is wider than hidden.
    model = make_tiny_hf_model(seed=3, tie_word_embeddings=False, head_dim=32)
    save_hf_dir(model, tmp_path / "hf")
    torch.testing.assert_close(our_logits(tmp_path / "hf"), hf_logits(model), atol=1e-4, rtol=1e-4)
    write_gguf(model, tmp_path / "m.gguf")
    torch.testing.assert_close(our_logits(tmp_path / "m.gguf"), hf_logits(model),
                               atol=1e-4, rtol=1e-4)


def test_gguf_f32_matches_transformers_despite_qk_permutation(tiny_hf_model, tmp_path):
    path = write_gguf(tiny_hf_model, tmp_path / "tiny.gguf")
    torch.testing.assert_close(our_logits(path), hf_logits(tiny_hf_model), atol=1e-4, rtol=1e-4)


def test_unpermute_inverts_llama_cpp_permutation():
    from tests.worker.conftest import permute_qk_like_llama_cpp

    weight = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert not np.array_equal(permute_qk_like_llama_cpp(weight, 8), weight)
    assert np.array_equal(unpermute_qk(permute_qk_like_llama_cpp(weight, 8), 8), weight)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_quantized_types_match_transformers_on_dequantized_weights(tiny_hf_model, tmp_path,
                                                                         qtype):
    path = write_gguf(tiny_hf_model, tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    reader = gguf.GGUFReader(str(path))
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {qtype}
    expected = hf_logits(roundtrip(tiny_hf_model, qtype))
    torch.testing.assert_close(our_logits(path), expected, atol=2e-4, rtol=2e-4)


def test_gguf_model_info(tiny_hf_model, tmp_path):
    path = write_gguf(tiny_hf_model, tmp_path / "my-model.gguf")
    _model, info = load_model(str(path), CPU, torch.bfloat16, max_model_len=100)
    assert info.name == "my-model"
    assert info.eos_token_ids == (2, 3)  # eos and end-of-turn
    assert info.bos_token_id == 1
    assert info.max_model_len == 100
    assert (info.vocab_size, info.num_layers, info.num_kv_heads, info.head_dim) == (256, 2, 2, 16)
    assert (info.device, info.dtype) == ("cpu", "bfloat16")
    _model, info = load_model(str(path), CPU, torch.float32, max_model_len=None)
    assert info.max_model_len == 512


def test_hf_model_info_merges_generation_config(tiny_hf_dir):
    _model, info = load_model(str(tiny_hf_dir), CPU, torch.float32)
    assert info.eos_token_ids == (2, 3)
    assert info.bos_token_id == 1
    assert info.name == tiny_hf_dir.name


@pytest.mark.slow  # parsing the real file's 49k-token vocabulary takes seconds
def test_real_default_model_info():
    from zeroserve.common.model_files import default_model_path
    from zeroserve.worker.model.gguf_weights import read_config

    config = read_config(gguf.GGUFReader(str(default_model_path())))
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30, 576, 9, 3)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.max_position_embeddings == 8192


def test_unsupported_architecture_is_a_clear_error(tmp_path, tiny_hf_dir):
    config = json.loads((tiny_hf_dir / "config.json").read_text())
    config["model_type"] = "gpt2"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(str(bad), CPU, torch.float32)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_int4_blocks_reproduce_gguf_dequantization(qtype):
    from zeroserve.worker.model.quant import int4_blocks_from_gguf

    array = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    raw = gguf.quants.quantize(array, qtype)
    blocks = int4_blocks_from_gguf(raw, qtype)
    expected = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_allclose(blocks.dequantize(torch.float32).numpy(), expected, atol=1e-6)
    assert int4_blocks_from_gguf(gguf.quants.quantize(array, Q.Q8_0), Q.Q8_0) is None


def test_bf16_cpu_uses_int4_kernels_for_small_batches_consistently(tiny_hf_model, tmp_path):
    from zeroserve.worker.model.quant import PackedInt4, PackedInt8, int4_kernels_available

    if not int4_kernels_available():
        pytest.skip("this torch has no CPU int4 kernels")
    path = write_gguf(tiny_hf_model, tmp_path / "q41.gguf", Q.Q4_1)
    model, _info = load_model(str(path), CPU, torch.bfloat16)
    layer = model.layers[0]
    assert isinstance(layer.qkv.packed, PackedInt4) and isinstance(layer.down.packed, PackedInt4)
    assert isinstance(model.lm_head.packed, PackedInt8)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    # The dense copy holds the very values the int4 kernel uses: both paths agree.
    torch.testing.assert_close(layer.qkv.packed.mm(x).float(),
                               torch.nn.functional.linear(x, layer.qkv.dense).float(),
                               atol=2e-2, rtol=2e-2)
    # And the bf16 model (int4 for this short prompt) stays close to the fp32 reference.
    with torch.inference_mode():
        ours = model.forward_unpaged(TOKENS[:8])
    expected = hf_logits(roundtrip(tiny_hf_model, Q.Q4_1), TOKENS[:8])
    assert torch.nn.functional.cosine_similarity(ours, expected, dim=-1).min() > 0.99
    fp32, _info = load_model(str(path), CPU, torch.float32)
    # fp32 keeps the file's own blocks for the native kernels where they build, never torch's.
    from zeroserve.worker.model.prepare import BLOCKS, packing
    from zeroserve.worker.model.quant import BlockQ4

    if packing(CPU, torch.float32) == BLOCKS:
        assert isinstance(fp32.layers[0].qkv.packed, BlockQ4)
    else:
        assert fp32.layers[0].qkv.packed is None and fp32.lm_head.packed is None
