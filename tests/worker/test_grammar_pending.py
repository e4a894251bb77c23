"""Grammar compilation off the engine thread (worker/grammar_pending.py): while one request's
grammar compiles, the worker's other streams keep producing tokens; the request waits
unscheduled, fails with the grammar's error if it does not compile, and leaves nothing
behind when it is aborted meanwhile. Compilation is made slow (and fake) here: the fake
backend applies no masks, so only its timing matters."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from tests.worker.factories import make_engine, run_to_completion
from tests.worker.test_process import FakeGateway, RunningWorker
from zeroserve.common.protocol import Abort, Hello, Ready, Shutdown, Submit
from zeroserve.worker.grammar import GrammarCompiler, GrammarError, GrammarSpec
from zeroserve.worker.process import WorkerConfig
from zeroserve.worker.sequence import SamplingParams

SCHEMA = ["json_schema", '{"type": "object"}']
COMPILE_S = 1.5


class _Matcher:
    def deep_copy(self) -> _Matcher:
        return _Matcher()


@pytest.fixture
def slow_compiler(monkeypatch):
    """Every compilation takes COMPILE_S; `fail` makes the next ones raise GrammarError;
    `release` ends a compilation early."""
    state = {"fail": False, "num_compiled": 0, "release": threading.Event()}

    def compile(self, spec):
        state["release"].wait(COMPILE_S)
        state["num_compiled"] += 1
        if state["fail"]:
            raise GrammarError("invalid grammar: made to fail")
        return _Matcher()

    monkeypatch.setattr(GrammarCompiler, "compile", compile)
    monkeypatch.setattr(GrammarCompiler, "check_vocabulary", lambda self: None)
    monkeypatch.setattr(GrammarCompiler, "cached", lambda self, spec: None)
    return state


@contextlib.contextmanager
def serving(tmp_path, engine) -> Iterator[FakeGateway]:
    """A worker process loop around `engine`, linked and ready to a fake gateway; shut down
    (and the gateway closed) on leaving, whatever the test did."""
    gateway = FakeGateway(tmp_path, "worker-test")
    config = WorkerConfig("worker-test", gateway.router_address, gateway.tokens_address,
                          backend="fake", heartbeat_interval_s=0.05)
    worker = RunningWorker(config, engine)
    try:
        gateway.recv(Hello)
        gateway.send(Ready(True))
        yield gateway
    finally:
        gateway.send(Shutdown("test over"))
        worker.wait()
        gateway.close()


def test_other_streams_keep_producing_tokens_while_a_grammar_compiles(tmp_path,
                                                                     slow_compiler):
    engine = make_engine({"forward_time_s": 0.01}, max_num_seqs=8, max_model_len=256)
    with serving(tmp_path, engine) as gateway:
        gateway.send(Submit("plain", [5, 6], {"max_tokens": 150, "ignore_eos": True}, 200))
        gateway.collect_n("plain", 3)
        gateway.send(Submit("json", [5, 6], {"max_tokens": 5, "ignore_eos": True}, 200,
                            grammar=SCHEMA))
        arrivals, json_first_at = [], None
        started = time.monotonic()
        while json_first_at is None and time.monotonic() - started < 10:
            msg = gateway.tokens(timeout_s=5)
            for out in msg.outputs if msg is not None else []:
                if out.request_id == "plain" and out.new_token_ids:
                    arrivals.append(time.monotonic())
                if out.request_id == "json" and out.new_token_ids:
                    json_first_at = time.monotonic()
        # The constrained request waited for its grammar, then ran.
        assert json_first_at is not None and json_first_at - started >= COMPILE_S * 0.8
        # Meanwhile the plain stream went on step after step: no stall of the compile's length.
        during = [t for t in arrivals if t < json_first_at]
        gaps = [b - a for a, b in zip([started, *during], during, strict=False)]
        assert len(during) > 20 and max(gaps) < 0.5, max(gaps)
        gateway.send(Abort(["plain", "json"]))


def test_a_grammar_that_does_not_compile_fails_its_request_with_the_error(slow_compiler):
    slow_compiler["fail"] = True
    slow_compiler["release"].set()
    engine = make_engine()
    engine.add_request("r", [1, 2], SamplingParams(max_tokens=4),
                       grammar=GrammarSpec(*SCHEMA))
    outputs = []
    deadline = time.monotonic() + 5
    while not outputs and time.monotonic() < deadline:
        outputs = engine.step() if engine.has_unfinished() else []
        time.sleep(0.01)
    assert [(o.request_id, o.finish_reason.value, o.new_token_ids) for o in outputs] == [
        ("r", "error", [])]
    assert "made to fail" in outputs[0].error
    assert not engine.has_unfinished() and engine.stats().num_waiting == 0


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(slow_compiler):
    engine = make_engine()
    num_free = engine.stats().num_free_blocks
    woken = threading.Event()
    engine.wake = woken.set
    engine.add_request("r", [1, 2], SamplingParams(max_tokens=4),
                       grammar=GrammarSpec(*SCHEMA))
    assert engine.stats().num_waiting == 1  # it waits, counted, not scheduled
    assert not engine.has_unfinished()  # nothing to step until the grammar is ready
    assert engine.abort("r")
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason.value) for o in outputs] == [("r", "abort")]
    slow_compiler["release"].set()
    assert woken.wait(5)  # the compilation ended: the loop is woken, finds nothing
    assert engine.step() == [] and not engine.has_unfinished()
    stats = engine.stats()
    assert stats.num_waiting == 0 and stats.num_running == 0
    assert stats.num_free_blocks == num_free
    # The id is free again: a new request of it runs.
    engine.add_request("r", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(run_to_completion(engine)["tokens"]["r"]) == 2


def _wait_compiled(engine, woken: threading.Event) -> None:
    assert woken.wait(10)  # the compilation ended
    deadline = time.monotonic() + 10
    while not engine._grammars.has_ready() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_request_paused_while_its_grammar_compiles_joins_paused(slow_compiler):
    # A stream moved here with its window used up is paused at once, before its grammar
    # compiled: it must not run (a token past its credit) until it is resumed.
    engine = make_engine()
    woken = threading.Event()
    engine.wake = woken.set
    engine.add_request("r", [1, 2], SamplingParams(max_tokens=6, ignore_eos=True),
                       output_token_ids=[7, 8], grammar=GrammarSpec(*SCHEMA))
    assert engine.pause("r")
    slow_compiler["release"].set()
    _wait_compiled(engine, woken)
    assert [o for o in engine.step() if o.new_token_ids] == []
    stats = engine.stats()
    assert stats.num_paused == 1 and stats.num_running == 0 and stats.num_waiting == 0
    assert engine.resume("r")
    outputs = run_to_completion(engine)
    assert len(outputs["tokens"]["r"]) == 4  # the rest of its max_tokens, after the 2 it had


def test_a_request_resumed_before_its_grammar_compiles_runs_when_ready(slow_compiler):
    engine = make_engine()
    woken = threading.Event()
    engine.wake = woken.set
    engine.add_request("r", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True),
                       grammar=GrammarSpec(*SCHEMA))
    assert engine.pause("r") and engine.resume("r")
    slow_compiler["release"].set()
    _wait_compiled(engine, woken)
    assert len(run_to_completion(engine)["tokens"]["r"]) == 3


def test_a_failover_with_a_grammar_and_no_credit_sends_nothing_until_credit(tmp_path,
                                                                            slow_compiler):
    from zeroserve.common.protocol import Credit, Heartbeat

    with serving(tmp_path, make_engine({"forward_time_s": 0.001})) as gateway:
        # Moved from a lost worker with 2 tokens sent, and a credit of 2: its window is used.
        gateway.send(Submit("json", [5, 6], {"max_tokens": 6, "ignore_eos": True}, 2,
                            [7, 8], grammar=SCHEMA))
        slow_compiler["release"].set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the compiled request sits paused
            hb = gateway.recv(Heartbeat)
            if hb.num_paused == 1 and hb.num_waiting == 0:
                break
        assert hb.num_paused == 1 and hb.num_waiting == 0
        early = gateway.tokens(timeout_s=0.3)
        assert early is None or not any(o.new_token_ids for o in early.outputs), early
        gateway.send(Credit([["json", 6]]))
        outs = gateway.collect({"json"}, timeout_s=30)["json"]
        assert outs[0].num_output_tokens == 3  # its first new token follows the two it had
        assert sum(len(o.new_token_ids) for o in outs) == 4
