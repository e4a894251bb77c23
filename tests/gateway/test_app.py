"""The gateway app on a real uvicorn server, talking over real ZeroMQ sockets to an
in-test fake worker."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import zmq

from tests.gateway.helpers import (
    GatewayServer,
    cyclic_reply,
    raw_completion,
    wait_until,
)
from zeroserve.common.protocol import Drain

REPLY = "Hello, world! 😀 日本語 done."
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def served():
    """A gateway with one ready fake worker."""
    with GatewayServer() as gw:
        worker = gw.worker().start()
        assert worker.ready.wait(5)
        yield gw, worker
        worker.stop()


def events(response: httpx.Response) -> list:
    """Parsed SSE data payloads; '[DONE]' stays a string."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def post_stream(gw, path, body, timeout=10) -> list:
    with httpx.stream("POST", gw.url + path, json=body, timeout=timeout) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return events(r)


def assert_no_leaks(gw):
    assert wait_until(lambda: len(gw.gateway.streams) == 0, 3), gw.gateway.streams.states
    assert all(not w.request_ids for w in gw.gateway.registry.workers.values())


# --- happy paths --------------------------------------------------------------------------

def test_completion_non_stream(served):
    gw, worker = served
    r = httpx.post(gw.url + "/v1/completions",
                   json={"model": MODEL, "prompt": "Say hi", "max_tokens": 100})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": REPLY, "logprobs": None,
                                "finish_reason": "stop"}]
    n = len(REPLY.encode())
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": n,
                             "total_tokens": 6 + n}
    assert worker.submits[0].prompt_token_ids == list(b"Say hi")
    assert worker.submits[0].credit == gw.config.credit_window
    assert_no_leaks(gw)


def test_completion_stream(served):
    gw, _ = served
    evs = post_stream(gw, "/v1/completions",
                      {"model": MODEL, "prompt": "x", "max_tokens": 100, "stream": True})
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all("usage" not in c for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == REPLY and "\ufffd" not in text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert_no_leaks(gw)


def test_chat_stream_with_usage(served):
    gw, _ = served
    evs = post_stream(gw, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "max_completion_tokens": 100, "stream_options": {"include_usage": True}})
    assert evs[-1] == "[DONE]"
    chunks, usage_chunk = evs[:-2], evs[-2]
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["choices"] == []
    n = len(REPLY.encode())
    assert usage_chunk["usage"]["completion_tokens"] == n
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + n


def test_chat_non_stream_with_text_parts(served):
    gw, worker = served
    r = httpx.post(gw.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                         {"type": "text", "text": "there"}]}]})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"
    ids = worker.submits[0].prompt_token_ids
    prompt = bytes(t for t in ids if t < 256).decode()
    assert "Hi\nthere" in prompt and prompt.endswith("assistant\n")
    # The ChatML markers are single special tokens, not their characters.
    assert worker.submits[0].prompt_token_ids[0] == 256


def test_max_tokens_gives_length(served):
    gw, worker = served
    worker.reply = cyclic_reply("abc")
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 10})
    choice = r.json()["choices"][0]
    assert choice["text"] == "abcabcabca" and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 10


def test_batch_prompts_and_n_with_seeds(served):
    gw, worker = served
    r = httpx.post(gw.url + "/v1/completions", json={
        "prompt": ["a", "bb"], "n": 2, "seed": 7, "max_tokens": 50, "temperature": 0.5})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == REPLY for c in body["choices"])
    assert sorted(s.params["seed"] for s in worker.submits) == [7, 7, 8, 8]
    assert sorted(len(s.prompt_token_ids) for s in worker.submits) == [1, 1, 2, 2]
    assert body["usage"]["prompt_tokens"] == 3  # each prompt counted once
    assert body["usage"]["completion_tokens"] == 4 * len(REPLY.encode())


