"""Speculative decoding in the engine core, on the FakeRunner (which checks every plan and
simulates the KV cache, so a wrong rollback shows as a wrong cached token): the same tokens
as without drafts, rolled-back blocks, preemption, credit, stops and limits."""

from __future__ import annotations

import random

import pytest

from tests.worker.factories import make_engine, make_params, make_scheduler, make_seq
from tests.worker.test_grammar import EOS, VOCAB
from zeroserve.common.model_files import default_model_path
from zeroserve.worker.draft_policy import MIN_BACKOFF, DraftState
from zeroserve.worker.engine import Engine
from zeroserve.worker.grammar import GGUFVocabulary, GrammarCompiler
from zeroserve.worker.sequence import FinishReason, SamplingParams, SequenceStatus
from zeroserve.worker.speculative import SpeculativeConfig

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.fixture(scope="module")
def vocabulary() -> GGUFVocabulary:
    return GGUFVocabulary.read(default_model_path(), [EOS])


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(default_model_path(), VOCAB, (EOS,))


def copy_engine(speculative: SpeculativeConfig | None = SPEC, **overrides) -> Engine:
    """An engine whose fake model copies its context (input-grounded): drafts are proposed,
    often accepted and sometimes rejected."""
    return make_engine({"copy_context": True}, speculative_config=speculative, **overrides)


def random_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # A small alphabet: n-grams recur, with different continuations (rejections).
    return [[rng.randrange(10, 16) for _ in range(length)] for _ in range(num)]


def check_blocks(engine: Engine) -> None:
    """Every block held is held by exactly its ref_count tables, and each running
    sequence's table covers exactly its computed tokens (nothing left of rejected drafts)."""
    scheduler, bm = engine.scheduler, engine.block_manager
    holders: dict[int, int] = {}
    seqs = [*scheduler.running, *scheduler.paused.values()]
    for seq in seqs:
        for block_id in seq.block_table:
            holders[block_id] = holders.get(block_id, 0) + 1
    for block_id, count in holders.items():
        assert bm.ref_count(block_id) == count
    assert bm.num_used_blocks == len(holders)
    for seq in scheduler.running:
        assert len(seq.block_table) == bm.num_blocks_for(seq.num_computed_tokens)


def run(engine: Engine, prompts, params, check=True) -> list[list[int]]:
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, p, sp)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if check:
            check_blocks(engine)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks  # nothing leaked
    return [tokens[rid] for rid in ids]


@pytest.mark.parametrize("seed", range(4))
def test_same_tokens_with_drafts_and_rejected_slots_rolled_back(seed):
    prompts = random_prompts(6, 11 + seed, seed)
    params = [make_params(max_tokens=30 + i) for i in range(len(prompts))]
    expected = run(copy_engine(None), prompts, params)
    engine = copy_engine()
    assert run(engine, prompts, params) == expected
    stats = engine.stats().spec_decode
    assert stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both kinds happened
    assert engine.stats().num_steps < copy_engine(None).stats().num_steps + 1000


def test_fewer_steps_for_input_grounded_output():
    prompts = [list(range(10, 40)) * 2]
    params = [make_params(max_tokens=40)]
    plain, spec = copy_engine(None), copy_engine()
    assert run(spec, prompts, params) == run(plain, prompts, params)
    assert spec.stats().num_steps * 3 < plain.stats().num_steps


def test_preemption_with_drafts_in_flight_keeps_tokens_and_blocks():
    # A pool too small for everyone: sequences are preempted and recomputed, drafts or not.
    prompts = random_prompts(6, 14, seed=9)
    params = [make_params(max_tokens=40)] * len(prompts)
    expected = run(copy_engine(None, num_kv_blocks=24), prompts, params)
    engine = copy_engine(num_kv_blocks=24)
    assert run(engine, prompts, params) == expected
    assert engine.stats().num_preemptions > 0
    assert engine.stats().spec_decode.num_drafts > 0


