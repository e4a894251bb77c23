"""The model catalog: names, versions, aliases by weight (split, stickiness, live changes)."""

from __future__ import annotations

import random

import pytest

from zeroserve.gateway.workers.alias_file import AliasFile
from zeroserve.gateway.workers.models import (
    Alias,
    ModelCatalog,
    Target,
    UnknownModel,
    alias_from_weights,
    parse_alias,
    parse_target,
)

NUM_REQUESTS = 20_000
# Binomial standard deviation at p = 0.1 over 20,000 draws is 0.0021: 0.01 is ~5 sigma.
TOLERANCE = 0.01


def catalog(*aliases: str, shared: AliasFile | None = None) -> ModelCatalog:
    names = {"smollm": "smollm", "SmolLM2-135M-Instruct": "smollm", "tiny": "tiny"}
    return ModelCatalog("smollm", names, [parse_alias(a) for a in aliases], shared)


def test_names_versions_and_unknown_models():
    models = catalog()
    assert models.resolve(None) == Target("smollm")
    assert models.resolve("SmolLM2-135M-Instruct") == Target("smollm")
    assert models.resolve("tiny") == Target("tiny")
    assert models.resolve("tiny@v2") == Target("tiny", "v2")
    for unknown in ("gpt-4o", "nope@v1", "@v1", "tiny@"):
        with pytest.raises(UnknownModel):
            models.resolve(unknown)
    assert models.model_of_worker("") == "smollm"  # an older worker: the default model
    assert models.model_of_worker("SmolLM2-135M-Instruct") == "smollm"
    assert models.model_of_worker("other") is None


def test_an_alias_splits_by_weight_within_tolerance():
    models = catalog("chat=smollm@v1:90,smollm@v2:10")
    keyed = [models.resolve("chat", key=f"user-{i}") for i in range(NUM_REQUESTS)]
    rng = random.Random(7)
    unkeyed = [models.resolve("chat", rng=rng) for _ in range(NUM_REQUESTS)]
    for picks in (keyed, unkeyed):
        share = picks.count(Target("smollm", "v2")) / NUM_REQUESTS
        assert abs(share - 0.10) < TOLERANCE, share
        assert set(picks) == {Target("smollm", "v1"), Target("smollm", "v2")}


def test_a_conversation_sticks_to_its_version():
    models = catalog("chat=smollm@v1:50,smollm@v2:50")
    for i in range(200):
        first = models.resolve("chat", key=f"conversation-{i}")
        assert all(models.resolve("chat", key=f"conversation-{i}") == first for _ in range(5))


def test_shifting_weight_moves_only_the_conversations_it_covers():
    """90/10 -> 50/50: every conversation on v2 stays there; of those on v1, the ones whose
    point now falls in v2's larger share move (about 4 in 9), the rest stay."""
    before = Alias("chat", ((Target("m", "v1"), 90), (Target("m", "v2"), 10)))
    after = Alias("chat", ((Target("m", "v1"), 50), (Target("m", "v2"), 50)))
    keys = [f"k{i}" for i in range(NUM_REQUESTS)]
    # the cumulative order puts v1 first: v2 covers [0.9, 1) before and [0.5, 1) after
    moved = [before.pick(k) != after.pick(k) for k in keys]
    assert all(after.pick(k) == Target("m", "v2") for k in keys
               if before.pick(k) == Target("m", "v2"))
    assert abs(sum(moved) / len(keys) - 0.40) < TOLERANCE


def test_zero_weight_takes_nothing_and_bad_aliases_are_refused():
    alias = parse_alias("chat=smollm@v1:1,smollm@v2:0")
    assert {alias.pick(f"k{i}") for i in range(1000)} == {Target("smollm", "v1")}
    for spec, why in [("chat", "ALIAS="), ("chat=smollm@v1:x", "not a number"),
                      ("chat=smollm@v1:0", "above 0"), ("chat=smollm@v1:-1", ">= 0"),
                      ("chat=smollm@v1:1,smollm@v1:2", "twice")]:
        with pytest.raises(ValueError, match=why):
            parse_alias(spec)
    with pytest.raises(ValueError, match="not a served model"):
        catalog("chat=gpt:1")
    with pytest.raises(ValueError, match="hide"):
        catalog("tiny=smollm:1")
    with pytest.raises(ValueError, match="must be a number"):
        alias_from_weights("chat", {"smollm": True})
    assert parse_target("a@b@v2") == Target("a@b", "v2")


def test_set_weights_reaches_every_gateway_sharing_the_file(tmp_path):
    """`serve --gateways N`: one gateway takes the admin call, the others read the file."""
    clock = [0.0]
    path = tmp_path / "aliases.json"
    one = catalog("chat=smollm@v1:100", shared=AliasFile(path, clock=lambda: clock[0]))
    two = catalog("chat=smollm@v1:100", shared=AliasFile(path, clock=lambda: clock[0]))
    one.set_alias(alias_from_weights("chat", {"smollm@v2": 1}))
    assert one.resolve("chat", key="a") == Target("smollm", "v2")
    clock[0] += 1.0  # past the re-read interval
    assert two.resolve("chat", key="a") == Target("smollm", "v2")
    # a new gateway of the tier starts with the tier's weights, not its flags'
    three = catalog("chat=smollm@v1:100", shared=AliasFile(path))
    assert three.resolve("chat", key="a") == Target("smollm", "v2")
    path.write_text("{not json")
    clock[0] += 1.0
    assert two.resolve("chat", key="a") == Target("smollm", "v2")  # a bad file changes nothing
