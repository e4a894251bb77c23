"""A request's token does not depend on what shares its batch (docs/architecture.md,
"Batch independence"): the sampler with tied probabilities, and the small-batch kernels
chosen per row rather than by the step's row count."""

from __future__ import annotations

import pytest
import torch

from zeroserve.worker.model.linear import Linear
from zeroserve.worker.model.quant import PackedInt8, int4_kernels_available
from zeroserve.worker.plan import ScheduledChunk
from zeroserve.worker.sampler import Sampler
from zeroserve.worker.sequence import SamplingParams

VOCAB = 4096


def chunk(params: SamplingParams, rid: str) -> ScheduledChunk:
    return ScheduledChunk(request_id=rid, token_ids=[1], start_pos=0, block_table=[0],
                          do_sample=True, params=params, prompt_token_ids=[1],
                          output_token_ids=[])


def tied_logits(seed: int) -> torch.Tensor:
    """[VOCAB] logits rounded to bf16, as the bf16 model produces them: many exact ties."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(VOCAB, generator=gen) * 2).bfloat16().float()


def reference_token(logits: torch.Tensor, params: SamplingParams, uniform: float) -> int:
    """The rule spelled out: probabilities sorted descending, ties by token id; top_k, then
    the shortest prefix reaching top_p; the uniform through the kept tokens' CDF."""
    probs = torch.softmax(logits / params.temperature, dim=-1).double()
    order = sorted(range(VOCAB), key=lambda t: (-probs[t].item(), t))
    total, mass, kept = probs.sum().item(), 0.0, []
    for rank, token in enumerate(order):
        if (params.top_k > 0 and rank >= params.top_k) or mass / total >= params.top_p:
            break
        kept.append(token)
        mass += probs[token].item()
    target, running = uniform * sum(probs[t].item() for t in kept), 0.0
    for token in kept:
        running += probs[token].item()
        if running > target:
            return token
    return kept[-1]


NEIGHBOURS = [  # rows that change how the batch is sorted: a wide top_k, a flat nucleus
    SamplingParams(temperature=1.0, top_k=3000, seed=1),
    SamplingParams(temperature=50.0, top_p=0.999, seed=2),
    SamplingParams(temperature=1.0, top_k=7, seed=3),
]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.9, seed=11),
    SamplingParams(temperature=1.5, top_k=40, seed=12),
    SamplingParams(temperature=2.0, top_k=200, top_p=0.5, seed=13),
])
def test_a_seeded_row_draws_the_same_token_alone_and_in_any_batch(params):
    sampler = Sampler(VOCAB, [0], torch.device("cpu"))
    for seed in range(40):
        row = tied_logits(seed)
        alone = sampler.sample(row[None].clone(), [chunk(params, "a")])[0].token_id
        batch = torch.stack([tied_logits(100 + i) for i in range(len(NEIGHBOURS))] + [row])
        chunks = [chunk(p, str(i)) for i, p in enumerate(NEIGHBOURS)] + [chunk(params, "a")]
        beside = sampler.sample(batch, chunks)[-1].token_id
        uniform = sampler._uniforms([chunk(params, "a")], torch.device("cpu"))[0].item()
        assert alone == beside == reference_token(row, params, uniform), seed