def test_token_id_prompt_and_sampling_params_reach_worker(served):
    gw, worker = served
    r = httpx.post(gw.url + "/v1/completions", json={
        "prompt": [72, 105], "max_tokens": 5, "temperature": 0, "top_p": 0.9, "top_k": 40,
        "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2})
    assert r.status_code == 200
    sub = worker.submits[0]
    assert sub.prompt_token_ids == [72, 105]
    assert {k: sub.params[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                                       "presence_penalty", "frequency_penalty",
                                       "repetition_penalty", "ignore_eos", "min_tokens")} == {
        "max_tokens": 5, "temperature": 0, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
        "ignore_eos": True, "min_tokens": 2}


def test_stop_string_trims_and_aborts_worker(served):
    gw, worker = served
    worker.reply = cyclic_reply("Hello, world! ")
    r = httpx.post(gw.url + "/v1/completions",
                   json={"prompt": "x", "max_tokens": 500, "stop": ["world"]})
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hello, " and choice["finish_reason"] == "stop"
    rid = worker.submits[0].request_id
    assert wait_until(lambda: rid in worker.aborts)
    assert_no_leaks(gw)


def test_stop_string_streaming_never_leaks_its_start(served):
    gw, worker = served
    worker.reply = cyclic_reply("one two three four ")
    evs = post_stream(gw, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "count"}], "max_tokens": 500,
        "stop": ["three", "nope"], "stream": True})
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in evs[:-1])
    assert text == "one two " and evs[-2]["choices"][0]["finish_reason"] == "stop"
    assert_no_leaks(gw)


