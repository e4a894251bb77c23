"""Health endpoints: liveness, readiness, and the detailed /health.

Orchestrators ask two different questions and act differently on the answers:

- **Liveness** (`GET /health/live`, also `/livez`): is this process able to serve HTTP at
  all? A failure gets the container killed and restarted, so it must stay 200 while the
  gateway runs, even with no worker ready (killing the gateway would not bring a worker).
- **Readiness** (`GET /health/ready`, also `/readyz`): should traffic come here now? 200
  only while at least one worker is ready, else 503; a load balancer stops routing but
  nothing is restarted.
- `GET /health` is the detailed view (workers, requests, event-loop lag) and answers as
  readiness does, as it always has.

`/livez` and `/readyz` are the names Kubernetes' own components use; `/health/live` and
`/health/ready` sit beside `/health`. All are cheap: no await on anything but the response.

All stay open when API keys are set (probes carry no key), but a caller without a valid key
learns only the status: no pid from /health/live, and /health answers as /health/ready
(no worker ids, pids, devices, models or load). `serve`'s supervisor and `zeroserve check`
send a key to see the rest.
"""

from __future__ import annotations

import os

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from zeroserve.gateway.core import Gateway
from zeroserve.gateway.http.auth import ApiKeys
from zeroserve.gateway.observability.loop_monitor import LoopLagMonitor
from zeroserve.gateway.workers.handle import WorkerStatus


class HealthEndpoints:
    def __init__(self, gateway: Gateway, loop_monitor: LoopLagMonitor,
                 keys: ApiKeys | None = None):
        self.gateway = gateway
        self.loop_monitor = loop_monitor
        self.keys = keys or ApiKeys(())
        self.pid = os.getpid()

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/health/live", self.live, methods=["GET"]),
            Route("/livez", self.live, methods=["GET"]),
            Route("/health/ready", self.ready, methods=["GET"]),
            Route("/readyz", self.ready, methods=["GET"]),
        ]

    async def live(self, request: Request) -> Response:
        # The pid tells `serve`'s supervisor that this is the gateway it started.
        if not self.keys.is_authorized(request):
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", "pid": self.pid})

    async def ready(self, request: Request) -> Response:
        registry = self.gateway.registry
        num_ready = sum(1 for w in registry.workers.values() if w.status is WorkerStatus.READY)
        return JSONResponse({"status": "ready" if num_ready else "unavailable",
                             "num_ready_workers": num_ready},
                            status_code=200 if num_ready else 503)

    async def health(self, request: Request) -> Response:
        if not self.keys.is_authorized(request):
            return await self.ready(request)
        registry = self.gateway.registry
        body = {"status": "ok" if registry.has_ready else "unavailable",
                "workers": [w.describe() for w in registry.workers.values()],
                # Expired for silence and not back: `serve` replaces such a local process.
                "lost_workers": [w.describe(self.gateway.clock())
                                 for w in registry.lost.values()],
                "num_requests": len(self.gateway.streams),
                "num_queued": self.gateway.admission.num_queued,
                "event_loop_lag": self.loop_monitor.describe()}
        return JSONResponse(body, status_code=200 if registry.has_ready else 503)
