"""Gateway relay benchmark: how many tokens/s the gateway delivers to many concurrent SSE
streams, and how much latency it adds per token, with a fake engine behind it.

It starts `zeroserve gateway` and one worker, opens N concurrent streaming completions
(default 1,000) with a lean raw-socket HTTP/1.1 client, and reports:

- delivered tokens/s (server-reported usage.completion_tokens over the wall time, and
  chunks/s seen by the clients), and `steady_tokens_per_s`: the token arrivals per second
  while all N streams are open (from the last stream's first token to the first stream's
  last one), the ramp up and the tail left out;
- `ramp_last_tenth_s` (the C client): for the tenth of the streams whose first token came
  last, when the client had their connection established, their request written, and their
  response's first byte and first token read (p50 and max, seconds from the burst's start);
  the whole run is bounded by that last first token + tokens x the worker's step period;
- the CPU the gateway(s), the worker and the client used (`cpu_s`; `gateway_system` is the
  gateways' kernel part of theirs: socket writes and reads), per token for the gateway and
  per chunk for the client (`client_cpu_us_per_chunk`);
- with `--worker stamped` (default): the added latency per token = client receive time -
  the time the worker put that token on the wire (both CLOCK_MONOTONIC, same machine), as
  p50/p90/p99. The stamped worker is the gateway tests' fake worker in its own process; it
  emits one whole-word token per step per stream, so the i-th SSE chunk of a stream is its
  i-th token.
- with `--worker fake`: the real `zeroserve worker --backend fake` (FakeRunner behind the
  real engine loop); latency is reported as the inter-chunk gap (ITL), which includes the
  fake forward time, and as the added latency from the moment the fake made each token
  (its `--fake-stamps` record) to the client's receipt: the worker's emit, ZeroMQ, the
  gateway and the client's socket.
- with `--worker serve`: `zeroserve serve --backend fake --max-num-seqs STREAMS` exactly as a
  user starts it (every other flag at its default but --credit-window), its gateway(s) and
  worker found among its children; latency as with `--worker fake`.
- `--gateways N` (with `--worker fake` or `serve`): N gateway processes share
  the port, as `zeroserve serve --gateways N` runs them, and the worker serves all N; the
  gateway CPU is the sum over the N processes.
- `--tree PATH` (with `--worker fake` or `serve`): the gateway(s) and the worker are another
  checkout's (a `git worktree` of an older commit, as benchmarks/bench_commits.py makes them),
  run by that checkout's own launcher; the client and the measurement stay this one's. So
  two commits' relays are measured by the same code (bench_commits.py --relay does this).

The client (`--client`, in the result as "client") shares this machine's cores with the
gateway and the worker under test, so it should take as little of them as it can:

- `c` (default): benchmarks/relay_client.c, compiled with gcc into the run's temp dir: one
  epoll loop over the N sockets that sends the same requests and parses the responses
  as the Python client does. Its own work is about 1 us a chunk (the kernel's per read,
  TCP receive and ACK, is most of any client's CPU here), its loop is paced to wake at
  most once per ms, and it times a chunk within about 1 ms of its arrival where the
  Python client, working through 1,000 sockets, can be tens of ms late. Its CPU is its
  rusage (user + system). Without gcc the script says so and uses `python`.
- `python`: the asyncio client below (`_StreamClient`, uvloop where installed); its CPU
  is this process's CPU time over the run.

    python benchmarks/bench_gateway_relay.py --streams 1000 --tokens 100 --step-ms 50
    python benchmarks/bench_gateway_relay.py --worker fake --streams 1000 --tokens 100 \\
        --step-ms 50
    python benchmarks/bench_gateway_relay.py --worker fake --gateways 2 --streams 1000 \\
        --tokens 100 --step-ms 20
    python benchmarks/bench_gateway_relay.py --worker serve --gateways 2 --streams 1000 \\
        --tokens 300 --step-ms 20
    python benchmarks/bench_gateway_relay.py --worker fake --streams 1000 --tokens 300 \\
        --step-ms 20 --client python
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from zeroserve.cli.harness import ServerProcess, start_server  # noqa: E402

PROMPT_BASE_ID = 1000  # stream k sends the one-token prompt [PROMPT_BASE_ID + k]


# --- the stamped fake worker (its own process) ------------------------------------------

def run_stamped_worker(router: str, tokens: str, step_s: float, word_id: int, out_path: str,
                       stop_path: str) -> None:
    """Emit `word_id` once per step per stream; record when each token left."""
    from tests.gateway.helpers import FakeWorker

    stamps: list[tuple[int, int, float]] = []  # (stream k, token index, monotonic time)

    class StampedWorker(FakeWorker):
        def _step(self):
            outputs = super()._step()
            now = time.monotonic()
            for out in outputs:
                k = self._stream_of[out.request_id]
                first = out.num_output_tokens - len(out.new_token_ids)
                stamps.extend((k, first + j, now) for j in range(len(out.new_token_ids)))
            return outputs

        def _handle(self, msg):
            from zeroserve.common.protocol import Submit

            if isinstance(msg, Submit):
                self._stream_of[msg.request_id] = msg.prompt_token_ids[0] - PROMPT_BASE_ID
            super()._handle(msg)

    worker = StampedWorker(router, tokens, worker_id="stamped-0", step_s=step_s,
                           max_num_seqs=4096, max_model_len=8192, heartbeat_s=0.5,
                           reply=lambda prompt, params: [word_id] * params["max_tokens"])
    worker._stream_of = {}
    worker.start()
    while not os.path.exists(stop_path):
        time.sleep(0.2)
    worker.stop()
    with open(out_path, "w") as f:
        json.dump(stamps, f)


# --- the client ----------------------------------------------------------------------------

class _StreamClient(asyncio.Protocol):
    """One streamed completion over a raw socket, parsed as bytes arrive: a load generator
    that spends little CPU per chunk (it shares this machine's cores with the gateway and
    the worker under test). Each chunk's events are checked: a token event ('data: {"id"'
    with a non-empty choices list) is timed, the usage event read, an error event kept."""

    def __init__(self, k: int, times: list[float], usage: list[int], errors: list[str],
                 done: asyncio.Future):
        self.k, self.times, self.usage, self.errors, self.done = k, times, usage, errors, done
        self.buffer = b""
        self.is_head_read = False

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        buffer = self.buffer + data
        if not self.is_head_read:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                self.buffer = buffer
                return
            status = buffer.split(b"\r\n", 1)[0]
            if b" 200 " not in status:
                self._fail(status.decode(errors="replace"))
                return
            self.is_head_read = True
            buffer = buffer[end + 4:]
        # Chunked transfer encoding; one chunk per gateway write, holding whole events.
        while True:
            line_end = buffer.find(b"\r\n")
            if line_end < 0:
                break
            size = int(buffer[:line_end], 16)
            if size == 0:
                self._finish()
                return
            chunk_end = line_end + 2 + size
            if len(buffer) < chunk_end + 2:
                break
            self._on_chunk(buffer[line_end + 2:chunk_end], now)
            buffer = buffer[chunk_end + 2:]
        self.buffer = buffer

    def _on_chunk(self, data: bytes, now: float) -> None:
        for event in data.split(b"\n\n"):
            if event.startswith(b'data: {"id"'):
                if b'"choices":[]' in event:
                    self.usage[self.k] = json.loads(event[6:])["usage"]["completion_tokens"]
                else:
                    self.times.append(now)
            elif event.startswith(b'data: {"error"'):
                self.errors.append(event.decode()[:200])

    def _fail(self, why: str) -> None:
        self.errors.append(why)
        self._finish()

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.errors.append(f"read: connection lost before the end ({exc!r})")
            self.done.set_result(None)


async def one_stream(port: int, k: int, max_tokens: int, arrivals: list[list[float]],
                     usage: list[int], errors: list[str]) -> None:
    body = json.dumps({"prompt": [PROMPT_BASE_ID + k], "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True, "temperature": 0,
                       "stream_options": {"include_usage": True}}).encode()
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    try:
        transport, _ = await loop.create_connection(
            lambda: _StreamClient(k, arrivals[k], usage, errors, done), "127.0.0.1", port)
    except OSError as e:
        errors.append(f"connect: {e}")
        return
    transport.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                    b"Content-Type: application/json\r\nContent-Length: "
                    + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        await done
    finally:
        transport.close()


async def run_clients(port: int, num_streams: int, max_tokens: int):
    arrivals: list[list[float]] = [[] for _ in range(num_streams)]
    usage = [0] * num_streams
    errors: list[str] = []
    start = time.monotonic()
    await asyncio.gather(*(one_stream(port, k, max_tokens, arrivals, usage, errors)
                           for k in range(num_streams)))
    return start, time.monotonic(), arrivals, usage, errors


def run_loop(coro):
    """uvloop where it is installed (it comes with uvicorn[standard]): the client's CPU per
    chunk is lower, so it takes less of the cores the gateway and the worker need."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def build_c_client(tmp: str) -> str:
    """Compile benchmarks/relay_client.c into the run's temp dir; the binary's path."""
    exe = os.path.join(tmp, "relay_client")
    subprocess.run(["gcc", "-O2", "-o", exe, str(Path(__file__).with_name("relay_client.c"))],
                   check=True)
    return exe