def test_logprobs_shapes(served):
    gw, _ = served
    r = httpx.post(gw.url + "/v1/completions",
                   json={"prompt": "x", "max_tokens": 3, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "e", "l"] and lp["token_logprobs"] == [-0.25] * 3
    assert lp["text_offset"] == [0, 1, 2] and len(lp["top_logprobs"][0]) == 2
    r = httpx.post(gw.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["H", "e"]
    assert content[0]["bytes"] == [72] and len(content[0]["top_logprobs"]) == 2


def test_models_health_tokenize(served):
    gw, _ = served
    models = httpx.get(gw.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    # OpenAI's retrieve, as the openai client's models.retrieve() calls it
    assert httpx.get(f"{gw.url}/v1/models/{MODEL}").json() == models["data"][0]
    missing = httpx.get(gw.url + "/v1/models/other/model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    bad_ids = httpx.post(gw.url + "/detokenize", json={"tokens": [1, 10**6]})
    assert bad_ids.status_code == 400 and bad_ids.json()["error"]["param"] == "tokens"
    health = httpx.get(gw.url + "/health")
    assert health.status_code == 200 and health.json()["workers"][0]["worker_id"] == "fake-0"
    tok = httpx.post(gw.url + "/tokenize", json={"prompt": "héllo"}).json()
    assert tok == {"tokens": list("héllo".encode()), "count": 6, "max_model_len": 4096}
    tok = httpx.post(gw.url + "/tokenize",
                     json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert tok["tokens"][0] == 256 and tok["count"] == len(tok["tokens"])


# --- caller mistakes ----------------------------------------------------------------------

BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 5000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "", "max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 4090}, 400, "max_tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_caller_mistakes_are_openai_shaped_4xx(served, path, body, status, param):
    gw, worker = served
    if isinstance(body, bytes):
        r = httpx.post(gw.url + path, content=body,
                       headers={"content-type": "application/json"})
    else:
        r = httpx.post(gw.url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert worker.submits == []  # validated before any worker saw it


def test_context_length_message_is_vllm_like(served):
    gw, _ = served
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": "abcd", "max_tokens": 4093})
    msg = r.json()["error"]["message"]
    assert "maximum context length is 4096 tokens" in msg and "4097 tokens" in msg


def test_unknown_model_is_404(served):
    gw, _ = served
    r = httpx.post(gw.url + "/v1/completions", json={"model": "gpt-5", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


# --- capacity, admission ----------------------------------------------------------------

def test_queue_full_is_429_with_retry_after():
    # The first request must still be queued when the second comes: a queue timeout a loaded
    # machine's slow second request cannot outlast (it was 1 s).
    with GatewayServer(max_queued_requests=1, queue_timeout_s=5) as gw, httpx.Client() as c:
        import threading
        first = threading.Thread(target=lambda: c.post(
            gw.url + "/v1/completions", json={"prompt": "x"}, timeout=10))
        first.start()  # no worker: it waits in the queue
        assert wait_until(lambda: gw.gateway.admission.num_queued == 1)
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": "y"})
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        first.join()


def test_no_worker_waits_then_serves_when_one_arrives():
    with GatewayServer(queue_timeout_s=5) as gw:
        assert httpx.get(gw.url + "/health").status_code == 503
        import threading
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 100}, timeout=10)))
        t.start()
        time.sleep(0.3)
        worker = gw.worker().start()
        t.join(10)
        assert result["r"].status_code == 200
        assert result["r"].json()["choices"][0]["text"] == REPLY
        worker.stop()


def test_no_worker_times_out_with_503():
    with GatewayServer(queue_timeout_s=0.3) as gw:
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
        assert_no_leaks(gw)


# --- workers coming and going -------------------------------------------------------------

def test_a_stream_whose_worker_is_lost_with_no_other_fails_after_the_queue_timeout():
    with GatewayServer(queue_timeout_s=1.0) as gw:
        worker = gw.worker(reply=cyclic_reply("abc"), step_s=0.01).start()
        assert worker.ready.wait(5)
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=10, json={
                "prompt": "x", "max_tokens": 4000, "stream": True}) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            worker.is_heartbeating = worker.is_stepping = False  # it hangs
            rest = [json.loads(x[6:]) if x != "data: [DONE]" else x[6:]
                    for x in lines if x.startswith("data: ")]
        # It waited in the queue for a worker to continue on; none came: a clear 503 event.
        assert rest[-1] == "[DONE]"
        assert rest[-2]["error"]["code"] == "no_worker"
        assert wait_until(lambda: gw.gateway.registry.num_live == 0)
        assert_no_leaks(gw)
        worker.stop()


def test_worker_lost_non_stream_is_503():
    # No other worker comes: the request waits out the queue timeout (1 s, not the helper's 5).
    with GatewayServer(queue_timeout_s=1.0) as gw:
        worker = gw.worker(reply=cyclic_reply("abc"), step_s=0.01).start()
        assert worker.ready.wait(5)
        import threading
        threading.Timer(0.2, lambda: setattr(worker, "is_heartbeating", False)).start()
        worker.is_stepping = False
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 100},
                       timeout=10)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable"
        assert_no_leaks(gw)
        worker.stop()


def test_a_stream_continues_on_the_restarted_worker():
    with GatewayServer() as gw:
        worker = gw.worker(reply=cyclic_reply("abc"), step_s=0.01).start()
        assert worker.ready.wait(5)
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=10, json={
                "prompt": "x", "max_tokens": 300, "stream": True}) as r:
            lines = r.iter_lines()
            first = json.loads(next(x for x in lines if x.startswith("data: {"))[6:])
            worker.stop()  # the process dies ...
            worker2 = gw.worker(reply=cyclic_reply("abc")).start()  # ... and comes back
            assert worker2.pid != worker.pid
            rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        # The client saw a pause: no error, no token twice or missing.
        assert all("error" not in e for e in rest)
        text = first["choices"][0]["text"] + "".join(e["choices"][0]["text"] for e in rest)
        assert text == ("abc" * 100) and rest[-1]["choices"][0]["finish_reason"] == "length"
        moved = worker2.submits[0]
        assert moved.request_id == worker.submits[0].request_id
        assert 0 < len(moved.output_token_ids) < 300  # it went on from where it stopped
        assert_no_leaks(gw)
        worker2.stop()


def test_request_on_a_lost_worker_without_output_moves_to_another():
    with GatewayServer() as gw:
        a = gw.worker(worker_id="a").start()
        assert a.ready.wait(5)
        a.is_stepping = False  # takes the request, then hangs before any token
        import threading
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 100}, timeout=10)))
        t.start()
        assert wait_until(lambda: a.submits)
        b = gw.worker(worker_id="b").start()
        assert b.ready.wait(5)
        a.is_heartbeating = False  # ... and dies
        t.join(10)
        assert result["r"].status_code == 200
        assert result["r"].json()["choices"][0]["text"] == REPLY
        assert len(b.submits) == 1 and b.submits[0].request_id == a.submits[0].request_id
        assert_no_leaks(gw)
        a.stop()
        b.stop()


