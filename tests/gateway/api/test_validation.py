"""Request validation (no server): typed requests out, OpenAI-shaped 4xx errors otherwise."""

from __future__ import annotations

import json
import logging

import pytest

from zeroserve.gateway.api.limits import RequestLimits
from zeroserve.gateway.api.openai_schema import (
    check_context,
    parse_chat,
    parse_completion,
    parse_tokenize,
)
from zeroserve.gateway.errors import APIError
from zeroserve.gateway.http.request_body import is_json_content_type
from zeroserve.gateway.http.request_body import parse_json_bytes as parse_json_body
from zeroserve.gateway.logging import JsonFormatter

NAMES = ("served", "SmolLM2-135M-Instruct")


def error_of(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    return e.value


def test_completion_defaults_and_params():
    req = parse_completion({"model": "served", "prompt": "hi"}, NAMES)
    assert req.prompts == ["hi"] and req.sampling.max_tokens == 16 and not req.stream
    req = parse_completion({"prompt": [[1, 2], [3]], "n": 3, "seed": 5, "stop": "x",
                            "stream": True, "stream_options": {"include_usage": True},
                            "top_k": -1, "logprobs": 2}, NAMES)
    assert req.prompts == [[1, 2], [3]] and req.include_usage and req.sampling.top_k == 0
    assert req.sampling.stop == ("x",) and req.sampling.logprobs == 2
    seeds = [req.sampling.worker_params(10, i)["seed"] for i in range(3)]
    assert seeds == [5, 6, 7]
    assert parse_completion({"prompt": "x"}, NAMES).sampling.worker_params(4, 1)["seed"] is None


def test_chat_max_completion_tokens_wins_and_logprobs():
    req = parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
                      "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3}, NAMES)
    assert req.sampling.max_tokens == 7 and req.sampling.logprobs == 3
    req = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True},
                     NAMES)
    assert req.sampling.logprobs == 0  # chosen-token logprobs, no alternatives
    req = parse_chat({"messages": [{"role": "user", "content": "x"}]}, NAMES)
    assert req.sampling.max_tokens is None and req.sampling.logprobs is None


def test_content_parts_are_joined_and_assistant_may_be_empty():
    req = parse_chat({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                     "text": "b"}]},
        {"role": "assistant", "content": None}]}, NAMES)
    assert [m["content"] for m in req.prompt.messages] == ["a\nb", ""]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "min_p": -0.1}, "min_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 5}}, "logit_bias"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", [1]]}, "prompt"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
])
def test_completion_mistakes(body, param):
    e = error_of(parse_completion, body, NAMES)
    assert e.status == 400 and e.param == param
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404_and_missing_model_is_the_served_one():
    e = error_of(parse_completion, {"model": "nope", "prompt": "x"}, NAMES)
    assert e.status == 404 and e.code == "model_not_found"
    assert parse_completion({"prompt": "x"}, NAMES).model == "served"
    assert parse_completion({"prompt": "x", "model": NAMES[1]}, NAMES).model == NAMES[1]


def test_chat_rejects_malformed_tools_and_response_format():
    # (tools and response_format themselves: tests/gateway/api/test_structured_output.py)
    msgs = [{"role": "user", "content": "x"}]
    assert error_of(parse_chat, {"messages": msgs, "tools": [{"type": "function"}]},
                    NAMES).param == "tools[0]"
    assert error_of(parse_chat, {"messages": msgs, "response_format": {
        "type": "xml"}}, NAMES).param == "response_format.type"
    parse_chat({"messages": msgs, "tools": [], "response_format": {"type": "text"}}, NAMES)


def test_bad_json_bodies():
    assert error_of(parse_json_body, b"{").status == 400
    assert error_of(parse_json_body, b"[1]").status == 400
    assert error_of(parse_json_body, b"\xff\xfe").status == 400
    assert parse_json_body(b'{"a": 1}') == {"a": 1}


def test_context_checks():
    assert check_context(10, None, 100) == 90  # chat default: the rest of the context
    assert check_context(10, None, 100, max_tokens_limit=50) == 50  # ... at most the cap
    assert check_context(80, None, 100, max_tokens_limit=50) == 20
    assert check_context(10, 90, 100) == 90
    e = error_of(check_context, 10, 91, 100)
    assert e.param == "max_tokens" and "101 tokens" in e.message
    assert error_of(check_context, 100, 1, 100).param == "prompt"
    assert error_of(check_context, 0, 1, 100).message == "The prompt is empty."