def run_c_client(exe: str, port: int, num_streams: int, max_tokens: int, out_path: str):
    """Run the C client to its end: ((start, end, arrivals, usage, errors) as run_clients
    returns them, the client's CPU seconds: user + system from its rusage, and per stream
    [connected, request sent, first byte] times (0: never))."""
    proc = subprocess.Popen([exe, str(port), str(num_streams), str(max_tokens),
                             str(PROMPT_BASE_ID), out_path])
    _, status, rusage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"relay_client exited with status {proc.returncode}")
    with open(out_path, encoding="utf-8", errors="replace") as f:
        out = json.load(f)
    return ((out["start"], out["end"], out["arrivals"], out["usage"], out["errors"]),
            rusage.ru_utime + rusage.ru_stime, [ramp[:3] for ramp in out["ramp"]])


# --- orchestration ----------------------------------------------------------------------

def cpu_seconds(pid: int, which: tuple[int, ...] = (11, 12)) -> float | None:
    """CPU time a process used so far (Linux /proc): user + system by default, (12,) for
    the system (kernel) part alone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(int(fields[i]) for i in which) / os.sysconf("SC_CLK_TCK")


def child_processes(pid: int) -> dict[int, str]:
    """pid -> command line of each process whose parent is `pid` (Linux /proc)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                children[int(entry.name)] = cmd
        except (OSError, ValueError, IndexError):
            continue
    return children