def test_refused_submit_is_tried_once_more_then_fails(served):
    gw, worker = served
    worker.num_submits_to_refuse = 1
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 100})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY
    assert len(worker.submits) == 2
    worker.num_submits_to_refuse = 2
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 100})
    assert r.status_code == 500
    assert "worker is draining" in r.json()["error"]["message"]
    assert_no_leaks(gw)


def test_repeated_hello_keeps_the_streams_of_that_worker(served):
    gw, worker = served
    worker.reply = cyclic_reply("abc")
    worker.step_s = 0.01
    with httpx.stream("POST", gw.url + "/v1/completions", timeout=10, json={
            "prompt": "x", "max_tokens": 200, "stream": True}) as r:
        lines = r.iter_lines()
        next(x for x in lines if x.startswith("data: {"))
        worker.send_control(worker.hello())  # same pid: its READY was late, say
        rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "error" not in rest[-1] and rest[-1]["choices"][0]["finish_reason"] == "length"
    assert len(worker.submits) == 1


def test_protocol_version_mismatch_is_refused():
    with GatewayServer() as gw:
        worker = gw.worker(protocol_version=99).start()
        assert wait_until(lambda: worker.refused_reason is not None)
        assert "protocol version" in worker.refused_reason
        assert httpx.get(gw.url + "/health").status_code == 503
        worker.stop()


def test_draining_worker_gets_no_new_requests():
    with GatewayServer() as gw:
        a = gw.worker(worker_id="a").start()
        b = gw.worker(worker_id="b").start()
        assert a.ready.wait(5) and b.ready.wait(5)
        a.send_control(Drain("a", 10.0))
        assert wait_until(lambda: gw.gateway.registry.get("a").status.value == "draining")
        for _ in range(4):
            httpx.post(gw.url + "/v1/completions", json={"prompt": "x"})
        assert len(a.submits) == 0 and len(b.submits) == 4
        a.stop()
        b.stop()


def test_malformed_frames_are_dropped(served):
    gw, _ = served
    router, tokens = gw.config.endpoints
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(router)
    push = ctx.socket(zmq.PUSH)
    push.connect(tokens)
    for frames in ([b"\x01", b"\xc1garbage"], [b"\x63", b"x"], [b"only-one"],
                   [b"\x06", b"\x93\x01\x02\x03"]):
        dealer.send_multipart(frames)
        push.send_multipart(frames)
    time.sleep(0.2)
    dealer.close(0)
    push.close(0)
    ctx.term()
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 50})
    assert r.json()["choices"][0]["text"] == REPLY


# --- flow control, disconnects, slow clients ------------------------------------------------

def test_credits_bound_outstanding_tokens():
    with GatewayServer(credit_window=8) as gw:
        worker = gw.worker(reply=cyclic_reply("abcdefgh"), tokens_per_step=3).start()
        assert worker.ready.wait(5)
        evs = post_stream(gw, "/v1/completions",
                          {"prompt": "x", "max_tokens": 300, "stream": True})
        text = "".join(c["choices"][0]["text"] for c in evs[:-1])
        assert len(text) == 300
        rid = worker.submits[0].request_id
        assert worker.submits[0].credit == 8
        assert 0 < worker.max_outstanding[rid] <= 8
        # Credit came back in batches for (nearly) everything delivered: the last limit
        # granted covers everything but the final window.
        assert max(limit for r, limit, *_ in worker.credits if r == rid) >= 300
        worker.stop()