def test_prefix_cache_never_holds_unverified_tokens():
    engine = copy_engine()
    prompt = list(range(10, 30)) * 2
    first = run(engine, [prompt], [make_params(max_tokens=24)])
    # Every cached block's tokens are the sequence's real tokens at that place.
    full = prompt + first[0]
    for block in engine.block_manager._blocks:
        if block.hash is not None:
            assert any(tuple(full[i:i + 4]) == block.token_ids for i in range(0, len(full), 4))
    # A second request over prompt + output hits the cache and still gets the same tokens.
    again = run(engine, [full[:50]], [make_params(max_tokens=8)])
    assert again == run(copy_engine(None), [full[:50]], [make_params(max_tokens=8)])


def test_drafts_never_exceed_the_credit_window():
    engine = copy_engine()
    engine.add_request("r", list(range(10, 30)) * 2, make_params(max_tokens=64))
    engine.set_credit_limit("r", 6)
    got: list[int] = []
    for _ in range(20):
        plan_outputs = engine.step()
        for out in plan_outputs:
            got += out.new_token_ids
        if len(got) >= 6:
            engine.pause("r")
            break
    assert len(got) == 6  # never past the window, though drafts would have gone further
    engine.set_credit_limit("r", 20)
    engine.resume("r")
    while len(got) < 20:
        for out in engine.step():
            got += out.new_token_ids
    assert len(got) == 20
    engine.abort("r")


def test_credit_caps_the_number_of_drafts():
    scheduler, runner = make_scheduler(speculative_config=SPEC)
    seq = make_seq(prompt_token_ids=list(range(10, 20)) * 2, max_tokens=50)
    scheduler.add(seq)
    scheduler.update(plan := scheduler.schedule(), runner.execute(plan))  # the prefill
    seq.output_token_ids[-1] = 10  # so that [..., 19, 10] recurs: drafts 11, 12, 13, 14
    seq.credit_limit = len(seq.output_token_ids) + 3
    plan = scheduler.schedule()
    assert plan.chunks[0].draft_token_ids == [11, 12]  # 1 + 2 tokens fit the window
    seq.credit_limit = len(seq.output_token_ids) + 1
    scheduler.update(plan, runner.execute(plan))
    assert scheduler.schedule().chunks[0].draft_token_ids is None


def test_a_stop_token_inside_accepted_drafts_ends_the_stream_there():
    prompt = list(range(10, 30)) * 2
    for params in (make_params(max_tokens=40, stop_token_ids=(17,)),
                   make_params(max_tokens=7), make_params(max_tokens=40, min_tokens=12,
                                                         stop_token_ids=(12,))):
        expected = run(copy_engine(None), [prompt], [params])
        engine = copy_engine()
        finished = []
        engine.add_request("r", prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                if out.is_finished:
                    finished.append(out.finish_reason)
        assert [tokens] == expected
        assert finished == [FinishReason.STOP if params.stop_token_ids else FinishReason.LENGTH]


def test_paused_mid_step_gives_back_the_draft_blocks():
    scheduler, runner = make_scheduler(speculative_config=SPEC)
    seq = make_seq(prompt_token_ids=list(range(10, 20)) * 2, max_tokens=50)
    scheduler.add(seq)
    scheduler.update(plan := scheduler.schedule(), runner.execute(plan))
    seq.output_token_ids[-1] = 10
    seq.draft_state = DraftState(num_accepted=9.0, num_judged=9.0)  # drafts always right
    plan = scheduler.schedule()
    assert len(plan.chunks[0].draft_token_ids) == 4
    bm = scheduler.block_manager
    assert len(seq.block_table) == bm.num_blocks_for(seq.num_computed_tokens + 5)
    sampled = runner.execute(plan)
    scheduler.pause(seq.request_id)  # the stream ran out of credit while it computed
    scheduler.update(plan, sampled)
    assert seq.status is SequenceStatus.PAUSED and seq.output_token_ids[-1] == 10
    assert len(seq.block_table) == bm.num_blocks_for(seq.num_computed_tokens + 1)
    scheduler.resume(seq.request_id)
    plan = scheduler.schedule()
    assert plan.chunks[0].draft_token_ids == [11, 12, 13, 14]  # it speculates again
    num_before = len(seq.output_token_ids)
    scheduler.update(plan, runner.execute(plan))  # the fake runner checks the cached K/V
    num_new = len(seq.output_token_ids) - num_before
    assert 1 <= num_new <= 5
    assert seq.num_computed_tokens == seq.num_tokens - 1
    assert len(seq.block_table) == bm.num_blocks_for(seq.num_computed_tokens)


def test_large_batches_decode_without_drafts():
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                               disable_by_batch_size=2)
    prompts = [list(range(10 + 20 * i, 20 + 20 * i)) * 2 for i in range(3)]
    engine = copy_engine(config, max_num_batched_tokens=64)
    engine.add_request("a", prompts[0], make_params(max_tokens=30))
    engine.add_request("b", prompts[1], make_params(max_tokens=30))
    for _ in range(3):
        engine.step()
    assert engine.stats().spec_decode.num_drafts > 0
    engine.add_request("c", prompts[2], make_params(max_tokens=30))
    engine.step()
    num_drafts = engine.stats().spec_decode.num_drafts
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 3
    assert engine.stats().spec_decode.num_drafts == num_drafts  # three running: no drafts


