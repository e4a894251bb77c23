"""The n-gram proposer and the speculative config (plain Python)."""

from __future__ import annotations

import pytest

from zeroserve.worker.speculative import (
    MAX_SPECULATIVE_TOKENS,
    SpecDecodeStats,
    SpeculativeConfig,
    propose_ngram,
)


def test_proposes_what_followed_the_last_ngram():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2], 2, 4, 3) == [3, 4, 5]


def test_takes_the_latest_earlier_occurrence():
    tokens = [1, 2, 7, 1, 2, 8, 9, 1, 2]
    assert propose_ngram(tokens, 2, 2, 2) == [8, 9]


def test_longest_ngram_first():
    # The 3-gram [5, 1, 2] occurs once (followed by 3); the 2-gram [1, 2] later (by 9).
    tokens = [5, 1, 2, 3, 4, 1, 2, 9, 5, 1, 2]
    assert propose_ngram(tokens, 2, 3, 1) == [3]
    assert propose_ngram(tokens, 2, 2, 1) == [9]


def test_no_match_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4, 5, 6], 1, 4, 4) == []
    assert propose_ngram([], 1, 4, 4) == []
    assert propose_ngram([7], 1, 4, 4) == []


def test_n_below_the_minimum_proposes_nothing():
    tokens = [1, 2, 3, 9, 2, 3]  # [2, 3] recurs, [9, 2, 3] does not
    assert propose_ngram(tokens, 3, 4, 2) == []
    assert propose_ngram(tokens, 2, 4, 2) == [9, 2]
    assert propose_ngram([4, 1, 4], 1, 1, 2) == [1, 4]


def test_k_caps_the_proposal_and_the_context_end_shortens_it():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose_ngram(tokens, 2, 2, 2) == [3, 4]
    assert propose_ngram(tokens, 2, 2, 0) == []
    # A repeating run: the latest earlier [7, 7] ends one before the end: one token after it.
    assert propose_ngram([7, 7, 7], 2, 2, 4) == [7]


def test_config_reads_vllms_json():
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, '
        '"prompt_lookup_min": 1, "disable_by_batch_size": 4}')
    assert config == SpeculativeConfig("ngram", 5, 3, 1, 4)
    assert SpeculativeConfig.from_json(config.to_json()) == config
    assert SpeculativeConfig.from_json("") is None
    assert SpeculativeConfig.from_json('{"method": null}') is None
    assert SpeculativeConfig.from_json('{"prompt_lookup_max": 6}').prompt_lookup_min == 2
    assert config.is_active(4) and not config.is_active(5)
    # The default steps aside beyond 8 running requests; null lets any batch speculate.
    assert SpeculativeConfig().is_active(8) and not SpeculativeConfig().is_active(9)
    assert SpeculativeConfig.from_json('{"disable_by_batch_size": null}').is_active(1000)


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ("[1]", "JSON object"),
    ('{"method": "eagle"}', "method"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    (f'{{"num_speculative_tokens": {MAX_SPECULATIVE_TOKENS + 1}}}', "num_speculative_tokens"),
    ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"disable_by_batch_size": 0}', "disable_by_batch_size"),
    ('{"num_speculative_tokens": "4"}', "integer"),
    ('{"model": "x"}', "unknown speculative config keys: model"),
])
def test_config_refuses_bad_json_clearly(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(text)


def test_stats_count_acceptance_per_position():
    stats = SpecDecodeStats()
    stats.record(4, 2)
    stats.record(3, 3)
    stats.record(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 5)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 1, 0]
    assert stats.acceptance_rate == pytest.approx(5 / 9)


def reference_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule as stated, by brute force: n from max_n down, the latest earlier match."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        pattern = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == pattern:
                return tokens[end:end + k] if k > 0 else []
    return []


def test_the_proposer_follows_the_rule_on_random_contexts():
    import random

    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(0, 5)
        assert propose_ngram(tokens, min_n, max_n, k) == reference_ngram(
            tokens, min_n, max_n, k), (tokens, min_n, max_n, k)