def test_client_disconnect_aborts_in_worker(served):
    gw, worker = served
    worker.reply = cyclic_reply("abc")
    worker.step_s = 0.01
    with httpx.stream("POST", gw.url + "/v1/completions", timeout=10, json={
            "prompt": "x", "max_tokens": 4000, "stream": True}) as r:
        lines = r.iter_lines()
        next(x for x in lines if x.startswith("data: {"))
        rid = worker.submits[0].request_id
    # Leaving the block closed the connection mid-stream.
    assert wait_until(lambda: rid in worker.aborts, 3)
    assert wait_until(lambda: rid not in worker.streams, 3)  # a step or so later
    assert_no_leaks(gw)


def test_client_disconnect_while_non_stream_aborts(served):
    gw, worker = served
    worker.reply = cyclic_reply("abc")
    worker.step_s = 0.01
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4000},
                   timeout=0.3)
    rid = worker.submits[0].request_id
    assert wait_until(lambda: rid in worker.aborts, 3)
    assert_no_leaks(gw)


@pytest.mark.slow
def test_slow_reader_stops_credit_then_is_aborted():
    with GatewayServer(credit_window=16, slow_client_timeout_s=1.5,
                       max_tokens_limit=1_000_000) as gw:
        worker = gw.worker(reply=cyclic_reply("x" * 50), tokens_per_step=16,
                           step_s=0.001, max_model_len=10_000_000).start()
        assert worker.ready.wait(5)
        sock = raw_completion(gw.port, {"prompt": "x", "max_tokens": 1_000_000, "stream": True},
                              rcvbuf=4096)
        rid = gw.shrink_the_stream(worker)
        # The client reads nothing: the socket fills, credit stops, the worker pauses.
        def stalled():
            before = worker.num_sent.get(rid, 0)
            time.sleep(0.3)
            return before > 0 and worker.num_sent.get(rid, 0) == before
        assert wait_until(stalled, 20)
        stalled_at = worker.num_sent[rid]
        assert worker.max_outstanding[rid] <= 16
        assert stalled_at < 1_000_000
        # ... and after slow_client_timeout_s the gateway aborts it in the worker.
        assert wait_until(lambda: rid in worker.aborts, 10)
        assert_no_leaks(gw)
        # The tail of what the client finally reads is the error event.
        sock.settimeout(5)
        data = b""
        while True:
            try:
                chunk = sock.recv(1 << 20)
            except TimeoutError:
                break
            if not chunk:
                break
            data += chunk
        sock.close()
        assert b'"code":"slow_client"' in data[-2000:]
        worker.stop()


def test_openai_sdk_parses_our_responses(served):
    openai = pytest.importorskip("openai")
    gw, _ = served
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=100)
    assert chat.choices[0].message.content == REPLY
    assert chat.usage.completion_tokens == len(REPLY.encode())
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=100,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert chunks[-1].usage.completion_tokens == len(REPLY.encode())
    completion = client.completions.create(model=MODEL, prompt="x", max_tokens=100,
                                           stream=True)
    assert "".join(c.choices[0].text for c in completion) == REPLY
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=9)
    assert e.value.body["param"] == "temperature"


def test_streaming_n_choices_interleave_and_each_finishes(served):
    gw, _ = served
    evs = post_stream(gw, "/v1/completions", {
        "prompt": ["a", "b"], "n": 2, "max_tokens": 100, "stream": True,
        "stream_options": {"include_usage": True}})
    assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1
    texts, finishes = {}, {}
    for c in evs[:-2]:
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {i: REPLY for i in range(4)}
    assert finishes == {i: "stop" for i in range(4)}
    assert evs[-2]["usage"]["completion_tokens"] == 4 * len(REPLY.encode())
    assert_no_leaks(gw)


def test_cached_tokens_count_each_prompt_once_with_n_choices(served):
    gw, worker = served
    worker.is_prefix_caching = True  # a prompt seen before is cached whole
    body = {"prompt": ["a cold start", "another"], "n": 3, "max_tokens": 4}
    first = httpx.post(gw.url + "/v1/completions", json=body).json()["usage"]
    # each prompt's first choice computed it (the other two found it cached)
    assert first.get("prompt_tokens_details", {"cached_tokens": 0})["cached_tokens"] == 0
    again = httpx.post(gw.url + "/v1/completions", json=body).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"]
