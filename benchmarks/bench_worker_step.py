"""The worker's per-step cost at N decoding sequences, in-process and with no forward.

The relay benchmark's worker (`zeroserve worker --backend fake --fake-forward-ms 20`) takes
20 ms of device time plus whatever serial work the engine loop adds to it at every step;
that cost comes straight off the tokens/s the gateway can deliver. This measures it without
sockets or sleeps: N requests decoding in an Engine over a FakeRunner (no plan checks, as
the worker process runs it), stepped by `Engine.step_overlapped` with the worker loop's emit
(worker/process.py's `WorkerLoop._emit`: per-stream credit bookkeeping, the TOKENS message's
wire rows, common/protocol.py's encode; the socket send is left out; in the worker process
the encode runs on the gateway's sender thread). Two figures per step:

- serial: the engine thread's work outside the emit and the launch (scheduling, the state
  update, pauses and resumes): each step takes the forward's time plus this, unless the
  runner follows (worker/scheduler_follow.py: the next step is launched before this work,
  which then runs during the device time too);
- emit: the outputs and the emit, which run during the next step's device time;
- period (with --forward-ms): the wall time from one step's end to the next's.

The garbage collector is tuned as the worker process tunes it. Times are CPU time of this
process (time.process_time: steadier than wall time on a shared machine), medians over the
steps of each repeat.

`--pause-percent P` adds what a gateway that falls behind causes: before each step, P% of
the streams (chosen at random, seeded) leave the batch (engine.pause(), as a stream out of
credit does) and the previous step's paused ones come back (engine.resume()); that time is
counted as serial.

    python benchmarks/bench_worker_step.py --seqs 1000 --steps 60 --repeats 5
    python benchmarks/bench_worker_step.py --seqs 1000 --steps 60 --repeats 5 --pause-percent 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run_once(num_seqs: int, num_steps: int, num_prompt_tokens: int,
             pause_percent: float = 0.0, forward_ms: float = 0.0
             ) -> tuple[float, float, float, float]:
    """Median CPU seconds per step of (the engine's serial work, the emit during the device
    time, the fake runner's launch) over num_steps decode steps of engine.step_overlapped,
    as the worker loop runs it, and the median wall seconds from one step's end to the
    next's (the step period)."""
    from zeroserve.common.gc_tuning import tune_for_serving
    from zeroserve.common.protocol import encode
    from zeroserve.worker.config import EngineConfig, WorkerConfig
    from zeroserve.worker.engine import Engine
    from zeroserve.worker.fake_runner import FakeRunner
    from zeroserve.worker.process import WorkerLoop, _Stream
    from zeroserve.worker.sequence import SamplingParams
    from zeroserve.worker.speculative import SpeculativeConfig

    # As `zeroserve worker` runs it: the default speculative config (it does not speculate
    # at this many sequences, but the scheduler still asks it every step).
    config = EngineConfig(model="fake", max_num_seqs=num_seqs,
                          max_num_batched_tokens=max(num_seqs * num_prompt_tokens, 512),
                          num_kv_blocks=num_seqs * ((num_prompt_tokens + num_steps) // 16 + 3),
                          speculative_config=SpeculativeConfig())
    engine = Engine(config, runner=FakeRunner(config, check_plans=False,
                                               forward_time_s=forward_ms / 1000))
    loop = WorkerLoop(WorkerConfig("w", "ipc:///nonexistent/r", "ipc:///nonexistent/t",
                                   engine=config, backend="fake"), engine)
    # One stand-in gateway: everything up to the socket (the process's sender thread encodes
    # off the engine thread; counted here all the same), and the heartbeats' load the loop
    # publishes after every emit.
    loop.gateways = {0: types.SimpleNamespace(send_tokens=encode, tokens_seq=0, index=0,
                                              link=types.SimpleNamespace(load=None))}
    emit = loop._emit_and_publish
    params = SamplingParams(max_tokens=num_steps + 10, ignore_eos=True)
    for i in range(num_seqs):
        request_id = f"req-{i:032x}"
        engine.add_request(request_id, [1000 + i] * num_prompt_tokens, params)
        loop.streams[request_id] = _Stream(credit_limit=num_steps + 10)
    engine.step_overlapped(emit)  # the prefill step
    tune_for_serving()
    rng = random.Random(0)
    request_ids = list(loop.streams)
    num_paused = round(num_seqs * pause_percent / 100)
    paused: list[str] = []
    runner = engine.runner
    # CPU seconds of this step: the fake's launch (its sampling is device time), and the
    # last step's outputs and their emit (during the device time: before or after the
    # launch of a step behind the one computing, worker/scheduler_follow.py).
    inside = [0.0, 0.0]

    def timed(fn, k):
        def call(*args):
            t = time.process_time()
            result = fn(*args)
            inside[k] += time.process_time() - t
            return result
        return call

    runner.launch = timed(runner.launch, 0)
    engine.take_outputs = timed(engine.take_outputs, 1)
    emit = timed(emit, 1)
    serial_s, emit_s, launch_s, period_s = [], [], [], []
    last_end = time.perf_counter()
    for _ in range(num_steps):
        inside[:] = [0.0, 0.0]
        t0 = time.process_time()
        for request_id in paused:
            engine.resume(request_id)
        paused = rng.sample(request_ids, num_paused)
        for request_id in paused:
            engine.pause(request_id)
        engine.step_overlapped(emit)
        t1 = time.process_time()
        end = time.perf_counter()
        period_s.append(end - last_end)
        last_end = end
        # The engine thread's work outside the device time.
        serial_s.append(t1 - t0 - inside[0] - inside[1])
        emit_s.append(inside[1])
        launch_s.append(inside[0])
    return (statistics.median(serial_s), statistics.median(emit_s), statistics.median(launch_s),
            statistics.median(period_s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompt-tokens", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=1, help="fresh engines, one after another")
    ap.add_argument("--pause-percent", type=float, default=0.0,
                    help="streams paused and resumed around each step, in percent")
    ap.add_argument("--forward-ms", type=float, default=0.0,
                    help="the fake forward's device time (slept out, as --fake-forward-ms): "
                         "with it, every step starts with the CPU caches as a real worker's "
                         "do after a forward (colder: more CPU per step)")
    args = ap.parse_args()

    runs = [run_once(args.seqs, args.steps, args.prompt_tokens, args.pause_percent,
                     args.forward_ms) for _ in range(args.repeats)]
    totals = sorted(step + emit for step, emit, _, _ in runs)
    result = {
        "seqs": args.seqs, "steps": args.steps, "repeats": args.repeats,
        "pause_percent": args.pause_percent, "forward_ms": args.forward_ms,
        # Serial: schedule + update (+ pauses): what a step adds to the device time.
        "serial_ms": [round(1000 * step, 3) for step, _, _, _ in runs],
        # During the next step's device time: the outputs, the emit and its encode.
        "emit_ms": [round(1000 * emit, 3) for _, emit, _, _ in runs],
        # The fake's launch: its sampling, within its modeled device time (not in total).
        "launch_ms": [round(1000 * launch, 3) for _, _, launch, _ in runs],
        # Wall time from one step's end to the next's: the forward plus what the engine
        # thread adds to it (with a runner that follows, the forward alone while the
        # thread's CPU per step stays under it). Wall time: noisy on a loaded machine.
        "period_ms": [round(1000 * period, 3) for _, _, _, period in runs],
        "total_ms_median": round(1000 * statistics.median(totals), 3),
        "total_ms_min_max": [round(1000 * totals[0], 3), round(1000 * totals[-1], 3)],
        "serial_us_per_seq": round(
            1e6 * statistics.median(s for s, _, _, _ in runs) / args.seqs, 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
