"""Request tracing (--otlp-traces-endpoint): one span tree per request with its queue,
prefill and decode phases in order and the worker's id; the W3C parent is honoured; and the
OTLP/HTTP path delivers the spans to a collector."""

from __future__ import annotations

import http.server
import json
import threading

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.gateway.helpers import GatewayServer, cyclic_reply, free_port, wait_until
from zeroserve.gateway.observability.tracing import RequestTracer

MODEL = "SmolLM2-135M-Instruct"


def span_trees(exporter: InMemorySpanExporter) -> dict[int, dict[str, object]]:
    """trace id -> {span name: span}."""
    trees: dict[int, dict[str, object]] = {}
    for span in exporter.get_finished_spans():
        trees.setdefault(span.context.trace_id, {})[span.name] = span
    return trees


def test_each_request_gets_a_span_tree_with_its_phases_in_order():
    exporter = InMemorySpanExporter()
    with GatewayServer() as gw:
        gw.gateway.tracer = RequestTracer(exporter, model_name=MODEL, batch=False)
        worker = gw.worker(worker_id="w-trace", reply=cyclic_reply("ab"), step_s=0.01).start()
        assert worker.ready.wait(5)
        for stream in (False, True):
            r = httpx.post(gw.url + "/v1/completions", timeout=10, json={
                "prompt": "hello", "max_tokens": 6, "stream": stream, "n": 2})
            assert r.status_code == 200
        worker.stop()
    trees = span_trees(exporter)
    assert len(trees) == 4  # 2 requests x n=2: one trace per engine request
    for spans in trees.values():
        assert set(spans) == {"llm_request", "queue", "prefill", "decode"}
        root, queue, prefill, decode = (spans[n] for n in ("llm_request", "queue", "prefill",
                                                            "decode"))
        for phase in (queue, prefill, decode):
            assert phase.parent.span_id == root.context.span_id
            assert phase.attributes["zeroserve.worker_id"] == "w-trace"
        assert root.start_time == queue.start_time
        assert queue.end_time == prefill.start_time <= prefill.end_time == decode.start_time
        assert decode.end_time == root.end_time
        assert decode.end_time - decode.start_time > 0  # 6 tokens at 10 ms steps
        assert root.attributes["gen_ai.usage.completion_tokens"] == 6
        assert root.attributes["gen_ai.usage.prompt_tokens"] == 5
        assert root.attributes["gen_ai.response.finish_reasons"] == ("length",)
        assert root.attributes["gen_ai.response.model"] == MODEL
        assert root.status.is_ok


def test_a_traceparent_header_makes_the_request_a_child_of_the_callers_trace():
    exporter = InMemorySpanExporter()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with GatewayServer() as gw:
        gw.gateway.tracer = RequestTracer(exporter, batch=False)
        worker = gw.worker().start()
        assert worker.ready.wait(5)
        r = httpx.post(gw.url + "/v1/completions", timeout=10,
                       headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
                       json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
        worker.stop()
    (spans,) = span_trees(exporter).values()
    root = spans["llm_request"]
    assert f"{root.context.trace_id:032x}" == trace_id
    assert f"{root.parent.span_id:016x}" == "00f067aa0ba902b7"


def test_a_failed_request_is_traced_with_an_error_status():
    exporter = InMemorySpanExporter()
    with GatewayServer() as gw:
        gw.gateway.tracer = RequestTracer(exporter, batch=False)
        worker = gw.worker(num_submits_to_refuse=10).start()
        assert worker.ready.wait(5)
        r = httpx.post(gw.url + "/v1/completions", timeout=10,
                       json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code >= 400
        worker.stop()
    roots = [s["llm_request"] for s in span_trees(exporter).values()]
    assert len(roots) == 1 and not roots[0].status.is_ok


class _Collector(http.server.BaseHTTPRequestHandler):
    received: list[ExportTraceServiceRequest] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.path == "/v1/traces":
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            self.received.append(request)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def collector():
    _Collector.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Collector.received
    server.shutdown()


def test_the_otlp_endpoint_receives_the_spans(collector):
    url, received = collector
    with GatewayServer(otlp_traces_endpoint=url) as gw:
        worker = gw.worker().start()
        assert worker.ready.wait(5)
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=10, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        worker.stop()
    # Leaving the server flushed the batch processor.
    assert wait_until(lambda: received, 5)
    names = [span.name for request in received for resource in request.resource_spans
             for scope in resource.scope_spans for span in scope.spans]
    assert sorted(names) == ["decode", "llm_request", "prefill", "queue"]
    service = {a.key: a.value.string_value
               for a in received[0].resource_spans[0].resource.attributes}
    assert service["service.name"] == "zeroserve"


def test_no_metrics_means_no_metrics_endpoint_and_requests_still_work():
    with GatewayServer(disable_metrics=True) as gw:
        worker = gw.worker().start()
        assert worker.ready.wait(5)
        r = httpx.post(gw.url + "/v1/completions", timeout=10,
                       json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and json.loads(r.text)["usage"]["completion_tokens"] == 3
        assert httpx.get(gw.url + "/metrics").status_code == 404
        worker.stop()
