"""Request tracing through OpenTelemetry (`--otlp-traces-endpoint`, as vLLM names it).

One trace per engine request: a root span `llm_request` from the request's arrival at the
gateway to its finish, with three children in order: `queue` (the gateway's queue, then the
worker's), `prefill` (from the first scheduling on a worker to the first token, as that
worker measured it) and `decode` (first token to finish). The phases are built when the
request ends, from the times the gateway already keeps for its metrics; nothing is done per
token. A `traceparent` header on the HTTP request makes the trace a child of the caller's.

The SDK is optional (`pip install 'zeroserve[tracing]'`): only this module imports it, and
only when tracing is asked for. Spans leave through the SDK's batch processor, off the event
loop, so a slow or absent collector costs the gateway nothing but dropped spans.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

TRACE_HEADERS = ("traceparent", "tracestate")


class TracedChoice(Protocol):
    """What a span reads of one choice (gateway/generation.py's Choice)."""

    index: int
    num_prompt_tokens: int
    num_output_tokens: int
    created_at: float
    first_output_at: float
    queue_s: float
    prefill_s: float
    finish_reason: str | None

    @property
    def has_output(self) -> bool: ...


class TracingUnavailableError(RuntimeError):
    """--otlp-traces-endpoint was given but the OpenTelemetry packages are missing."""


def _require_sdk() -> None:
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise TracingUnavailableError(
            "--otlp-traces-endpoint needs the OpenTelemetry SDK: "
            "pip install 'zeroserve[tracing]'") from e


def otlp_exporter(endpoint: str):
    """An OTLP span exporter for `endpoint`: http(s)://host:4318[/v1/traces] speaks
    OTLP/HTTP (protobuf), grpc://host:4317 (or host:port) speaks OTLP/gRPC."""
    _require_sdk()
    if endpoint.startswith(("http://", "https://")):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else (
            endpoint.rstrip("/") + "/v1/traces")
        return OTLPSpanExporter(endpoint=url)
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )
    except ImportError as e:
        raise TracingUnavailableError(
            f"{endpoint!r} asks for OTLP over gRPC, which needs "
            "opentelemetry-exporter-otlp-proto-grpc; or give an http:// endpoint") from e
    target = endpoint.removeprefix("grpc://")
    return GrpcExporter(endpoint=target, insecure=not endpoint.startswith("grpcs://"))


class RequestTracer:
    """Turns finished requests into spans. `exporter` is any SDK SpanExporter (tests pass
    the in-memory one); `batch` picks the batch processor (the service) or the simple one."""

    def __init__(self, exporter, service_name: str = "zeroserve", model_name: str = "",
                 batch: bool = True, clock=time.monotonic):
        _require_sdk()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("zeroserve.gateway")
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER
        self._error_status = lambda message: Status(StatusCode.ERROR, message)
        self._set_span_in_context = set_span_in_context
        self.model_name = model_name
        self.clock = clock

    @classmethod
    def for_endpoint(cls, endpoint: str, model_name: str = "") -> RequestTracer:
        return cls(otlp_exporter(endpoint), model_name=model_name)

    def _to_ns(self, t: float, now: float, now_ns: int) -> int:
        """A gateway-clock time -> epoch nanoseconds (the clock is monotonic, spans are not)."""
        return now_ns - int((now - t) * 1e9)

    def record(self, choice: TracedChoice, request_id: str, worker_id: str | None,
               parent_headers: Mapping[str, str] | None, now: float,
               error: str | None = None, model: str | None = None,
               version: str | None = None) -> None:
        """One engine request ended (finished, or failed with `error`) at gateway time `now`;
        `model`, `version`: the served model and version that ran it."""
        now_ns = time.time_ns()

        def ns(t: float) -> int:
            return self._to_ns(t, now, now_ns)

        parent = self._propagator.extract(parent_headers) if parent_headers else None
        attributes = {
            "gen_ai.request.id": request_id,
            "gen_ai.response.model": model or self.model_name,
            "gen_ai.usage.prompt_tokens": choice.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": choice.num_output_tokens,
            "gen_ai.latency.e2e": now - choice.created_at,
            "zeroserve.choice_index": choice.index,
        }
        if worker_id is not None:
            attributes["zeroserve.worker_id"] = worker_id
        if version is not None:
            attributes["zeroserve.model_version"] = version
        if choice.finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = (choice.finish_reason,)
        has_output = choice.has_output
        if has_output:
            attributes.update({
                "gen_ai.latency.time_in_queue": choice.queue_s,
                "gen_ai.latency.time_to_first_token": choice.first_output_at - choice.created_at,
                "gen_ai.latency.time_in_model_prefill": choice.prefill_s,
                "gen_ai.latency.time_in_model_decode": now - choice.first_output_at,
            })
        root = self._tracer.start_span("llm_request", context=parent, kind=self._server_kind,
                                       attributes=attributes, start_time=ns(choice.created_at))
        if error is not None:
            root.set_status(self._error_status(error))
        context = self._set_span_in_context(root)
        phase_attrs = {} if worker_id is None else {"zeroserve.worker_id": worker_id}
        if has_output:
            # Queue and prefill end where the worker's measure of the prefill begins, so the
            # three phases tile the request without gaps or overlaps.
            prefill_start = max(choice.created_at, choice.first_output_at - choice.prefill_s)
            phases = (("queue", choice.created_at, prefill_start),
                      ("prefill", prefill_start, choice.first_output_at),
                      ("decode", choice.first_output_at, now))
        else:
            phases = (("queue", choice.created_at, now),)
        for name, start, end in phases:
            span = self._tracer.start_span(name, context=context, attributes=phase_attrs,
                                           start_time=ns(start))
            span.end(end_time=ns(end))
        root.end(end_time=ns(now))

    def shutdown(self) -> None:
        """Flush what is queued (bounded by the SDK's export timeout) and stop."""
        self._provider.shutdown()


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers of an HTTP request, if it has any."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None
