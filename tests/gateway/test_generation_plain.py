"""A choice's short way through `consume` (gateway/generation.py, no stop strings and no
reasoning parser): the same updates, counts and finish as the general way, output by
output, to the end; the direct path's `take_one` makes what `take` makes."""

from __future__ import annotations

from zeroserve.common.protocol import TokenOutput
from zeroserve.gateway.api.openai_schema import SamplingOptions
from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.core import Gateway
from zeroserve.gateway.generation import RequestGroup
from zeroserve.gateway.text.tokenizer import load_tokenizer

TEXT = " héllo, wörld ✓ 😀 and \"quotes\"\n"


def one_choice_group(stop: tuple[str, ...] = ()) -> RequestGroup:
    tokenizer = load_tokenizer("default")
    group = RequestGroup(Gateway(GatewayConfig()))
    group.prompt_lengths.append(1)
    group.add([1], SamplingOptions(max_tokens=100).worker_params(100, 0), tokenizer, stop, True)
    return group


def outputs(request_id: str) -> list[TokenOutput]:
    """TEXT one token per output (a multi-byte character's pieces apart), then a finish."""
    ids = load_tokenizer("default").encode(TEXT, add_special_tokens=False)
    outs = [TokenOutput(request_id, [t], None, 1, k + 1, 0, None, None, attempt=1)
            for k, t in enumerate(ids)]
    outs[-1].finish_reason = "length"
    return outs


def updates(group: RequestGroup, one_by_one: bool) -> list[tuple]:
    state = group.choices[0].state
    made = []
    for out in outputs(state.request_id):
        if one_by_one:
            update = group.take_one(state, out)
        else:
            batch, error = group.take([(state, out)])
            assert error is None
            update = batch[0][0] if batch else None
        made.append(None if update is None else (update.text, update.token_ids,
                                                 update.finish_reason, update.reasoning))
    return made


def test_the_short_way_makes_what_the_general_way_makes():
    plain, general = one_choice_group(), one_choice_group()
    assert plain.choices[0].is_plain
    general.choices[0].is_plain = False  # the general way, for the same outputs
    made = updates(plain, one_by_one=True)
    assert made == updates(general, one_by_one=False)
    assert "".join(u[0] for u in made) == TEXT and made[-1][2] == "length"
    for group in (plain, general):
        choice = group.choices[0]
        assert choice.finish_reason == "length"
        assert choice.num_output_tokens == len(made)
    assert plain.usage() == general.usage()


def test_a_choice_with_stop_strings_takes_the_general_way():
    group = one_choice_group(stop=("wörld",))
    assert not group.choices[0].is_plain
    made = [u for u in updates(group, one_by_one=True) if u is not None]
    assert "".join(u[0] for u in made) == " héllo, " and made[-1][2] == "stop"