def test_the_lm_head_kernel_does_not_depend_on_the_number_of_rows():
    """The int8 lm_head takes every sampled row, however many there are (it took only
    batches of up to 12 rows; larger ones went to the dense weight, other logits)."""
    if not int4_kernels_available():
        pytest.skip("torch has no int8 weight kernel here")
    gen = torch.Generator().manual_seed(0)
    dense = (torch.randn(512, 64, generator=gen) * 0.1).bfloat16()
    head = Linear(dense, PackedInt8.quantize(dense, torch.bfloat16))
    x = torch.randn(40, 64, generator=gen).bfloat16()
    alone = torch.cat([head(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(head(x), alone)


def test_projections_choose_their_kernel_per_row():
    """Rows before num_packed_rows (decode rows) take the low-bit kernel and the others the
    dense weight, whatever the batch's size: a row's output is the same alone or beside any
    number of other rows of either kind."""
    if not int4_kernels_available():
        pytest.skip("torch has no int8 weight kernel here")
    gen = torch.Generator().manual_seed(0)
    dense = (torch.randn(256, 64, generator=gen) * 0.1).bfloat16()
    linear = Linear(dense, PackedInt8.quantize(dense, torch.bfloat16))
    x = torch.randn(60, 64, generator=gen).bfloat16()
    packed_rows = torch.cat([linear(x[i : i + 1], 1) for i in range(30)])
    dense_rows = torch.cat([linear(x[i : i + 1], 0) for i in range(30, 60)])
    assert not torch.equal(packed_rows[:1], linear(x[:1], 0))  # the kernels do differ
    assert torch.equal(linear(x, 30), torch.cat([packed_rows, dense_rows]))
    assert torch.equal(linear(x[:5], 5), packed_rows[:5])


def test_dense_rows_are_computed_alike_whatever_shares_their_call():
    """The dense path (prefill rows, beside a low-bit copy for decode rows) with the tile size
    this machine needs: 20 rows give the same results alone, first in 33 rows, and behind 11
    others, in bf16. On a CPU without native bf16 oneDNN blocks rows by their count, and this
    failed untiled."""
    from zeroserve.worker.model.batch_invariance import dense_tile_rows

    for dtype in (torch.bfloat16,):
        generator = torch.Generator().manual_seed(1)
        weight = torch.randn(1536, 576, generator=generator).to(dtype)
        x = torch.randn(150, 576, generator=generator).to(dtype)
        low_bit = PackedInt8.quantize(weight, dtype)  # decode rows' copy (unused: 0 of them)
        linear = Linear(weight, low_bit, dense_tile_rows(dtype, torch.device("cpu")))
        alone = linear(x[11:31], 0)
        assert torch.equal(linear(x[11:44], 0)[:20], alone)
        assert torch.equal(linear(x[:31], 0)[11:], alone)
        assert torch.equal(linear(x, 0)[11:31], alone)


def test_a_row_dependent_kernel_gets_tiles_and_a_row_independent_one_none(monkeypatch):
    from zeroserve.worker.model import batch_invariance

    linear = torch.nn.functional.linear

    def row_dependent(x, weight):  # a row's result depends on how many rows there are
        return linear(x, weight) + x.shape[0] % 3

    cpu = torch.device("cpu")
    monkeypatch.setattr(batch_invariance.F, "linear", row_dependent)
    assert batch_invariance.dense_tile_rows(torch.bfloat16, cpu) == batch_invariance.TILE_ROWS
    assert batch_invariance.dense_tile_rows(torch.float32, cpu) is None  # rounding-only path
    monkeypatch.setattr(batch_invariance.F, "linear",
                        lambda x, w: torch.stack([row @ w.t() for row in x]))
    assert batch_invariance.dense_tile_rows(torch.bfloat16, cpu) is None


def test_a_rows_kernel_does_not_depend_on_how_many_rows_share_its_call():
    """Every mode chooses a row's kernel by what the row is (the caller's low_bit rows),
    never by the call's row count: a decode row (low-bit copy) comes out the same alone and
    beside any number of others, however many: the default serving mode once switched every
    row of a large call to the dense weight, which changed greedy tokens with speculation's
    verify rows on a CPU with native bf16."""
    if not int4_kernels_available():
        pytest.skip("torch has no int8 weight kernel here")
    gen = torch.Generator().manual_seed(0)
    dense = (torch.randn(256, 64, generator=gen) * 0.1).bfloat16()
    low_bit = PackedInt8.quantize(dense, torch.bfloat16)
    linear = Linear(dense, low_bit)
    x = torch.randn(80, 64, generator=gen).bfloat16()
    alone = linear(x[:1], 1)
    assert torch.equal(alone, low_bit.mm(x[:1]))
    for rows in (2, 13, 33, 80):
        assert torch.equal(linear(x[:rows], rows)[:1], alone)
        assert torch.equal(linear(x[:rows])[:1], alone)  # None: every row low-bit


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_the_engine_config_sets_the_models_mode(tiny_hf_dir, batch_invariant):
    """Batch-invariant: dense tiles where this CPU needs them; otherwise none."""
    from zeroserve.worker.config import EngineConfig
    from zeroserve.worker.model.batch_invariance import dense_tile_rows
    from zeroserve.worker.model_runner import ModelRunner

    assert EngineConfig().batch_invariant is False  # the faster mode serves by default
    runner = ModelRunner(EngineConfig(model=str(tiny_hf_dir), dtype="bfloat16", device="cpu",
                                      num_kv_blocks=16, batch_invariant=batch_invariant,
                                      weight_cache=False))
    model = runner.model
    linears = [model.lm_head] + [getattr(layer, name) for layer in model.layers
                                 for name in ("qkv", "o_proj", "gate_up", "down")]
    if batch_invariant:
        tiles = dense_tile_rows(torch.bfloat16, torch.device("cpu"))
        assert {lin.tile_rows for lin in linears if lin.packed is not None} <= {tiles}
    if not batch_invariant:  # no tiles: the dense kernel runs each call whole
        assert {linear.tile_rows for linear in linears} == {None}
