"""--kv-cache-dtype bfloat16: K/V stored in bf16 under fp32 activations.

K and V are rounded to bf16 as they are written (as torch's .to(torch.bfloat16) rounds) and
widened back to fp32 as attention reads them, which is exact: every reader (the native
decode/prompt kernel on every CPU class, the torch decode path, the SDPA prompt tiles) gives
bit for bit what the fp32 path gives over a pool holding the widened values. A request keeps
the same answer alone, beside others, in chunks and from the prefix cache; `auto` keeps the
activations' dtype, so `--dtype float32` stays the exact fp32 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import cpu_classes
from tests.worker.arch_models import (
    make_model,
    one_thread,  # noqa: F401 - autouse
    quantize_like_file,
    write_gguf,
)
from tests.worker.kv_tier.test_engine_tier import run as run_one
from tests.worker.test_attention import make_problem
from tests.worker.test_quantizations import MIXES, WIDE
from tests.worker.test_same_answer import PROMPTS, run
from zeroserve.worker import cpu_kernels
from zeroserve.worker.attention import (
    DecodeGroup,
    PrefillSpan,
    _decode_attention,
    _prefill_attention,
    causal_mask,
    write_kv,
)
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.device import resolve_kv_dtype
from zeroserve.worker.engine import Engine
from zeroserve.worker.sequence import SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels():
    return cpu_kernels.load(required=True)


@pytest.mark.parametrize("head_dim", [64, 128, 48])  # the AVX-512 paths and the portable one
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("lengths", [[37], [1, 2, 15, 16, 17, 33, 100, 257]])
def test_a_bf16_pool_reads_as_its_widened_fp32_copy(kernels, head_dim, num_heads, num_kv_heads,
                                                     lengths):
    """The native kernel over a bf16 pool with fp32 q gives the fp32 kernel's bits over the
    same pool widened to fp32 (one row: the per-head split; many: per KV head)."""
    q, k_cache, v_cache, tables, lens = make_problem(num_heads, num_kv_heads, head_dim, lengths,
                                                     torch.float32)
    k16, v16 = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    got = kernels.decode_attention(q, k16, v16, tables, lens, 0.125)
    assert got.dtype == torch.float32
    assert torch.equal(got, kernels.decode_attention(q, k16.float(), v16.float(), tables, lens,
                                                     0.125))


def test_the_kernel_refuses_other_mixed_dtypes(kernels):
    q, k_cache, v_cache, tables, lens = make_problem(4, 2, 64, [5], torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):  # fp32 pool under bf16 q
        kernels.decode_attention(q, k_cache.float(), v_cache.float(), tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="dtype"):  # K and V apart
        kernels.decode_attention(q.float(), k_cache, v_cache.float(), tables, lens, 0.125)


@pytest.mark.slow
@pytest.mark.parametrize("cpu_class", cpu_classes.params())
def test_every_cpu_class_reads_a_bf16_pool_exactly(cpu_class):
    cpu_classes.run_pytest(cpu_class, f"{__file__}::test_a_bf16_pool_reads_as_its_widened_fp32_copy",
                           f"{__file__}::test_writes_round_as_torch_rounds")


@pytest.mark.parametrize("native", [True, False])
def test_writes_round_as_torch_rounds(kernels, native, monkeypatch):
    """fp32 K/V into a bf16 pool: the native write and the torch fallback both store
    .to(torch.bfloat16) of each value (round to nearest even), in their slots only."""
    if not native:
        monkeypatch.setattr(cpu_kernels, "loaded", lambda: None)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(6, 3, 64, generator=gen) * 7
    v = torch.randn(12, 3, 64, generator=gen)[::2]  # strided rows
    k_cache = torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 5, 17, 40, 63, 30])
    write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache.view(-1, 3, 64)[slots], k.to(torch.bfloat16))
    assert torch.equal(v_cache.view(-1, 3, 64)[slots], v.to(torch.bfloat16))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(-1, 3, 64)[untouched].any()


def test_the_torch_decode_path_reads_a_bf16_pool_as_its_widened_copy():
    q, k_cache, v_cache, tables, lens = make_problem(9, 3, 64, [5, 40], torch.float32)
    k16, v16 = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    max_context = 48
    blocks = tables[:, :3].long().flatten()
    bias = torch.zeros(2, 1, max_context).masked_fill_(
        (torch.arange(max_context)[None, :] >= lens[:, None].long()).view(2, 1, -1),
        float("-inf"))
    group = DecodeGroup(0, 2, blocks, bias, max_context)
    got = _decode_attention(q, k16, v16, group, 0.125)
    assert got.dtype == torch.float32
    assert torch.equal(got, _decode_attention(q, k16.float(), v16.float(), group, 0.125))


def test_prompt_tiles_see_a_chunk_alike_whole_and_read_back_from_a_bf16_pool():
    """The SDPA prompt tiles (positions from 512 on) attend to a chunk's fresh K/V as the
    pool holds them: a row comes out alike computed whole (fresh K/V) or in a later chunk
    (K/V read back from the bf16 pool), and equal to the fp32 path over the rounded K/V."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, n = 9, 3, 64, 85
    q = torch.randn(n, heads, head_dim, generator=gen) * 3
    k = torch.randn(n, kv_heads, head_dim, generator=gen) * 3
    v = torch.randn(n, kv_heads, head_dim, generator=gen)
    pool_k = k.to(torch.bfloat16).view(n, 1, kv_heads, head_dim)
    pool_v = v.to(torch.bfloat16).view(n, 1, kv_heads, head_dim)
    group = heads // kv_heads
    whole = _prefill_attention(q, k, v, pool_k, pool_v,
                               PrefillSpan(0, n, None, causal_mask(0, n, group, CPU)), 0.125)
    rounded = _prefill_attention(q, pool_k.view(n, kv_heads, -1).float(),
                                 pool_v.view(n, kv_heads, -1).float(), None, None,
                                 PrefillSpan(0, n, None, causal_mask(0, n, group, CPU)), 0.125)
    assert torch.equal(whole, rounded)
    for start in (1, 16, 50, n - 1):
        part = _prefill_attention(q[start:], k[start:], v[start:], pool_k, pool_v,
                                  PrefillSpan(0, n - start, torch.arange(n),
                                              causal_mask(start, n - start, group, CPU)), 0.125)
        assert torch.equal(part, whole[start:]), start