def test_constrained_drafts_end_at_the_first_token_the_grammar_forbids(compiler, vocabulary):
    from zeroserve.worker.grammar import GrammarSpec

    ab, cd, x, z = (vocabulary(t)[0] for t in ("ab", "cd", "x", "z"))
    scheduler, runner = make_scheduler(speculative_config=SPEC)
    # Context "z ab cd x z" + the output "ab": "z ab" recurs, so the proposal is cd x z ab.
    seq = make_seq(prompt_token_ids=[z, ab, cd, x, z], max_tokens=50)
    state = compiler.attach(GrammarSpec("regex", "(ab|cd)+"))
    seq.params = SamplingParams(max_tokens=50, temperature=0.0, grammar=state)
    scheduler.add(seq)
    scheduler.update(plan := scheduler.schedule(), runner.execute(plan))
    seq.output_token_ids[-1] = ab
    plan = scheduler.schedule()
    assert plan.chunks[0].draft_token_ids == [cd]  # x is not allowed after "ab cd": cut
    assert state.failed is None and state.num_consumed == 1  # validated, not consumed


def test_a_failed_over_stream_speculates_again_from_its_context():
    """Failover resubmits prompt + the tokens so far: the new engine proposes drafts from
    that context at once, and the continuation equals the undisturbed run's."""
    prompt = random_prompts(1, 16, seed=3)[0] + list(range(10, 30)) * 2
    params = make_params(max_tokens=40)
    [whole] = run(copy_engine(), [prompt], [params])
    moved = copy_engine()
    moved.add_request("r", prompt, params, output_token_ids=whole[:15])
    sizes = record_draft_sizes(moved)
    rest: list[int] = []
    while moved.has_unfinished():
        for out in moved.step():
            rest += out.new_token_ids
    assert whole[:15] + rest == whole
    assert moved.stats().spec_decode.num_accepted_tokens > 0
    # The moved stream's draft lengths start afresh on the new worker, and grow again.
    proposed = [n for n in sizes if n]
    assert proposed[0] == 2 and max(proposed) == SPEC.num_speculative_tokens


def record_draft_sizes(engine: Engine) -> list[int]:
    """The number of drafts of the first chunk of each plan the engine runs from now on."""
    sizes: list[int] = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        if plan.chunks:
            sizes.append(len(plan.chunks[0].draft_token_ids or ()))
        return plan

    engine.scheduler.schedule = recording
    return sizes


