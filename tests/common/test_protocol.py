"""The wire codec: every message survives a round trip, and every bad frame is a ProtocolError."""

from __future__ import annotations

import random
from dataclasses import astuple, fields

import msgpack
import pytest

from zeroserve.common.protocol import (
    MAX_FLOW,
    MAX_FRAME_BYTES,
    MAX_PRIORITY,
    MESSAGE_CLASSES,
    PROTOCOL_VERSION,
    Abort,
    Credit,
    DebugReply,
    DebugRequest,
    Drain,
    Error,
    Heartbeat,
    Hello,
    Message,
    MsgType,
    ProtocolError,
    Ready,
    Shutdown,
    Submit,
    TokenOutput,
    Tokens,
    Undrain,
    WorkerState,
    decode,
    encode,
)


def sample_messages() -> list[Message]:
    """One fully populated instance of every message type (and some edge values)."""
    return [
        Hello(PROTOCOL_VERSION, "worker-0", "SmolLM2-135M-Instruct", 8192, 1024, 16, 64,
              "cuda:0", 4242),
        Ready(True),
        Ready(False, "protocol version 9 is not supported", 0.25),
        Submit("req-1", [1, 2, 3, 65535], {"max_tokens": 8, "temperature": 0.0,
                                           "stop_token_ids": [2], "seed": None}, 32),
        Submit("req-ü", [], {}, 1),
        Submit("req-1", [1], {}, 4, [5, 6], None, 3),
        Submit("req-1", [1], {}, 4, [], None, 1, -1),
        Submit("req-1", [1], {}, 4, [], None, 1, 2),
        Abort(["req-1", "req-2"]),
        Abort(["req-1", "req-2"], [2, 0]),
        Abort([]),
        Credit([["req-1", 4], ["req-2", 1]]),
        Credit([["req-1", 4, 2], ["req-2", 1]]),
        Tokens("worker-0", 7, [
            TokenOutput("req-1", [42, 43], None, 5, 2, 0),
            TokenOutput("req-2", [], "stop", 3, 9, 2),
            TokenOutput("req-3", [7], "length", 3, 1, 0, [[-0.5, [[7, -0.5], [8, -1.25]]]]),
            TokenOutput("req-4", [], "error", 3, 0, 0, None, "prompt is too long"),
            TokenOutput("req-5", [9], None, 3, 4, 0, attempt=2),
        ], seq=12),
        Tokens("worker-1", 0, []),
        Heartbeat("worker-0", WorkerState.DRAINING.value, 3, 2, 1, 100, 1024, 1234.5),
        Heartbeat("gateway"),
        Heartbeat("worker-1", "ready", 1, 0, 0, 10, 10, 1.5, "", 7, 0.25, ["req-1", "req-2"],
                  0.5),
        Heartbeat("gateway", "unknown", gateway_id="4f2a"),
        Heartbeat("worker-1", request_ids=["req-1"], request_attempts=[3], tokens_seq=40),
        Ready(True, "", 0.5, "4f2a"),
        Drain("worker-0", 12.5),
        Drain("worker-0", 0.0, False),
        Undrain("worker-0"),
        Error(None, "overloaded", "no KV blocks"),
        Error("req-9", "internal", "boom"),
        Error("req-9", "internal", "boom", 2),
        Shutdown("operator asked"),
        DebugRequest("a1b2", "stacks"),
        DebugRequest("a1b2", "profile", {"seconds": 2.5, "hz": 100, "limit": 40}),
        DebugReply("a1b2", True, {"threads": [{"name": "MainThread", "frames": []}]}),
        DebugReply("a1b2", False, {}, "a profile is already running", "busy"),
    ]


def test_every_message_type_is_covered():
    assert {type(m) for m in sample_messages()} == set(MESSAGE_CLASSES.values())
    assert set(MESSAGE_CLASSES) == set(MsgType)