def test_tokenize_bodies():
    assert parse_tokenize({"prompt": "x"}, NAMES) == {"prompt": "x",
                                                      "add_special_tokens": True}
    spec = parse_tokenize({"messages": [{"role": "user", "content": "x"}]}, NAMES)
    assert spec["add_special_tokens"] is False and spec["chat"].add_generation_prompt is True
    assert error_of(parse_tokenize, {}, NAMES).status == 400


def test_json_log_lines_carry_request_ids():
    record = logging.LogRecord("zeroserve.api", logging.INFO, __file__, 1, "request", (),
                               None)
    record.request_id = "cmpl-1"
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "request" and line["request_id"] == "cmpl-1"
    assert line["level"] == "info" and line["time"].endswith("Z")


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_fast_chunk_rendering_matches_the_plain_shape(kind, include_usage):
    from zeroserve.gateway.api.responses import ResponseContext, chat_chunk, completion_chunk
    from zeroserve.gateway.generation import ChoiceUpdate

    ctx = ResponseContext(kind, 'model "quoted" ü', include_usage)
    build = chat_chunk if kind == "chat" else completion_chunk
    lp = {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]}
    for update, logprobs in [(ChoiceUpdate(0, 'te"xt\n😀', [1], None, None), None),
                             (ChoiceUpdate(3, "", [], None, "stop"), None),
                             (ChoiceUpdate(1, "a", [97], [[-0.5, []]], "length"), lp)]:
        raw = build(ctx, update, logprobs)
        assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
        choice = {"index": update.index, "logprobs": logprobs,
                  "finish_reason": update.finish_reason}
        if kind == "chat":
            choice["delta"] = {"content": update.text} if update.text else {}
        else:
            choice["text"] = update.text
        assert json.loads(raw[6:]) == ctx.chunk([choice])


# --- limits and hostile shapes --------------------------------------------------------------

LIMITS = RequestLimits(vocab_size=1000, max_tokens_limit=100, max_prompt_chars=50,
                       max_engine_requests=8, max_messages=3, max_stop_token_ids=4)
