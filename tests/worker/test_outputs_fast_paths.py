"""The per-stream, per-step output paths take short ways for the common case (a stream's next
token, nothing else): Engine._outputs builds most outputs without _output, and
WorkerLoop._emit writes most wire rows without to_wire. What reaches the gateway must be
exactly what the general ways give, for every kind of output."""

from __future__ import annotations

import types

from tests.worker.factories import make_engine, make_params
from zeroserve.common.protocol import Tokens, decode, encode
from zeroserve.worker.config import WorkerConfig
from zeroserve.worker.engine import _REPORTED_AT_ONCE
from zeroserve.worker.output_rows import to_wire
from zeroserve.worker.outputs import RequestOutput
from zeroserve.worker.process import WorkerLoop, _Stream
from zeroserve.worker.sequence import FinishReason


def _general_outputs(engine):
    """Engine._outputs as it was: _output for every sequence."""

    def outputs(changed, sampled):
        by_id = {s.request_id: s for s in sampled}
        return [engine._output(seq, by_id.get(seq.request_id)
                               if seq.params.logprobs is not None else None)
                for seq in changed if seq.finish_reason not in _REPORTED_AT_ONCE]

    return outputs


def _comparable(outputs):
    # The first token's timings are clock readings: only whether they are there.
    return [out._replace(timings=out.timings is not None) for out in outputs]


def test_engine_outputs_are_the_general_ways():
    """Streams with logprobs, prompt logprobs, stop ids, EOS and length finishes, aborts and
    pauses, joining at different steps: every step's outputs equal _output's."""
    fast = make_engine({"eos_after": 5}, max_num_seqs=16, num_kv_blocks=200)
    general = make_engine({"eos_after": 5}, max_num_seqs=16, num_kv_blocks=200)
    general._outputs = _general_outputs(general)
    kinds = [make_params(max_tokens=9), make_params(max_tokens=3),
             make_params(max_tokens=9, logprobs=2), make_params(max_tokens=9, prompt_logprobs=1),
             make_params(max_tokens=9, ignore_eos=True), make_params(max_tokens=9, min_tokens=7,
                                                                     ignore_eos=True)]
    seen = set()
    for step in range(14):
        for engine in (fast, general):
            if step < 6:
                for k, params in enumerate(kinds):
                    engine.add_request(f"s{step}-{k}", [3 + step, 4 + k, 5, 6, 7], params)
                # What a model runner computes for prompt_logprobs (the fake computes none).
                engine.scheduler.get(f"s{step}-3").prompt_logprobs = [(-1.0, [(5, -1.0)])] * 4
            if step == 4:
                engine.abort("s1-0")
                engine.pause("s2-4")
            if step == 7:
                engine.resume("s2-4")
        outs = fast.step(), general.step()
        assert _comparable(outs[0]) == _comparable(outs[1]), f"step {step}"
        seen.update((out.finish_reason, out.logprobs is not None,
                     out.prompt_logprobs is not None, out.timings is not None) for out in outs[0])
    # Every kind of output went through both ways.
    assert {reason for reason, *_ in seen} >= {None, FinishReason.STOP, FinishReason.LENGTH,
                                               FinishReason.ABORT}
    assert any(lp for _, lp, _, _ in seen) and any(plp for _, _, plp, _ in seen)
    assert any(t for *_, t in seen) and any(not t for *_, t in seen)


def _loop_emitting(outputs, attempt=3):
    loop = WorkerLoop(WorkerConfig("w", "ipc:///nonexistent/r", "ipc:///nonexistent/t",
                                   backend="fake"), types.SimpleNamespace(wake=None,
                                                                          pause=lambda rid: True))
    sent = []
    loop.gateways = {0: types.SimpleNamespace(send_tokens=sent.append, tokens_seq=0)}
    for out in outputs:
        loop.streams[out.request_id] = _Stream(credit_limit=100, attempt=attempt)
    loop._emit(outputs)
    (msg,) = sent
    return msg


def test_emitted_rows_are_to_wire_rows_and_decode_the_same():
    lp = [(-0.5, [(7, -0.5), (8, -1.5)])]
    outputs = [
        RequestOutput("plain", [5], None, 4, 2),
        RequestOutput("cached", [5, 6], None, 40, 9, 32),
        RequestOutput("stop", [2], FinishReason.STOP, 4, 3),
        RequestOutput("length", [9], FinishReason.LENGTH, 4, 16, 16),
        RequestOutput("aborted", [], FinishReason.ABORT, 4, 1),
        RequestOutput("error", [], FinishReason.ERROR, 4, 0, error="boom"),
        RequestOutput("poison", [], FinishReason.ERROR, 4, 0, error="bad", error_code="poison"),
        RequestOutput("first", [5], None, 4, 1, timings=(0.25, 0.5)),
        RequestOutput("logprobs", [7], None, 4, 1, logprobs=lp),
        RequestOutput("prompt", [7], None, 3, 1, prompt_logprobs=lp + [(-1.0, [])]),
    ]
    msg = _loop_emitting(outputs)
    assert msg.outputs == [to_wire(out, 3) for out in outputs]
    received = decode(encode(msg))
    assert isinstance(received, Tokens)
    for out, got in zip(outputs, received.outputs, strict=True):
        assert (got.request_id, got.new_token_ids, got.num_prompt_tokens,
                got.num_output_tokens, got.num_cached_tokens, got.error, got.attempt) == (
            out.request_id, out.new_token_ids, out.num_prompt_tokens, out.num_output_tokens,
            out.num_cached_tokens, out.error, 3)
        assert got.finish_reason == (None if out.finish_reason is None
                                     else out.finish_reason.value)
        assert (got.timings is None) == (out.timings is None)
        assert (got.logprobs is None) == (out.logprobs is None)
        assert (got.prompt_logprobs is None) == (out.prompt_logprobs is None)