@pytest.mark.parametrize("msg", sample_messages(), ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = encode(msg)
    assert len(frames) == 2 and frames[0] == bytes([msg.TYPE])
    assert decode(frames) == msg


def test_tokens_round_trip_gives_token_output_objects():
    msg = decode(encode(Tokens("w", 1, [TokenOutput("r", [1], None, 2, 1)])))
    assert isinstance(msg.outputs[0], TokenOutput)
    assert msg.outputs[0].new_token_ids == [1]


def test_trailing_default_fields_may_be_omitted():
    # A peer built before a defaulted field existed still decodes (forward compatibility).
    body = msgpack.packb([True])
    assert decode([bytes([MsgType.READY]), body]) == Ready(True, "", 1.0)


def _frames(msg_type: MsgType, body: object) -> list[bytes]:
    return [bytes([msg_type]), msgpack.packb(body, use_bin_type=True)]


BAD_FRAMES = {
    "no frames": [],
    "one frame": [bytes([MsgType.HEARTBEAT])],
    "three frames": encode(Heartbeat("w")) + [b"extra"],
    "empty type frame": [b"", msgpack.packb(["w"])],
    "two-byte type frame": [b"\x07\x00", msgpack.packb(["w"])],
    "unknown type": [bytes([200]), msgpack.packb([])],
    "type zero": [bytes([0]), msgpack.packb([])],
    "not msgpack": [bytes([MsgType.HEARTBEAT]), b"\xc1\xc1\xc1"],
    "truncated body": [bytes([MsgType.HELLO]), encode(Hello(1, "w", "m", 1, 1, 1, 1, "cpu", 1))[1][:-3]],
    "trailing garbage": [bytes([MsgType.SHUTDOWN]), msgpack.packb(["x"]) + b"\x00"],
    "body not an array": _frames(MsgType.HEARTBEAT, {"worker_id": "w"}),
    "body a scalar": _frames(MsgType.HEARTBEAT, 5),
    "too few fields": _frames(MsgType.HELLO, [1, "w"]),
    "too many fields": _frames(MsgType.ABORT, [["a"], "extra"]),
    "string for int": _frames(MsgType.HELLO, ["1", "w", "m", 1, 1, 1, 1, "cpu", 1]),
    "bool for int": _frames(MsgType.HELLO, [True, "w", "m", 1, 1, 1, 1, "cpu", 1]),
    "int for bool": _frames(MsgType.READY, [1]),
    "int for str": _frames(MsgType.DRAIN, [5, 1.0]),
    "bytes for str": _frames(MsgType.SHUTDOWN, [b"reason"]),
    "nil for required str": _frames(MsgType.ERROR, [None, None, "m"]),
    "map for list": _frames(MsgType.ABORT, [{"a": 1}]),
    "non-int prompt token": _frames(MsgType.SUBMIT, ["r", [1, "2"], {}, 4]),
    "float prompt token": _frames(MsgType.SUBMIT, ["r", [1, 2.0], {}, 4]),
    "zero credit": _frames(MsgType.SUBMIT, ["r", [1], {}, 0]),
    "non-str param key": _frames(MsgType.SUBMIT, ["r", [1], {1: 2}, 4]),
    "non-str abort id": _frames(MsgType.ABORT, [["a", 3]]),
    "credit grant too long": _frames(MsgType.CREDIT, [[["r", 1, 2, 3]]]),
    "credit grant attempt 0": _frames(MsgType.CREDIT, [[["r", 1, 0]]]),
    "submit attempt 0": _frames(MsgType.SUBMIT, ["r", [1], {}, 4, [], None, 0]),
    "abort attempts not one per id": _frames(MsgType.ABORT, [["a", "b"], [1]]),
    "abort attempt negative": _frames(MsgType.ABORT, [["a"], [-1]]),
    "heartbeat attempts not one per id": _frames(MsgType.HEARTBEAT, [
        "w", "ready", 0, 0, 0, 0, 0, 0.0, "", 0, 0.0, ["a"], 0.0, {}, [1, 2]]),
    "token output attempt negative": _frames(MsgType.TOKENS, ["w", 1, [
        ["r", [1], None, 1, 1, 0, None, None, None, None, -1]]]),
    "credit grant of zero": _frames(MsgType.CREDIT, [[["r", 0]]]),
    "credit grant negative": _frames(MsgType.CREDIT, [[["r", -3]]]),
    "credit grant bool": _frames(MsgType.CREDIT, [[["r", True]]]),
    "token output short": _frames(MsgType.TOKENS, ["w", 1, [["r", [1], None]]]),
    "token output not an array": _frames(MsgType.TOKENS, ["w", 1, ["r"]]),
    "token output bad reason": _frames(MsgType.TOKENS, ["w", 1, [["r", [1], "done", 1, 1, 0, None, None]]]),
    "token output list reason": _frames(MsgType.TOKENS, ["w", 1, [["r", [1], [], 1, 1, 0, None, None]]]),
    "token output str token": _frames(MsgType.TOKENS, ["w", 1, [["r", ["x"], None, 1, 1, 0, None, None]]]),
    "token output str count": _frames(MsgType.TOKENS, ["w", 1, [["r", [1], None, "1", 1, 0, None, None]]]),
    "token output negative count": _frames(MsgType.TOKENS, ["w", 1, [["r", [1], None, 1, -1, 0, None, None]]]),
    "token output int error": _frames(MsgType.TOKENS, ["w", 1, [["r", [1], "error", 1, 1, 0, None, 5]]]),
    "token output map logprobs": _frames(MsgType.TOKENS, ["w", 1, [["r", [1], None, 1, 1, 0, {}, None]]]),
    "tokens id not str": _frames(MsgType.TOKENS, [1, 1, []]),
    "msgpack ext type": [bytes([MsgType.SHUTDOWN]), msgpack.packb([msgpack.ExtType(5, b"x")])],
    # Hostile peers: every claim is range-checked.
    "hello negative context": _frames(MsgType.HELLO, [2, "w", "m", -5, 1, 16, 1, "cpu", 1]),
    "hello huge batch": _frames(MsgType.HELLO, [2, "w", "m", 10, 1, 16, 2**40, "cpu", 1]),
    "hello zero blocks": _frames(MsgType.HELLO, [2, "w", "m", 10, 0, 16, 1, "cpu", 1]),
    "hello empty id": _frames(MsgType.HELLO, [2, "", "m", 10, 1, 16, 1, "cpu", 1]),
    "hello long model name": _frames(MsgType.HELLO, [2, "w", "m" * 1000, 10, 1, 16, 1, "cpu", 1]),
    "prompt token past 32 bits": _frames(MsgType.SUBMIT, ["r", [2**40], {}, 4]),
    "credit grant past 32 bits": _frames(MsgType.CREDIT, [[["r", 2**40]]]),
    "heartbeat negative count": _frames(MsgType.HEARTBEAT, ["w", "ready", -1]),
    "heartbeat non-str request id": _frames(MsgType.HEARTBEAT,
                                            ["w", "ready", 0, 0, 0, 0, 0, 0.0, "", 0, 0.0, [1]]),
    "heartbeat infinite age": _frames(MsgType.HEARTBEAT,
                                      ["w", "ready", 0, 0, 0, 0, 0, 0.0, "", 0, float("inf")]),
    "debug request empty token": _frames(MsgType.DEBUG_REQUEST, ["", "stacks", {}]),
    "debug request long token": _frames(MsgType.DEBUG_REQUEST, ["t" * 65, "stacks", {}]),
    "debug request unknown kind": _frames(MsgType.DEBUG_REQUEST, ["t", "exec", {}]),
    "debug request nested arg": _frames(MsgType.DEBUG_REQUEST, ["t", "profile", {"a": [1]}]),
    "debug request too many args": _frames(MsgType.DEBUG_REQUEST, [
        "t", "profile", {f"a{i}": 1 for i in range(17)}]),
    "debug request long arg": _frames(MsgType.DEBUG_REQUEST, ["t", "memory", {"a": "x" * 5000}]),
    "debug request args not a map": _frames(MsgType.DEBUG_REQUEST, ["t", "stacks", []]),
    "debug reply failed without a known code": _frames(MsgType.DEBUG_REPLY,
                                                       ["t", False, {}, "no", "why"]),
    "debug reply result not a map": _frames(MsgType.DEBUG_REPLY, ["t", True, "text"]),
    "debug reply long error": _frames(MsgType.DEBUG_REPLY, ["t", False, {}, "e" * 5000, "failed"]),
    "tokens with too many outputs": _frames(
        MsgType.TOKENS, ["w", 1, [["r", [], None, 0, 0, 0, None, None]] * 70_000]),
}


@pytest.mark.parametrize("frames", BAD_FRAMES.values(), ids=list(BAD_FRAMES))
def test_bad_frames_raise_protocol_error(frames):
    with pytest.raises(ProtocolError):
        decode(frames)


def test_oversized_body_is_refused_before_unpacking():
    body = b"\x00" * (MAX_FRAME_BYTES + 1)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode([bytes([MsgType.SUBMIT]), body])


def test_protocol_error_is_a_value_error():
    # Receive loops may catch ValueError broadly; ProtocolError must be caught by it too.
    assert issubclass(ProtocolError, ValueError)


def _mutations(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    type_frame, body = frames
    choice = rng.randrange(5)
    if choice == 0:  # pure noise
        return [bytes([rng.randrange(256)]), rng.randbytes(rng.randrange(64))]
    if choice == 1:  # flip bytes of a valid body
        data = bytearray(body)
        for _ in range(rng.randrange(1, 4)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        return [type_frame, bytes(data)]
    if choice == 2:  # truncate
        return [type_frame, body[: rng.randrange(len(body) + 1)]]
    if choice == 3:  # a valid body under another message type
        return [bytes([rng.choice(list(MsgType))]), body]
    # random frame count
    return [rng.randbytes(rng.randrange(3)) for _ in range(rng.randrange(5))]


def test_fuzz_never_raises_anything_but_protocol_error():
    rng = random.Random(1234)
    valid = [encode(m) for m in sample_messages()]
    num_decoded = 0
    for _ in range(5000):
        frames = _mutations(rng, rng.choice(valid))
        try:
            msg = decode(frames)
        except ProtocolError:
            continue
        # Whatever decodes must be a well-formed message that encodes again.
        num_decoded += 1
        assert isinstance(msg, Message)
        for f in fields(msg):
            accepted = msg.SCHEMA[f.name]
            value = getattr(msg, f.name)
            if isinstance(msg, Tokens) and f.name == "outputs":
                assert all(isinstance(o, TokenOutput) for o in value)
            else:
                assert isinstance(value, accepted)
        encode(msg)
    # The mutations must not be so destructive that nothing ever decodes.
    assert num_decoded > 0


def test_fields_travel_in_declaration_order():
    # The docs promise positional arrays; a reordering of fields would break old peers.
    hb = Heartbeat("w", "ready", 1, 2, 3, 4, 5, 6.0)
    assert msgpack.unpackb(encode(hb)[1]) == list(astuple(hb))
    assert [f.name for f in fields(Heartbeat)] == [
        "worker_id", "state", "num_running", "num_waiting", "num_paused",
        "num_free_blocks", "num_total_blocks", "time", "gateway_id", "num_steps",
        "progress_age_s", "request_ids", "request_ids_age_s", "counters",
        "request_attempts", "tokens_seq",
    ]


def test_submit_travels_in_declaration_order_with_trailing_defaults_off():
    """Submit.to_wire is written out by hand: it must stay every field in declaration order
    (a new field must be added to it), with priority and flow off the wire at 0."""
    for priority, flow in ((0, 0), (2, 0), (0, 7), (-1, 9)):
        msg = Submit("r", [1, 2], {"max_tokens": 3}, 4, [5], ["regex", "a+"], 2, priority, flow)
        body = [getattr(msg, f.name) for f in fields(Submit)]
        num_off = 0 if flow else 1 if priority else 2
        assert msgpack.unpackb(encode(msg)[1]) == body[:len(body) - num_off]
        assert decode(encode(msg)) == msg


def test_every_output_names_its_attempt_and_tokens_their_seq():
    """Attempts travel in the TokenOutput's last place; an output without one (a 10-item
    row) decodes as attempt 0, which no stream's current attempt ever is."""
    row = TokenOutput.wire_row("r", [5], None, 3, 2, 0, None, None, None, None, 4)
    msg = decode(encode(Tokens("w", 9, [row], seq=31)))
    assert msg.seq == 31 and msg.outputs[0].attempt == 4
    old = decode([bytes([MsgType.TOKENS]), msgpack.packb(["w", 9, [row[:10]]])])
    assert old.seq == 0 and old.outputs[0].attempt == 0
    assert decode(encode(Submit("r", [1], {}, 4))).attempt == 1


def test_heartbeat_counters_and_output_timings_are_checked():
    hb = Heartbeat("w", counters={"prefix_cache_hits": 5})
    assert decode(encode(hb)).counters == {"prefix_cache_hits": 5}
    for bad in ({"x": -1}, {"x": 1.5}, {"x": True}, {f"k{i}": 1 for i in range(33)}):
        with pytest.raises(ProtocolError):
            decode(encode(Heartbeat("w", counters=bad)))
    out = TokenOutput("r", [1], None, 3, 1, 0, None, None, [0.5, 0.25])
    got = decode(encode(Tokens("w", 1, [out]))).outputs[0]
    assert got.timings == [0.5, 0.25]
    # An 8-item output (no timings) from an older worker still decodes.
    body = msgpack.packb(["w", 1, [out.to_wire()[:8]]])
    assert decode([bytes([MsgType.TOKENS]), body]).outputs[0].timings is None
    for bad in ([1.0], [-1.0, 0.0], [float("nan"), 0.0], "x"):
        out.timings = bad
        with pytest.raises(ProtocolError):
            decode(encode(Tokens("w", 1, [out])))


def test_submit_flow_travels_only_when_set_and_is_range_checked():
    """Protocol 5: SUBMIT.flow (the client, hashed) after priority; 0 stays off the wire,
    and a set flow carries a 0 priority before it."""
    assert PROTOCOL_VERSION == 5
    assert len(msgpack.unpackb(encode(Submit("r", [1], {}, 4, priority=1))[1])) == \
        len(fields(Submit)) - 1
    both = decode(encode(Submit("r", [1], {}, 4, flow=MAX_FLOW)))
    assert (both.priority, both.flow) == (0, MAX_FLOW)
    assert decode(encode(Submit("r", [1], {}, 4, priority=-1, flow=7))).flow == 7
    for bad in (-1, MAX_FLOW + 1):
        with pytest.raises(ProtocolError, match="flow"):
            decode(_frames(MsgType.SUBMIT, ["r", [1], {}, 4, [], None, 1, 0, bad]))


def test_submit_priority_travels_only_when_set_and_is_range_checked():
    """Priority 0 (the default class) is left off the wire (and read back as 0); a set one
    travels last and is range-checked."""
    plain = Submit("r", [1], {}, 4)
    assert len(msgpack.unpackb(encode(plain)[1])) == len(fields(Submit)) - 2
    assert decode(encode(plain)).priority == 0
    assert decode(encode(Submit("r", [1], {}, 4, priority=-1))).priority == -1
    for bad in (MAX_PRIORITY + 1, -MAX_PRIORITY - 1, 2 ** 40):
        with pytest.raises(ProtocolError, match="priority"):
            decode(_frames(MsgType.SUBMIT, ["r", [1], {}, 4, [], None, 1, bad]))
    with pytest.raises(ProtocolError):
        decode(_frames(MsgType.SUBMIT, ["r", [1], {}, 4, [], None, 1, "critical"]))


def test_hello_names_its_kv_tier_and_an_older_hello_has_none():
    """HELLO.kv_tier and kv_tier_num_blocks (the box's KV tier, for routing): they round-trip,
    are range-checked, and a HELLO without them (a worker before them) reads as no tier."""
    hello = Hello(PROTOCOL_VERSION, "w", "m", 1, 1, 1, 1, "cpu", 1, {}, "", "", "a1b2", 4096)
    assert decode(encode(hello)) == hello
    older = _frames(MsgType.HELLO, [PROTOCOL_VERSION, "w", "m", 1, 1, 1, 1, "cpu", 1, {}, "", ""])
    assert (decode(older).kv_tier, decode(older).kv_tier_num_blocks) == ("", 0)
    for bad in (-1, 2**41):
        with pytest.raises(ProtocolError, match="kv_tier_num_blocks"):
            decode(encode(Hello(1, "w", "m", 1, 1, 1, 1, "cpu", 1, {}, "", "", "t", bad)))
    with pytest.raises(ProtocolError, match="kv_tier"):
        decode(encode(Hello(1, "w", "m", 1, 1, 1, 1, "cpu", 1, {}, "", "", "t" * 300, 1)))
