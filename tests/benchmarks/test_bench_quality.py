"""The quality gate's arithmetic and rule (benchmarks/bench_quality.py), on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.bench_quality import (
    BASELINE,
    PATHS,
    REFERENCE,
    TEXT_PATH,
    Metrics,
    choose_paths,
    gate,
    is_prefix_run,
    load_metrics,
    measured_rows,
    row_stats,
    table,
    window_starts,
)


def test_nll_is_minus_the_log_probability_of_the_target():
    # Uniform over 4 tokens: every target has probability 1/4; then one token favoured.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    ref = torch.log_softmax(logits, dim=-1)
    nll, _kl, _top1, _ref_top1 = row_stats(logits, ref, torch.tensor([2, 1]))
    assert nll[0].item() == pytest.approx(math.log(4))
    assert nll[1].item() == pytest.approx(-math.log(math.exp(2) / (math.exp(2) + 3)), rel=1e-6)


def test_kl_is_zero_for_the_same_distribution_and_matches_the_definition_otherwise():
    p = torch.tensor([[0.5, 0.25, 0.25]])
    q = torch.tensor([[0.7, 0.2, 0.1]])
    targets = torch.tensor([0])
    _nll, same, _a, _b = row_stats(p.log(), p.log(), targets)
    assert same.item() == pytest.approx(0.0, abs=1e-7)
    # KL(p || q): the reference is p, the path's logits give q (any shift of the logits).
    _nll, kl, _a, _b = row_stats(q.log() + 3.0, p.log(), targets)
    expected = 0.5 * math.log(0.5 / 0.7) + 0.25 * math.log(0.25 / 0.2) + 0.25 * math.log(0.25 / 0.1)
    assert kl.item() == pytest.approx(expected, rel=1e-5)
    # and it is not symmetric: KL(q || p) is another number
    _nll, reverse, _a, _b = row_stats(p.log(), q.log(), targets)
    assert reverse.item() != pytest.approx(kl.item(), rel=1e-3)


def test_kl_ignores_tokens_the_reference_gives_no_probability():
    ref = torch.tensor([[0.0, -math.inf, 0.0]])  # p = (0.5, 0, 0.5) before normalising
    ref = torch.log_softmax(ref, dim=-1)
    logits = torch.tensor([[0.0, -math.inf, 0.0]])
    _nll, kl, _a, _b = row_stats(logits, ref, torch.tensor([0]))
    assert kl.item() == pytest.approx(0.0, abs=1e-7)  # not NaN from 0 * inf


def test_top1_agreement_compares_each_rows_argmax_with_the_references():
    ref = torch.log_softmax(torch.tensor([[3.0, 1.0, 0.0], [0.0, 1.0, 3.0]]), dim=-1)
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]], dtype=torch.bfloat16)
    _nll, _kl, top1, ref_top1 = row_stats(logits, ref, torch.tensor([0, 2]))
    assert (top1 == ref_top1).tolist() == [True, False]


def test_metrics_average_and_rank_the_rows():
    m = Metrics.of(nll=[1.0, 2.0, 3.0], kl=[0.0, 0.1, 0.2], agree=[True, True, False])
    assert m.num_tokens == 3
    assert m.mean_nll == pytest.approx(2.0)
    assert m.perplexity == pytest.approx(math.exp(2.0))
    assert m.mean_kl == pytest.approx(0.1)
    assert m.kl_max == pytest.approx(0.2)
    assert m.kl_p99 == pytest.approx(0.198)  # between the two largest, near the top
    assert m.top1_agreement == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        Metrics.of([], [], [])


def metrics(ppl: float, agreement: float) -> Metrics:
    return Metrics(num_tokens=100, mean_nll=math.log(ppl), perplexity=ppl, mean_kl=0.0,
                   kl_p99=0.0, kl_max=0.0, top1_agreement=agreement)


def results(**paths: tuple[float, float]) -> dict[str, dict[str, Metrics]]:
    """path -> (perplexity, agreement), the same in both modes."""
    return {name.replace("_", "-"): {"decode": metrics(*v), "prompt": metrics(*v)}
            for name, v in paths.items()}


def test_the_gate_passes_a_path_within_half_a_percent_that_agrees_as_often_as_bf16():
    figures = results(fp32_reference=(10.0, 1.0), bf16=(10.03, 0.95),
                      candidate=(10.049, 0.95), better=(9.96, 0.99))
    verdicts = gate(figures)
    assert verdicts["candidate"].passed and verdicts["better"].passed
    assert verdicts["fp32-reference"].passed and verdicts["bf16"].passed


@pytest.mark.parametrize("ppl", [10.051, 9.949])
def test_the_gate_fails_a_path_whose_perplexity_moved_more_than_half_a_percent(ppl):
    verdicts = gate(results(fp32_reference=(10.0, 1.0), bf16=(10.0, 0.95),
                            candidate=(ppl, 0.99)))
    assert not verdicts["candidate"].passed
    assert all("perplexity" in r for r in verdicts["candidate"].reasons)


def test_the_gate_fails_a_path_that_agrees_less_often_than_bf16():
    verdicts = gate(results(fp32_reference=(10.0, 1.0), bf16=(10.0, 0.95),
                            candidate=(10.0, 0.9499)))
    assert not verdicts["candidate"].passed
    assert all("agreement" in r for r in verdicts["candidate"].reasons)


def test_the_gate_holds_in_every_mode():
    figures = results(fp32_reference=(10.0, 1.0), bf16=(10.0, 0.95), candidate=(10.0, 0.96))
    figures["candidate"]["prompt"] = metrics(10.2, 0.96)  # fine on decode rows only
    verdict = gate(figures)["candidate"]
    assert not verdict.passed and verdict.reasons[0].startswith("prompt:")
    assert "FAIL" in table(figures, gate(figures), {n: "" for n in figures}).splitlines()[-1]


def test_the_gate_needs_the_reference_and_the_baseline():
    with pytest.raises(ValueError):
        gate(results(fp32_reference=(10.0, 1.0), candidate=(10.0, 1.0)))


def test_windows_score_every_token_after_the_first_window_once():
    num_tokens, context, scored = 1000, 64, 32
    starts = window_starts(num_tokens, context, scored)
    targets = [s + context + 1 + j for s in starts for j in range(scored)]
    assert len(targets) == len(set(targets))
    assert targets == list(range(context + 1, targets[-1] + 1))  # consecutive, none skipped
    assert targets[-1] <= num_tokens - 1 and targets[-1] + scored > num_tokens - 1
    assert window_starts(context + scored, context, scored) == []  # no room for a target


def test_the_reference_and_baseline_always_run_first_and_missing_flags_are_skipped():
    known = {"dtype", "batch_invariant", "attention_backend", "enforce_eager"}
    chosen, skipped = choose_paths(["fp32", "fp32+int8"], known)
    assert [p.name for p in chosen] == [REFERENCE, BASELINE, "fp32"]
    assert skipped and skipped[0].startswith("fp32+int8")
    chosen, _ = choose_paths(["fp32+int8"], known | {"int8_activations"})
    assert [p.name for p in chosen] == [REFERENCE, BASELINE, "fp32+int8"]
    with pytest.raises(SystemExit):
        choose_paths(["no-such-path"], known)


def test_a_run_on_fewer_windows_reuses_the_first_windows_figures(tmp_path):
    spec = {"tokens": [1, 2, 3], "starts": [0, 256, 512], "context": 256, "scored": 256,
            "cpu_class": "native"}
    assert is_prefix_run(dict(spec, starts=[0, 256]), spec)
    assert is_prefix_run(spec, spec)
    assert not is_prefix_run(dict(spec, starts=[0, 256, 512, 768]), spec)  # more windows
    assert not is_prefix_run(dict(spec, cpu_class="avx512"), spec)
    assert not is_prefix_run(dict(spec, context=128, starts=[0]), spec)
    np = pytest.importorskip("numpy")
    path = tmp_path / "fp32.npz"
    rows = {f"{mode}_{k}": v for mode in ("decode", "prompt") for k, v in (
        ("nll", np.array([1.0, 3.0])), ("kl", np.array([0.0, 0.5])),
        ("top1", np.array([7, 8])), ("ref_top1", np.array([7, 9])))}
    np.savez(path, **rows)
    first = load_metrics(path, 1)["decode"]
    assert (first.num_tokens, first.mean_nll, first.top1_agreement) == (1, 1.0, 1.0)
    assert load_metrics(path)["prompt"].mean_nll == pytest.approx(2.0)
    # a run on more rows than a path's figures cover measures it again
    assert measured_rows(path) == 2 and measured_rows(tmp_path / "bf16.npz") == 0


def test_every_path_sets_fields_the_engine_config_has_or_a_flag_being_added():
    from zeroserve.worker.config import EngineConfig

    fields = set(EngineConfig.__dataclass_fields__)
    pending = {"int8_activations"}  # issue 36's int8 path, behind its flag when it lands
    for path in PATHS:
        assert set(path.engine) <= fields | pending, path.name
    assert len({p.name for p in PATHS}) == len(PATHS)


def test_the_text_is_the_fixed_prose_named_in_the_data_readme():
    text = TEXT_PATH.read_text()
    assert len(text) == 30_702 and text.startswith("Execution model\n\nStructure of a program")
    assert TEXT_PATH.name in (TEXT_PATH.parent / "README.md").read_text()


@pytest.fixture(scope="module")
def text_tokens() -> list[int]:
    from zeroserve.gateway.text.tokenizer import load_tokenizer

    return load_tokenizer("default").encode(TEXT_PATH.read_text()[:600],
                                            add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_scored_rows_are_the_ones_the_engine_computes(dtype, text_tokens):
    """Decode mode's logits pick the very tokens the engine generates greedily from the same
    context, and prompt mode's give the engine's own prompt logprobs: the benchmark scores
    what the server computes, not a path of its own."""
    from benchmarks.bench_quality import decode_rows, prompt_rows, watch_logits
    from zeroserve.worker.config import EngineConfig
    from zeroserve.worker.engine import Engine
    from zeroserve.worker.model_runner import ModelRunner
    from zeroserve.worker.sequence import SamplingParams

    prompt, num_new = text_tokens[:80], 12
    config = EngineConfig(device="cpu", dtype=dtype, num_kv_blocks=32, max_num_seqs=4,
                          enable_prefix_caching=False)
    runner = ModelRunner(config)
    engine = Engine(config, runner=runner)
    engine.add_request("gen", prompt, SamplingParams(max_tokens=num_new, temperature=0.0,
                                                     ignore_eos=True, logprobs=0))
    engine.add_request("echo", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    generated, logprobs, expected = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "gen":
                generated += out.new_token_ids
                logprobs += [lp for lp, _ in out.logprobs]
            elif out.prompt_logprobs is not None:
                expected = out.prompt_logprobs

    captured = watch_logits(runner)
    tokens = prompt + generated
    context, scored = len(prompt), num_new - 1  # row j feeds generated[j], predicts j + 1
    rows = list(decode_rows(runner, captured, tokens, [0], context, scored, 1, 8))
    assert [first for first, _ in rows] == list(range(scored))
    assert [int(logits.argmax()) for _, logits in rows] == generated[1:]
    got = [float(torch.log_softmax(logits.float(), dim=-1)[0, token])
           for (_, logits), token in zip(rows, generated[1:], strict=True)]
    assert got == pytest.approx(logprobs[1:], abs=1e-5)

    # Prompt mode on the prompt alone: the rows after the first 40 give the engine's values.
    rows = list(prompt_rows(runner, captured, prompt, [0], 40, len(prompt) - 41, 1, 8))
    (_, logits), = rows
    got = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(prompt[41:])
    assert got.gather(1, targets[:, None])[:, 0].tolist() == pytest.approx(
        [lp for lp, _ in expected[40:]], abs=1e-5)