def test_auto_keeps_the_activations_dtype_and_mixing_is_bf16_under_fp32_on_the_cpu_only():
    f32, bf16 = torch.float32, torch.bfloat16
    assert resolve_kv_dtype("auto", f32, CPU) == f32
    assert resolve_kv_dtype("auto", bf16, CPU) == bf16
    # The default path (--dtype auto, int8 activations) keeps its cache in bf16 on the CPU.
    assert resolve_kv_dtype("auto", f32, CPU, production=True) == bf16
    assert resolve_kv_dtype("auto", bf16, CPU, production=True) == bf16
    assert resolve_kv_dtype("float32", f32, CPU, production=True) == f32
    assert resolve_kv_dtype("bfloat16", f32, CPU) == bf16
    assert resolve_kv_dtype("float32", f32, CPU) == f32
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        resolve_kv_dtype("float32", bf16, CPU)
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        resolve_kv_dtype("bfloat16", f32, torch.device("cuda:0"))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="float16")


def test_the_flag_reaches_the_engine_config():
    from click.testing import CliRunner

    from zeroserve.cli.configs import engine_config
    from zeroserve.cli.options import ENGINE_OPTIONS

    seen = {}

    import click

    @click.command()
    def command(**opts):
        seen.update(opts)

    for decorate in reversed(ENGINE_OPTIONS):
        command = decorate(command)
    result = CliRunner().invoke(command, ["--kv-cache-dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    assert seen["kv_cache_dtype"] == "bfloat16"
    bad = CliRunner().invoke(command, ["--kv-cache-dtype", "int8"])
    assert bad.exit_code == 2 and "kv-cache-dtype" in bad.output
    assert engine_config({**seen, "model": "default"}).kv_cache_dtype == "bfloat16"


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory) -> Path:
    model = make_model("llama", seed=3, tie_word_embeddings=False, **WIDE)
    return write_gguf(model, tmp_path_factory.mktemp("kvdtype") / "tiny.gguf",
                      quantize_like_file(model, MIXES["Q4_K"]))


def _engine(model: Path, dtype: str, kv: str, prefix_caching: bool, **overrides) -> Engine:
    fields = dict(model=str(model), device="cpu", dtype=dtype, kv_cache_dtype=kv, block_size=16,
                  num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=64,
                  weight_cache=False, enable_prefix_caching=prefix_caching)
    return Engine(EngineConfig(**{**fields, **overrides}))


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_a_bf16_cache_gives_a_request_the_same_answer_alone_in_a_batch_and_cached(q4_model,
                                                                                   dtype):
    cold = _engine(q4_model, dtype, "bfloat16", prefix_caching=False)
    pool = cold.runner.kv_pool
    assert pool.dtype == torch.bfloat16
    alone = [run(cold, [p])[0] for p in PROMPTS]
    assert run(cold, PROMPTS) == alone  # together, in chunks, beside decodes
    cached = _engine(q4_model, dtype, "bfloat16", prefix_caching=True)
    assert run(cached, PROMPTS) == alone
    for prompt, expected in zip(PROMPTS, alone, strict=True):
        assert run(cached, [prompt]) == [expected]
    assert cached.stats().num_prefix_hits > 0


def test_the_default_path_caches_in_bf16_unless_told_float32(q4_model):
    """`--dtype auto` (int8 activations) stores its cache in bf16; `--kv-cache-dtype float32`
    or `--no-int8-activations` keep fp32."""
    def pool(kv: str, **overrides) -> torch.dtype:
        return _engine(q4_model, "auto", kv, prefix_caching=False,
                       **overrides).runner.kv_pool.dtype

    assert pool("auto") == torch.bfloat16
    assert pool("float32") == torch.float32
    assert pool("auto", int8_activations=False) == torch.float32


def test_auto_keeps_float32_the_exact_fp32_cache_and_bf16_halves_the_blocks_bytes(q4_model):
    fp32 = _engine(q4_model, "float32", "auto", prefix_caching=False, num_kv_blocks=None,
                   kv_cache_memory=1 << 20)
    bf16 = _engine(q4_model, "float32", "bfloat16", prefix_caching=False, num_kv_blocks=None,
                   kv_cache_memory=1 << 20)
    assert fp32.runner.kv_pool.dtype == torch.float32
    assert bf16.runner.kv_block_bytes * 2 == fp32.runner.kv_block_bytes
    assert bf16.runner.num_kv_blocks >= 2 * fp32.runner.num_kv_blocks - 1  # same memory
    # The bf16 cache is a different path: its answers are close (same first tokens here),
    # computed over rounded K/V.
    [(ref, _)] = run(fp32, [PROMPTS[0]])
    [(got, _)] = run(bf16, [PROMPTS[0]])
    assert got[:2] == ref[:2]


def test_the_kv_tier_keeps_blocks_of_each_cache_dtype_apart(q4_model, tmp_path):
    """Blocks an fp32 cache put in the tier are not loaded into a bf16 cache (other bytes):
    the second engine computes the whole prompt and gives its own answer."""
    prompt = PROMPTS[3]
    tier = dict(kv_offloading_size=0.05, kv_offloading_dir=str(tmp_path / "tier"))
    params = SamplingParams(temperature=0.0, max_tokens=4)

    def go(kv: str) -> tuple[list[int], int]:
        return run_one(_engine(q4_model, "float32", kv, prefix_caching=True, **tier), prompt,
                       params)

    go("float32")
    assert go("float32")[1] > 0  # the tier serves an engine of the same cache dtype
    tokens, cached = go("bfloat16")
    assert cached == 0
    alone = _engine(q4_model, "float32", "bfloat16", prefix_caching=False)
    assert tokens == run(alone, [prompt])[0][0][:4]
    # and a bf16 engine's own blocks come back from the tier with the same answer
    again, cached = go("bfloat16")
    assert cached > 0 and again == tokens


def test_speculation_gives_a_bf16_cache_the_same_greedy_tokens(q4_model):
    """Verify rows read the bf16 cache as decode rows do: n-gram speculation on or off, the
    same tokens."""
    from zeroserve.worker.speculative import SpeculativeConfig

    text = [1, 17, 250, 3, 99, 42, 8, 7, 128, 64, 5, 31]
    prompts = [text * 3, [1, 9, 8, 7] * 5 + [1, 9], text[:7] * 2]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_max=3,
                             prompt_lookup_min=1)

    def tokens(engine: Engine) -> list[list[int]]:
        out: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"s{i}", prompt, params)
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        return list(out.values())

    plain = _engine(q4_model, "float32", "bfloat16", prefix_caching=False)
    drafted = _engine(q4_model, "float32", "bfloat16", prefix_caching=False,
                      speculative_config=spec)
    assert tokens(drafted) == tokens(plain)
    assert drafted.stats().spec_decode.num_accepted_tokens > 0