def threads_cpu_seconds(pids: list[int]) -> dict[str, float]:
    """CPU seconds per thread name over the processes `pids` (Linux /proc): where a
    gateway's CPU goes besides its event loop (ZeroMQ's I/O thread, the log writer)."""
    used: dict[str, float] = {}
    for pid in pids:
        try:
            tids = [entry.name for entry in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                task = Path(f"/proc/{pid}/task/{tid}")
                name = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            name = "loop" if tid == str(pid) else name
            used[name] = used.get(name, 0.0) + \
                (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return used


def gateways_cpu_seconds(pids: list[int], which: tuple[int, ...] = (11, 12)) -> float | None:
    used = [cpu_seconds(pid, which) for pid in pids]
    return None if None in used else sum(used)


def launch(tree: Path | None, command: str, args: tuple[str, ...], port: int,
           env: dict[str, str] | None = None) -> ServerProcess:
    """`zeroserve COMMAND ARGS` from this checkout, or from the checkout `tree` by its own
    launcher (its output is ours in both cases)."""
    if tree is None:
        return start_server(command=command, args=args, port=port, wait=False, env=env)
    from benchmarks.bench_commits import launcher_for, make_importable, server_env

    make_importable(tree)
    launcher = launcher_for(tree)
    return ServerProcess([sys.executable, "-m", launcher.module, command, *args], port, None,
                         env=server_env(launcher) | (env or {}), cwd=tree)


def default_endpoint_args(port: int, index: int) -> list[str]:
    from zeroserve.gateway.config import default_endpoints

    router, tokens = default_endpoints(port, index)
    return ["--router-address", router, "--tokens-address", tokens]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def steady_tokens_per_s(arrivals: list[list[float]]) -> float | None:
    """Token arrivals per second while every stream is open: in [t0, t1], t0 the latest
    first arrival (all streams have started), t1 the earliest last one (none has ended);
    None with fewer than 2 streams or no such window."""
    started = [times for times in arrivals if times]
    if len(started) < 2:
        return None
    t0, t1 = max(times[0] for times in started), min(times[-1] for times in started)
    if t1 <= t0:
        return None
    num = sum(bisect.bisect_right(times, t1) - bisect.bisect_left(times, t0)
              for times in started)
    return num / (t1 - t0)


# Per round (--rounds): what each burst reports, and the figures whose median is given.
_ROUND_KEYS = ("wall_s", "errors", "usage_tokens", "tokens_per_s", "steady_tokens_per_s",
               "first_token_s", "ramp_last_tenth_s", "cpu_s", "gateway_threads_cpu_s",
               "gateway_cpu_us_per_token", "gateway_system_cpu_us_per_token", "gateway_cpu_us_per_request",
               "gateway_loop_cpu_us_per_request", "worker_cpu_us_per_token", "itl_ms",
               "worker_step_ms", "worker_step_p50_ms", "load_average")
_MEDIAN_KEYS = ("tokens_per_s", "steady_tokens_per_s", "gateway_cpu_us_per_token",
                "gateway_system_cpu_us_per_token", "gateway_cpu_us_per_request",
                "gateway_loop_cpu_us_per_request", "worker_cpu_us_per_token",
                "worker_step_p50_ms", "wall_s")


def measure_round(args: argparse.Namespace, client_exe: str | None, tmp: str,
                  gateway_pids: list[int], worker_pid: int) -> dict:
    """One burst: N streams opened at once, run to their end; what the client saw and the
    CPU each process (and each gateway thread) used meanwhile."""
    threads_before = threads_cpu_seconds(gateway_pids)
    cpu_before = {"gateway": gateways_cpu_seconds(gateway_pids),
                  "gateway_system": gateways_cpu_seconds(gateway_pids, (12,)),
                  "worker": cpu_seconds(worker_pid)}
    load_before = os.getloadavg()[0]
    ramp = None
    if client_exe is not None:
        (start, end, arrivals, usage, errors), client_cpu, ramp = run_c_client(
            client_exe, args.port, args.streams, args.tokens,
            os.path.join(tmp, "client.json"))
    else:
        client_before = time.process_time()
        start, end, arrivals, usage, errors = run_loop(
            run_clients(args.port, args.streams, args.tokens))
        client_cpu = time.process_time() - client_before
    load_after = os.getloadavg()[0]
    gateway_threads = {name: round(used - threads_before.get(name, 0.0), 2)
                       for name, used in threads_cpu_seconds(gateway_pids).items()}
    cpu_used = {"gateway": gateways_cpu_seconds(gateway_pids),
                "gateway_system": gateways_cpu_seconds(gateway_pids, (12,)),
                "worker": cpu_seconds(worker_pid)}
    cpu_used = {k: (v - cpu_before[k]) if v is not None and cpu_before[k] is not None
                else None for k, v in cpu_used.items()}
    cpu_used["client"] = client_cpu
    return {"start": start, "end": end, "arrivals": arrivals, "usage": usage, "errors": errors,
            "cpu_used": cpu_used, "gateway_threads": gateway_threads,
            "load": (load_before, load_after), "ramp": ramp}


def ramp_of_the_last(start: float, arrivals: list[list[float]], ramp: list[list[float]],
                     fraction: float = 0.1) -> dict[str, dict[str, float]]:
    """The burst's ramp as the client saw it, for the `fraction` of streams whose first token
    came last (those that set the whole run's length): when each stream's connection was
    established, its request written, its response's first byte and first token read,
    in seconds from the burst's start (p50 and max over those streams)."""
    order = sorted((times[0], k) for k, times in enumerate(arrivals) if times)
    last = [k for _, k in order[int(len(order) * (1 - fraction)):]]
    hops = {"connected": 0, "sent": 1, "first_byte": 2}
    result = {}
    for name, i in hops.items():
        times = [ramp[k][i] - start for k in last if ramp[k][i]]
        if times:
            result[name] = {"p50": round(pct(times, 50), 3), "max": round(max(times), 3)}
    if last:
        firsts = [arrivals[k][0] - start for k in last]
        result["first_token"] = {"p50": round(pct(firsts, 50), 3), "max": round(max(firsts), 3)}
    return result


def summarize(args: argparse.Namespace, measured: dict, stamps_path: str | None) -> dict:
    """One round's result; with `stamps_path` the fake worker's step period (from its stamps
    within the round) and, with one round only, the added latency too."""
    start, end, arrivals = measured["start"], measured["end"], measured["arrivals"]
    usage, errors, cpu_used = measured["usage"], measured["errors"], measured["cpu_used"]
    gateway_threads = measured["gateway_threads"]
    load_before, load_after = measured["load"]
    wall = end - start
    num_tokens = sum(usage)
    num_chunks = sum(len(a) for a in arrivals)
    result = {
        "worker": args.worker, "client": args.client, "gateways": args.gateways,
        "streams": args.streams, "tokens_per_stream": args.tokens,
        "step_ms": args.step_ms, "credit_window": args.credit_window,
        "wall_s": round(wall, 3), "completed_streams": sum(1 for u in usage if u),
        "errors": len(errors), "usage_tokens": num_tokens, "chunks": num_chunks,
        "tokens_per_s": round(num_tokens / wall, 1),
    }
    # The delivery rate while all N streams are open (ramp up and tail excluded).
    steady = steady_tokens_per_s(arrivals)
    if steady is not None:
        result["steady_tokens_per_s"] = round(steady, 1)
    # When the streams' first tokens arrived, from the start (the ramp up), and their
    # last ones (the tail).
    firsts = [times[0] - start for times in arrivals if times]
    lasts = [times[-1] - start for times in arrivals if times]
    if firsts:
        result["first_token_s"] = {"p50": round(pct(firsts, 50), 3),
                                   "p90": round(pct(firsts, 90), 3),
                                   "p99": round(pct(firsts, 99), 3),
                                   "max": round(max(firsts), 3)}
        result["last_token_s"] = {"min": round(min(lasts), 3), "max": round(max(lasts), 3)}
    if measured.get("ramp") is not None and firsts:
        # Where the last tenth's ramp went on the client's side: a late first byte after an
        # early request is the gateway's (accepting, admitting) and the worker's time.
        result["ramp_last_tenth_s"] = ramp_of_the_last(start, arrivals, measured["ramp"])
    result |= {
        "chunks_per_s": round(num_chunks / wall, 1),
        "offered_tokens_per_s": round(args.streams * 1000 / args.step_ms, 1),
        # The machine's 1-minute load average around the run: on a shared machine tokens/s
        # follows it; CPU per token much less.
        "load_average": [round(load_before, 2), round(load_after, 2)],
    }
    # CPU per delivered token is robust to a shared, noisy machine, unlike tokens/s.
    result["cpu_s"] = {k: round(v, 2) for k, v in cpu_used.items() if v is not None}
    # The gateways' CPU by thread ("loop": the event loop's, the main thread).
    result["gateway_threads_cpu_s"] = {k: v for k, v in gateway_threads.items() if v > 0}
    if cpu_used.get("worker") and num_tokens:
        # The worker's engine loop, its link and sender threads and ZeroMQ's I/O thread.
        result["worker_cpu_us_per_token"] = round(cpu_used["worker"] / num_tokens * 1e6, 2)
    if cpu_used.get("gateway") and num_tokens:
        result["gateway_cpu_us_per_token"] = round(cpu_used["gateway"] / num_tokens * 1e6, 1)
        # Its kernel part: mostly the socket writes (one per stream per step, each a TCP
        # send that, on loopback, also runs the client side's receive).
        if cpu_used.get("gateway_system") is not None:
            result["gateway_system_cpu_us_per_token"] = round(
                cpu_used["gateway_system"] / num_tokens * 1e6, 1)
        result["gateway_tokens_per_cpu_s"] = round(num_tokens / cpu_used["gateway"], 1)
    # Per stream: with a few tokens per stream (--tokens 2), what admitting one costs.
    if cpu_used.get("gateway"):
        result["gateway_cpu_us_per_request"] = round(cpu_used["gateway"] / args.streams * 1e6)
    if gateway_threads.get("loop"):
        result["gateway_loop_cpu_us_per_request"] = round(
            gateway_threads["loop"] / args.streams * 1e6)
    if num_chunks:
        result["client_cpu_us_per_chunk"] = round(cpu_used["client"] / num_chunks * 1e6, 2)
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False)]
    result["itl_ms"] = {q: round(pct(gaps, q) * 1000, 2) for q in (50, 90, 99)}
    if args.worker in ("stamped", "fake") and stamps_path is not None \
            and os.path.exists(stamps_path):
        with open(stamps_path) as f:
            stamps = json.load(f)
        if args.worker == "fake":  # [first prompt token, output index, time made]
            # (Every round's: this one's were made between its start and its end.)
            stamps = [(first - PROMPT_BASE_ID, i, t) for first, i, t in stamps
                      if start <= t <= end]
        if args.rounds == 1:
            sent = {(k, i): t for k, i, t in stamps}
            added = [t - sent[(k, i)] for k, times in enumerate(arrivals)
                     for i, t in enumerate(times) if (k, i) in sent]
            result["added_latency_ms"] = {q: round(pct(added, q) * 1000, 2)
                                          for q in (50, 90, 99)}
            result["added_latency_ms"]["mean"] = round(statistics.fmean(added) * 1000, 2) \
                if added else None
        if args.worker == "fake":
            # The worker's step period: the gaps between the times its steps made tokens
            # (the forward's time plus the serial work around it, and any wait for a core).
            made = sorted({t for _, _, t in stamps})
            periods = [b - a for a, b in zip(made, made[1:], strict=False)]
            result["worker_step_ms"] = {q: round(pct(periods, q) * 1000, 2) for q in (50, 90)}
            if periods:
                result["worker_step_p50_ms"] = result["worker_step_ms"][50]
    if errors:
        result["first_errors"] = errors[:3]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=100, help="output tokens per stream")
    ap.add_argument("--step-ms", type=float, default=50.0,
                    help="fake engine step time (one token per stream per step)")
    ap.add_argument("--worker", choices=["stamped", "fake", "serve"], default="stamped",
                    help="serve: `zeroserve serve --backend fake` as a user runs it (its "
                         "gateways and worker as its children, default flags but for "
                         "--max-num-seqs)")
    ap.add_argument("--gateways", type=int, default=1,
                    help="gateway processes sharing the port (--worker fake only)")
    ap.add_argument("--client", choices=["c", "python"], default="c",
                    help="the load generator: c (benchmarks/relay_client.c, built with gcc; "
                         "python where gcc is not found) or python (the asyncio client)")
    ap.add_argument("--port", type=int, default=18765)
    ap.add_argument("--credit-window", type=int, default=32)
    ap.add_argument("--result-json", default=None)
    ap.add_argument("--no-stamps", action="store_true",
                    help="--worker fake: no --fake-stamps (a worker from before that flag)")
    ap.add_argument("--gateway-arg", action="append", default=[],
                    help="an extra flag for `zeroserve gateway` (repeatable), e.g. "
                         "--gateway-arg=--disable-metrics")
    ap.add_argument("--worker-arg", action="append", default=[],
                    help="an extra flag for `zeroserve worker` (repeatable; --worker fake), "
                         "e.g. --worker-arg='--speculative-config={\"recent_ngrams\": 0}'")
    ap.add_argument("--rounds", type=int, default=1,
                    help="bursts of --streams streams, one after the other, on the same "
                         "servers: per-round figures and their medians (no added latency)")
    ap.add_argument("--profile-gateway", default=None, metavar="PATH",
                    help="run the gateway(s) under cProfile, stats written to PATH "
                         "(PATH.<index> for gateway index > 0) at the end; its CPU figures "
                         "are then inflated")
    ap.add_argument("--tree", type=Path, default=None, metavar="PATH",
                    help="serve the gateway(s) and the worker from this checkout (another "
                         "commit's git worktree) by its own launcher; --worker fake or serve")
    args = ap.parse_args()
    if args.tree is not None and args.worker == "stamped":
        ap.error("--tree needs --worker fake or serve (the stamped worker is this checkout's)")
    if args.gateways > 1 and args.worker == "stamped":
        ap.error("--gateways N > 1 needs --worker fake or serve (the stamped worker has one "
                 "link)")
    if args.client == "c" and shutil.which("gcc") is None:
        print("note: gcc not found, so the client is the Python one (--client python)",
              file=sys.stderr)
        args.client = "python"

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.streams + 256)),
                                                hard))
    from zeroserve.gateway.config import default_endpoints

    router, tokens = default_endpoints(args.port)
    tmp = tempfile.mkdtemp(prefix="relay-bench-")
    client_exe = build_c_client(tmp) if args.client == "c" else None
    # The servers' output is ours (no log file): a warning shows beside the result.
    gateways = []
    profile_env = None if args.profile_gateway is None else {
        "ZEROSERVE_GATEWAY_CPU_PROFILE": os.path.abspath(args.profile_gateway)}
    for index in range(args.gateways if args.worker != "serve" else 0):
        shared = ["--reuse-port", *default_endpoint_args(args.port, index)] \
            if args.gateways > 1 else []
        gateways.append(launch(args.tree, "gateway", (
            "--port", str(args.port), "--log-level", "warning", "--max-queued-requests",
            str(args.streams * 2), "--credit-window", str(args.credit_window), *shared,
            *args.gateway_arg), args.port, profile_env))
    procs = list(gateways)
    stamps_path, stop_path = os.path.join(tmp, "stamps.json"), os.path.join(tmp, "stop")
    stamped = None
    try:
        if args.worker == "stamped":
            from zeroserve.gateway.text.tokenizer import load_tokenizer

            (word_id,) = load_tokenizer("default").encode(" hello", add_special_tokens=False)
            ctx = multiprocessing.get_context("spawn")
            stamped = ctx.Process(target=run_stamped_worker, args=(
                router, tokens, args.step_ms / 1000, word_id, stamps_path, stop_path))
            stamped.start()
        elif args.worker == "serve":
            procs.append(launch(args.tree, "serve", (
                "--port", str(args.port), "--gateways", str(args.gateways), "--backend",
                "fake", "--fake-forward-ms", str(args.step_ms), "--max-num-seqs",
                str(args.streams), "--credit-window", str(args.credit_window), "--log-level",
                "warning", *args.gateway_arg), args.port, profile_env))
        else:
            procs.append(launch(args.tree, "worker", (
                "--port", str(args.port), "--gateways", str(args.gateways), "--backend",
                "fake", "--fake-forward-ms", str(args.step_ms), "--max-num-seqs",
                str(max(args.streams, 64)), "--max-num-batched-tokens",
                str(max(args.streams, 512)), "--num-kv-blocks",
                str(args.streams * (args.tokens // 16 + 3)), "--log-level", "warning",
                *([] if args.no_stamps else ["--fake-stamps", stamps_path]),
                *args.worker_arg), args.port))
        # Every process in procs that speaks HTTP (the gateways, serve) answers on args.port.
        procs[0].wait_answering(
            num_in_a_row=1 if args.gateways == 1 else 10 * args.gateways)
        worker_pid = stamped.pid if stamped is not None else procs[-1].process.pid
        gateway_pids = [g.process.pid for g in gateways]
        if args.worker == "serve":
            children = child_processes(procs[-1].process.pid)
            gateway_pids = [pid for pid, cmd in children.items() if " gateway " in cmd]
            (worker_pid,) = [pid for pid, cmd in children.items()  # main's, or older ones'
                             if "zeroserve.cli worker" in cmd or "zeroserve.worker" in cmd]
        rounds = [measure_round(args, client_exe, tmp, gateway_pids, worker_pid)
                  for _ in range(args.rounds)]
    finally:
        if stamped is not None:
            Path(stop_path).touch()
            stamped.join(30)
        for p in reversed(procs):  # the worker first, so it does not miss its gateway
            p.terminate()
        for p in reversed(procs):
            p.stop(timeout_s=10)

    results = [summarize(args, r, stamps_path) for r in rounds]
    result = results[0]
    if args.rounds > 1:
        # Each burst of N streams on the same servers; the medians are what to compare.
        result = {"rounds": [{k: v for k, v in r.items() if k in _ROUND_KEYS} for r in results]}
        result["median"] = {k: round(statistics.median(r[k] for r in result["rounds"]), 3)
                            for k in _MEDIAN_KEYS if all(k in r for r in result["rounds"])}
    print(json.dumps(result, indent=2))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