def test_drafts_grow_while_accepted():
    config = SpeculativeConfig(num_speculative_tokens=7, prompt_lookup_max=3,
                               prompt_lookup_min=1)
    prompt = list(range(10, 70)) * 2  # copied: every draft is right
    plain, spec = copy_engine(None), copy_engine(config)
    sizes = record_draft_sizes(spec)
    params = [make_params(max_tokens=50)]
    assert run(spec, [prompt], params) == run(plain, [prompt], params)
    proposed = [n for n in sizes if n]
    assert proposed[:4] == sorted(proposed[:4]) and proposed[0] == 2
    assert proposed[3] == 7 and proposed.count(7) >= 4
    stats = spec.stats().spec_decode
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_stream_whose_drafts_fail_backs_off_and_probes_later():
    """Every draft wrong (the fake model never continues the n-gram): proposals shrink to
    one draft, stop, and come back as single-draft probes ever further apart."""
    scheduler, runner = make_scheduler(speculative_config=SPEC, max_model_len=512,
                                       num_kv_blocks=160)
    seq = make_seq(prompt_token_ids=list(range(10, 20)) * 3, max_tokens=300)
    scheduler.add(seq)
    scheduler.update(plan := scheduler.schedule(), runner.execute(plan))
    sizes = []
    for _ in range(120):
        seq.output_token_ids[-1] = 10  # the proposal is always 11, 12, ...
        plan = scheduler.schedule()
        drafts = plan.chunks[0].draft_token_ids or []
        sizes.append(len(drafts))
        sampled = runner.execute(plan)
        assert not sampled[0].accepted_token_ids  # the fake model says otherwise
        scheduler.update(plan, sampled)
    proposals = [i for i, n in enumerate(sizes) if n]
    assert sizes[0] == 2 and all(n <= 2 for n in sizes)
    gaps = [b - a for a, b in zip(proposals, proposals[1:], strict=False)]
    assert gaps[:2] == [1, 1]  # tried again at once, then gave up for a while
    assert max(gaps) >= 2 * MIN_BACKOFF and gaps[2:] == sorted(gaps[2:])
    assert len(proposals) < 10  # of 120 steps


def test_drafts_never_preempt_anyone():
    """With the pool full, a decode's own token may still preempt someone, as without
    speculation, but never for a draft: its drafts get only the slots left in the block its
    token took."""
    scheduler, runner = make_scheduler(speculative_config=SPEC, num_kv_blocks=6)
    seq = make_seq(prompt_token_ids=list(range(10, 18)) * 2 + [10, 11, 12, 13], max_tokens=4)
    filler = make_seq(prompt_token_ids=[99] * 4, max_tokens=4)
    scheduler.add(seq)
    scheduler.add(filler)
    scheduler.update(plan := scheduler.schedule(), runner.execute(plan))
    bm = scheduler.block_manager
    assert seq.num_computed_tokens == 20 and len(seq.block_table) == 5  # all full
    assert bm.num_free_blocks == 0
    seq.output_token_ids[-1] = 14  # [.., 13, 14] recurs: drafts would be 15, 16, ...
    plan = scheduler.schedule()
    assert plan.chunks[0].request_id == seq.request_id
    assert plan.preempted == [filler.request_id]  # for its own token
    assert plan.chunks[0].draft_token_ids == [15, 16]  # max_tokens allows two
    assert len(seq.block_table) == 6  # one block, for its own token


def test_the_credit_limit_reaches_a_request_still_compiling_its_grammar():
    from zeroserve.worker.grammar import GrammarCompiler, GrammarSpec

    engine = copy_engine()
    engine.grammar_compiler = GrammarCompiler(default_model_path(), VOCAB, (EOS,))
    engine.add_request("g", [1, 2, 3], make_params(max_tokens=8),
                       grammar=GrammarSpec("regex", "[0-9]{1,3}q" * 7))
    engine.set_credit_limit("g", 5)
    seq = engine._grammars.get("g") or engine.scheduler.get("g")
    assert seq is not None and seq.credit_limit == 5
    engine.abort("g")


def test_drafts_from_text_finished_for_another_request():
    """A request whose own context has no match takes its drafts from an earlier request's
    output (RecentText): the same prompt again under the fake model (whose next token is a
    function of the last one and the position) is produced in far fewer steps, with the same
    tokens; with recent_ngrams 0 it takes as many steps as the first time."""
    prompt = [[11, 12, 13, 14, 15]]
    params = [make_params(max_tokens=40)]

    def steps_of_each(recent_ngrams: int) -> tuple[list[int], list[int], Engine]:
        config = SpeculativeConfig(num_speculative_tokens=7, prompt_lookup_max=3,
                                   prompt_lookup_min=2, recent_ngrams=recent_ngrams)
        engine = make_engine({}, speculative_config=config)
        counts = []
        for _ in range(2):
            before = engine.stats().num_steps
            tokens = run(engine, prompt, params)
            counts.append(engine.stats().num_steps - before)
        return tokens, counts, engine

    expected = run(make_engine({}, speculative_config=None), prompt, params)
    tokens, counts, engine = steps_of_each(200_000)
    assert tokens == expected
    assert counts[1] * 3 < counts[0]
    assert len(engine.scheduler.recent_text) > 0
    tokens, counts, _ = steps_of_each(0)
    assert tokens == expected and counts[1] == counts[0]


