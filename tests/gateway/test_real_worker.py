"""The gateway against the real worker process (`zeroserve worker --backend fake`):
the wire contract end to end, including a worker killed mid-stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, wait_until
from zeroserve.cli.harness import REPO_ROOT, child_env, zeroserve_argv
from zeroserve.gateway.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def start_worker(gw: GatewayServer, worker_id: str) -> subprocess.Popen:
    router, tokens = gw.config.endpoints
    return subprocess.Popen(
        zeroserve_argv("worker", "--worker-id", worker_id, "--router-address", router,
                       "--tokens-address", tokens, "--backend", "fake", "--fake-forward-ms", "5",
                       "--heartbeat-interval", "0.1", "--log-level", "warning"),
        cwd=REPO_ROOT, env=child_env())


def healthy(gw: GatewayServer) -> bool:
    return httpx.get(gw.url + "/health").status_code == 200


@pytest.mark.slow
def test_streams_and_usage_through_a_real_worker(tokenizer):
    with GatewayServer(tokenizer, worker_timeout_s=1.0, max_tokens_limit=8192) as gw:
        proc = start_worker(gw, "real-0")
        try:
            assert wait_until(lambda: healthy(gw), 60)
            r = httpx.post(gw.url + "/v1/completions", timeout=30, json={
                "prompt": "Hello", "max_tokens": 20, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 20
            assert r.json()["choices"][0]["finish_reason"] == "length"
            with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=30, json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}) as s:
                data = [json.loads(x[6:]) for x in s.iter_lines()
                        if x.startswith("data: {")]
            assert data[-1]["usage"]["completion_tokens"] == 300
            assert data[-2]["choices"][0]["finish_reason"] == "length"
            # Client goes away mid-stream: the worker frees the request.
            with httpx.stream("POST", gw.url + "/v1/completions", timeout=30, json={
                    "prompt": "x", "max_tokens": 5000, "ignore_eos": True,
                    "stream": True}) as s:
                next(x for x in s.iter_lines() if x.startswith("data: {"))

            def worker_idle() -> bool:
                w = httpx.get(gw.url + "/health").json()["workers"][0]
                return w["num_running"] == 0 and w["num_paused"] == 0 and \
                    w["num_in_flight"] == 0
            assert wait_until(worker_idle, 10)
        finally:
            proc.terminate()
            proc.wait(20)


@pytest.mark.slow
def test_a_stream_on_a_killed_worker_continues_when_it_comes_back(tokenizer):
    with GatewayServer(tokenizer, worker_timeout_s=1.0, queue_timeout_s=60) as gw:
        proc = start_worker(gw, "real-1")
        try:
            assert wait_until(lambda: healthy(gw), 60)
            body = {"prompt": "x", "max_tokens": 600, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            # What an undisturbed run says (the fake backend's tokens follow the context).
            with httpx.stream("POST", gw.url + "/v1/completions", timeout=30, json=body) as s:
                reference = "".join(json.loads(x[6:])["choices"][0]["text"]
                                    for x in s.iter_lines()
                                    if x.startswith("data: {") and '"choices":[{' in x)
            with httpx.stream("POST", gw.url + "/v1/completions", timeout=60, json=body) as s:
                lines = s.iter_lines()
                first = next(x for x in lines if x.startswith("data: {"))
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
                proc = start_worker(gw, "real-1")  # the same id comes back: it goes on there
                rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            assert all("error" not in e for e in rest)
            text = json.loads(first[6:])["choices"][0]["text"] + "".join(
                e["choices"][0]["text"] for e in rest if e["choices"])
            assert text == reference and rest[-1]["usage"]["completion_tokens"] == 600
            r = httpx.post(gw.url + "/v1/completions", timeout=60, json={
                "prompt": "x", "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            assert len(gw.gateway.streams) == 0
        finally:
            proc.terminate()
            proc.wait(20)
