"""Requests waiting for their grammar: compilation runs off the engine thread.

Compiling a grammar (a JSON schema into llguidance's lexer and parser) takes milliseconds to
seconds. On the engine thread it would stall every stream of the worker for that long, once
per distinct schema. So a request whose grammar is not in the compiler's cache waits here,
not in the scheduler: it holds no KV block and no batch slot, and is not scheduled, while a
thread of its own compiles the grammar. The engine takes the ready ones at its next step
(`take_ready`): each gets a copy of the compiled matcher and joins the scheduler, or fails
with the grammar's error. Requests that ask for one grammar at once (the n choices of one
request) share its compilation.

A request paused while its grammar compiles (a stream moved here with its credit used up)
stays paused when it joins the scheduler (`take_ready` says so), until it is resumed.

A request aborted while its grammar compiles is forgotten at once (`abort`); the compilation
goes on and its result stays in the compiler's bounded cache for the next request with that
grammar. `wake` is called (on the compiling thread) whenever a compilation ends, so an idle
engine loop need not poll.

llguidance releases the GIL for most of a compilation: a 0.22 s JSON-schema compilation on
this thread held a 1 ms Python loop back by 20 ms at most (on the engine thread: 0.22 s).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from zeroserve.worker.grammar import GrammarCompiler, GrammarSpec, GrammarState
from zeroserve.worker.sequence import Sequence


class PendingGrammars:
    def __init__(self, compiler: GrammarCompiler, wake: Callable[[], None]):
        self._compiler = compiler
        self._wake = wake
        self._waiting: dict[str, tuple[Sequence, GrammarSpec, Future]] = {}  # by request id
        self._compiling: dict[GrammarSpec, Future] = {}  # shared by requests of one grammar
        self._paused: set[str] = set()  # waiting requests paused meanwhile (out of credit)
        self._jobs: queue.SimpleQueue[tuple[GrammarSpec, Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def get(self, request_id: str) -> Sequence | None:
        entry = self._waiting.get(request_id)
        return None if entry is None else entry[0]

    def add(self, seq: Sequence, spec: GrammarSpec) -> None:
        """Hold `seq` until `spec` is compiled."""
        future = self._compiling.get(spec)
        if future is None:
            future = self._compiling[spec] = Future()
            future.add_done_callback(lambda _: self._wake())
            self._jobs.put((spec, future))
            if self._thread is None:  # a daemon: a compilation never holds up an exit
                self._thread = threading.Thread(target=self._run, name="grammar-compile",
                                                daemon=True)
                self._thread.start()
        self._waiting[seq.request_id] = (seq, spec, future)

    def pause(self, request_id: str) -> bool:
        """Keep a waiting request paused once its grammar is ready; False if not waiting."""
        if request_id not in self._waiting:
            return False
        self._paused.add(request_id)
        return True

    def resume(self, request_id: str) -> bool:
        if request_id not in self._waiting:
            return False
        self._paused.discard(request_id)
        return True

    def has_ready(self) -> bool:
        return any(future.done() for _, _, future in self._waiting.values())

    def take_ready(self) -> list[tuple[Sequence, GrammarState | None, Exception | None, bool]]:
        """The requests whose grammar is compiled, each with a fresh state for it, or with
        the exception that compiling it raised, and whether it is paused; they leave this
        table."""
        ready = []
        for request_id, (seq, spec, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[request_id]
            error = future.exception()
            state = None if error is not None else GrammarState(spec, future.result().deep_copy())
            is_paused = request_id in self._paused
            self._paused.discard(request_id)
            ready.append((seq, state, error, is_paused))
        for spec, future in list(self._compiling.items()):
            if future.done():  # cached by the compiler from now on (or refused)
                del self._compiling[spec]
        return ready

    def abort(self, request_id: str) -> Sequence | None:
        """Forget a waiting request; None if it is not waiting here."""
        entry = self._waiting.pop(request_id, None)
        self._paused.discard(request_id)
        return None if entry is None else entry[0]

    def _run(self) -> None:
        while True:
            spec, future = self._jobs.get()
            try:
                result: Any = self._compiler.compile(spec)
            except Exception as e:  # GrammarError, or a bug: either fails its requests
                future.set_exception(e)
            else:
                future.set_result(result)