def test_recent_text_keeps_the_newest_occurrences_within_its_capacity():
    from zeroserve.worker.speculative import RecentText

    text = RecentText(min_n=2, max_n=3, capacity=100)
    text.add([1, 2], [3, 4, 5, 6])
    assert text.propose([9, 2, 3], 5) == [4, 5, 6]  # an n-gram from the prompt's end
    assert text.propose([9, 4, 5], 2) == [6]
    assert text.propose([7, 6], 3) == []  # nothing followed the output's end
    text.add([], [4, 5, 8, 8])
    assert text.propose([4, 5], 2) == [8, 8]  # the newest occurrence wins
    small = RecentText(min_n=2, max_n=2, capacity=3)
    small.add([], list(range(10)))
    assert len(small) == 3 and small.propose([7, 8], 1) == [9] and small.propose([1, 2], 1) == []
    RecentText(2, 4, 0).add([1], [2, 3])  # capacity 0 keeps nothing


def test_recent_text_indexes_finished_text_only_when_a_draft_is_asked_for():
    """A step in which 1,000 requests finish (drafting is off at that batch size) does no
    indexing: the relay's last-token step spent a third of its time there. What is kept
    unindexed is bounded by the table's capacity, and drafts come out as from eager indexing."""
    from zeroserve.worker.speculative import RecentText

    text = RecentText(min_n=2, max_n=3, capacity=400)
    for i in range(1000):
        text.add([1, 2], [1000 + i, 2000 + i] * 10)  # 20 tokens: at most 40 n-grams each
    assert not text._next  # nothing indexed yet
    assert len(text._pending) <= 400 // 40 + 1  # only the newest that the table could hold
    assert text.propose([1999, 2999], 3) == [1999, 2999]  # the newest text's, last occurrence
    assert text.propose([1000, 2000], 3) == []  # the oldest: dropped, as eager eviction would
    assert 0 < len(text) <= 400


def test_drafts_take_only_blocks_left_after_every_plain_decode():
    # Two decoding streams and one free block. The older one's drafts would need that block;
    # the newer one's plain decode crosses a block boundary and needs it. The decode gets
    # it: drafts never cost another stream its step (nor a preemption and a recompute).
    from zeroserve.worker.plan import SampledToken

    scheduler, _ = make_scheduler(speculative_config=SPEC, num_kv_blocks=5,
                                  enable_prefix_caching=False)
    older = make_seq(prompt_token_ids=[5, 6, 7, 5, 6, 7, 5], request_id="older")
    newer = make_seq(prompt_token_ids=list(range(20, 28)), request_id="newer")
    scheduler.add(older)
    scheduler.add(newer)
    plan = scheduler.schedule()  # both prompts, whole: 2 blocks each
    scheduler.update(plan, [SampledToken("older", 6), SampledToken("newer", 30)])
    assert scheduler.block_manager.num_free_blocks == 1
    plan = scheduler.schedule()
    assert [c.request_id for c in plan.chunks] == ["older", "newer"]
    assert scheduler.num_preemptions == 0 and not plan.preempted
    assert not plan.chunks[0].draft_token_ids  # no block was left for them
    assert newer.status is SequenceStatus.RUNNING


def test_drafts_still_come_when_blocks_are_left_after_the_decodes():
    from zeroserve.worker.plan import SampledToken

    scheduler, _ = make_scheduler(speculative_config=SPEC, num_kv_blocks=6,
                                  enable_prefix_caching=False)
    older = make_seq(prompt_token_ids=[5, 6, 7, 5, 6, 7, 5], request_id="older")
    newer = make_seq(prompt_token_ids=list(range(20, 28)), request_id="newer")
    scheduler.add(older)
    scheduler.add(newer)
    plan = scheduler.schedule()
    scheduler.update(plan, [SampledToken("older", 6), SampledToken("newer", 30)])
    plan = scheduler.schedule()
    assert [c.request_id for c in plan.chunks] == ["older", "newer"]
    assert plan.chunks[0].draft_token_ids == [7]  # a first proposal probes with one
    assert scheduler.num_preemptions == 0
    assert scheduler.block_manager.num_free_blocks == 0
