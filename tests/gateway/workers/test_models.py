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


def test_an_alias_may_name_a_model_by_its_other_name(tmp_path):
    """The default model's file's display name is a name of it: an alias over it (from a
    flag, the admin call or the tier's file) targets the served name, so every listing finds
    the model (it was a KeyError in /v1/models on every call)."""
    models = catalog("chat=SmolLM2-135M-Instruct@v1:3,tiny:1")
    assert models.aliases["chat"].weights == ((Target("smollm", "v1"), 3), (Target("tiny"), 1))
    assert models.set_alias(alias_from_weights("chat", {"SmolLM2-135M-Instruct": 1})).weights \
        == ((Target("smollm"), 1),)
    path = tmp_path / "aliases.json"
    path.write_text('{"aliases": {"chat": {"SmolLM2-135M-Instruct@v2": 1}}}')
    shared = catalog(shared=AliasFile(path))
    assert shared.aliases["chat"].weights == ((Target("smollm", "v2"), 1),)
    assert shared.describe([])["aliases"][0]["weights"] == {"smollm@v2": 1}
    with pytest.raises(ValueError, match="twice"):  # the same model under both its names
        catalog("chat=smollm:1,SmolLM2-135M-Instruct:1")


def test_set_weights_keeps_another_gateways_earlier_change(tmp_path):
    """Each gateway of a tier changes one alias in the file under its lock: the second
    gateway, which has not read the first one's change yet, must not write it away."""
    clock = [0.0]
    path = tmp_path / "tier" / "aliases.json"
    one = catalog("chat=smollm@v1:100", shared=AliasFile(path, clock=lambda: clock[0]))
    two = catalog("chat=smollm@v1:100", shared=AliasFile(path, clock=lambda: clock[0]))
    one.set_alias(alias_from_weights("chat", {"smollm@v2": 1}))
    two.set_alias(alias_from_weights("fast", {"tiny": 1}))  # within its re-read interval
    three = catalog(shared=AliasFile(path))
    assert three.resolve("chat", key="a") == Target("smollm", "v2")
    assert three.resolve("fast", key="a") == Target("tiny")
    assert two.resolve("chat", key="a") == Target("smollm", "v2")  # taken with its own write
    assert (path.parent.stat().st_mode & 0o777) == 0o700


def test_concurrent_set_weights_lose_no_change(tmp_path):
    import threading

    path = tmp_path / "aliases.json"
    gateways = [catalog(shared=AliasFile(path)) for _ in range(4)]

    def change(index: int) -> None:
        for i in range(10):
            gateways[index].set_alias(alias_from_weights(f"a{index}-{i}", {"tiny": 1}))

    threads = [threading.Thread(target=change, args=(i,)) for i in range(len(gateways))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(catalog(shared=AliasFile(path)).aliases) == 40


@pytest.mark.parametrize("weight", ["1e400", "1" + "0" * 400, "NaN", "-1", "2000000"])
def test_a_weight_out_of_bounds_in_the_file_is_left_out_with_a_warning(tmp_path, caplog,
                                                                       weight):
    """A gateway starts (and serves on) with such a file: the flag's weights stay, and the
    log says which alias was left out and why (it was an OverflowError at start, and on
    every aliased request once written at run time)."""
    path = tmp_path / "aliases.json"
    path.write_text('{"aliases": {"chat": {"smollm@v2": ' + weight + '}, "fast": {"tiny": 1}}}')
    models = catalog("chat=smollm@v1:1", shared=AliasFile(path, check_interval_s=0))
    assert models.resolve("chat", key="a") == Target("smollm", "v1")
    assert models.resolve("fast", key="a") == Target("tiny")
    assert "'chat'" in caplog.text and "left out" in caplog.text
    path.write_text('{"aliases": {"chat": {"smollm@v1": 1, "smollm@v2": ' + weight + '}}}')
    assert models.resolve("chat", key="a") == Target("smollm", "v1")


@pytest.mark.parametrize("weight", [10**400, float("inf"), float("nan"), 1_000_001, -1],
                         ids=["10**400", "inf", "nan", "above", "negative"])
def test_a_weight_out_of_bounds_is_refused_when_set(weight):
    models = catalog("chat=smollm@v1:1")
    with pytest.raises(ValueError, match="at most 1,000,000"):
        models.set_alias(alias_from_weights("chat", {"smollm@v2": weight}))
    with pytest.raises(ValueError, match="at most 1,000,000"):
        parse_alias(f"chat=smollm@v2:{weight}")
    assert models.resolve("chat", key="a") == Target("smollm", "v1")
    assert alias_from_weights("chat", {"smollm@v2": 1_000_000}).shares() == {"smollm@v2": 1.0}
