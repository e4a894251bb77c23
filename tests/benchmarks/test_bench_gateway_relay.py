"""The relay benchmark's ramp figures: the hops of the streams whose first token came last."""

from __future__ import annotations

from benchmarks.bench_gateway_relay import ramp_of_the_last


def test_the_ramp_is_that_of_the_streams_whose_first_token_came_last():
    start = 100.0
    # 20 streams; stream k's first token at start + 0.01 k, except stream 3: last, at 0.9 s,
    # its connection established at 0.05 s and its first byte read at 0.8 s.
    arrivals = [[start + 0.01 * k, start + 1.0] for k in range(20)]
    arrivals[3] = [start + 0.9, start + 1.0]
    ramp = [[start + 0.001, start + 0.002, arrivals[k][0]] for k in range(20)]
    ramp[3] = [start + 0.05, start + 0.06, start + 0.8]
    arrivals.append([])  # a stream that never got a token is no one's last
    ramp.append([0.0, 0.0, 0.0])
    result = ramp_of_the_last(start, arrivals, ramp)  # the last tenth: streams 3 and 19
    assert result["first_token"] == {"p50": 0.9, "max": 0.9}
    assert result["first_byte"]["max"] == 0.8
    assert result["connected"]["max"] == 0.05
    assert result["sent"]["max"] == 0.06