HUGE = 10 ** 400  # float() of it raises OverflowError


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "temperature": HUGE}, "temperature"),
    ({"prompt": "x", "top_p": HUGE}, "top_p"),
    ({"prompt": "x", "presence_penalty": -HUGE}, "presence_penalty"),
    ({"prompt": "x", "max_tokens": HUGE}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 101}, "max_tokens"),
    ({"prompt": "x", "top_k": 2 ** 64}, "top_k"),
    ({"prompt": "x", "top_k": 2 ** 31}, "top_k"),
    ({"prompt": "x", "seed": 2 ** 64}, "seed"),
    ({"prompt": "x", "seed": -(2 ** 63) - 1}, "seed"),
    ({"prompt": "x", "n": HUGE}, "n"),
    ({"prompt": "x", "logprobs": 2 ** 70}, "logprobs"),
    ({"prompt": "x", "min_tokens": 2 ** 63}, "min_tokens"),
    ({"prompt": "x", "stop_token_ids": [2 ** 64]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [1000]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": ["1"]}, "stop_token_ids"),
    ({"prompt": "x", "repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"prompt": "x", "repetition_penalty": 1e300}, "repetition_penalty"),
    ({"prompt": "x" * 51}, "prompt"),
    ({"prompt": ["x"] * 3, "n": 3}, "n"),
])
def test_every_number_is_range_checked_before_conversion(body, param):
    e = error_of(parse_completion, body, NAMES, LIMITS)
    assert e.status == 400 and e.param == param, e.message
    assert len(e.message) < 200  # no 400-digit number echoed back


def test_values_that_mean_off_or_greedy_are_normalised():
    s = parse_completion({"prompt": "x", "top_k": 1000, "temperature": 1e-6, "top_p": 1e-300,
                          "seed": 2 ** 64 - 1}, NAMES, LIMITS).sampling
    assert s.top_k == 0  # the whole vocabulary: the same as off
    assert s.temperature == 0.0  # greedy, as vLLM does below 1e-5
    assert s.top_p == 1e-5  # keeps the top token, and is not 0 in float32
    assert 0 <= s.worker_params(10, 1)["seed"] < 2 ** 63
    s = parse_completion({"prompt": "x", "top_k": 999, "temperature": 1e-5}, NAMES,
                         LIMITS).sampling
    assert s.top_k == 999 and s.temperature == 1e-5


def test_chat_limits():
    msg = {"role": "user", "content": "x"}
    assert error_of(parse_chat, {"messages": [msg] * 4}, NAMES, LIMITS).param == "messages"
    e = error_of(parse_chat, {"messages": [{"role": "user", "content": "x" * 30}] * 2},
                 NAMES, LIMITS)
    assert e.param == "messages" and e.code == "prompt_too_long"
    e = error_of(parse_chat, {"messages": [msg], "max_completion_tokens": 101}, NAMES, LIMITS)
    assert e.param == "max_completion_tokens"
    assert error_of(parse_chat, {"messages": [msg], "n": 9}, NAMES, LIMITS).param == "n"
    e = error_of(parse_chat, {"messages": [msg], "chat_template_kwargs": {"messages": []}},
                 NAMES, LIMITS)
    assert e.param == "chat_template_kwargs"
    assert parse_chat({"messages": [msg] * 3}, NAMES, LIMITS).sampling.max_tokens is None


def test_tokenize_limits():
    assert error_of(parse_tokenize, {"prompt": "x" * 51}, NAMES, LIMITS).param == "prompt"
    msgs = [{"role": "user", "content": "x"}] * 4
    assert error_of(parse_tokenize, {"messages": msgs}, NAMES, LIMITS).param == "messages"


def test_deep_json_is_400_at_any_depth():
    for depth in (65, 1000, 100_000):
        raw = b'{"a": ' + b"[" * depth + b"]" * depth + b"}"
        e = error_of(parse_json_body, raw)
        assert e.status == 400 and "deeper than 64" in e.message
    ok = b'{"a": ' + b"[" * 60 + b"]" * 60 + b"}"
    assert parse_json_body(ok) == json.loads(ok)


def test_big_integers_are_400():
    for raw in (b'{"temperature": 1' + b"0" * 400 + b"}", b'{"a": ' + b"9" * 5000 + b"}",
                b'{"prompt": [1, 2, 1' + b"0" * 30 + b"]}"):
        e = error_of(parse_json_body, raw)
        assert e.status == 400 and "integer" in e.message
    assert parse_json_body(b'{"seed": 18446744073709551615}')["seed"] == 2 ** 64 - 1


@pytest.mark.parametrize("raw", [
    b'{"prompt": "a\\ud800b"}',
    b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"model": "\\uD83D"}',
    b'{"stop": ["x", "\\ud83d"]}',
    b'{"\\ud800": 1}',
    b'{"prompt": "\xed\xa0\x80"}',  # a surrogate in raw bytes: not UTF-8 at all
])
def test_lone_surrogates_anywhere_are_400(raw):
    e = error_of(parse_json_body, raw)
    assert e.status == 400 and ("surrogate" in e.message or "UTF-8" in e.message)


def test_escaped_surrogate_pairs_are_fine():
    assert parse_json_body(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "😀"}


@pytest.mark.parametrize("raw", [
    json.dumps({"prompt": list(range(1, 300_000))}).encode(),  # many values: Python scanner
    json.dumps({"prompt": "x" * 2_000_000}).encode(),  # one big string: the C parser
    b'{"a": [' + b",".join([b"9" * 19] * 20_000) + b"]}",  # many digits
])
def test_large_bodies_parse_the_same_either_way(raw):
    assert parse_json_body(raw) == json.loads(raw)


def test_large_body_deep_or_huge_is_still_400():
    deep = b'{"p": [' + b",".join([b"[" * 70 + b"]" * 70] * 3000) + b"]}"
    assert "deeper" in error_of(parse_json_body, deep).message
    huge = b'{"p": [' + b",".join([b"1" * 30] * 30_000) + b"]}"
    assert "integer" in error_of(parse_json_body, huge).message


def test_submit_must_fit_a_frame():
    from zeroserve.common.protocol import MAX_FRAME_BYTES
    from zeroserve.gateway.api.limits import check_submit_fits

    check_submit_fits([1] * 1000, {"max_tokens": 5}, 32)
    e = error_of(check_submit_fits, [2 ** 31] * (MAX_FRAME_BYTES // 5 + 1), {}, 32)
    assert e.status == 400 and e.code == "request_too_large"


@pytest.mark.parametrize(("value", "ok"), [
    ("application/json", True), ("application/json; charset=utf-8", True),
    ("Application/JSON;charset=UTF-8", True), ("application/vnd.api+json", True),
    ("text/plain", False), ("application/x-www-form-urlencoded", False), (None, False),
    ("", False), ("multipart/form-data; boundary=x", False),
])
def test_json_content_types(value, ok):
    assert is_json_content_type(value) is ok
