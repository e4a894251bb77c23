"""The admin API: operators list, drain, undrain and restart workers (`zeroserve workers ...`).

    GET  /admin/workers                       every worker, its status, load and incarnation
    POST /admin/workers/{id}/drain            {"deadline_s": 30}: no new work; streams finish
                                              or, at the deadline, move to another worker
    POST /admin/workers/{id}/undrain          take new work again
    POST /admin/workers/{id}/restart          {"deadline_s": 30}: drain, then the worker exits
                                              0 and its supervisor (serve, compose, k8s) starts
                                              it again; it comes back with a new incarnation

Who may call it: `Authorization: Bearer KEY` with an admin key (`--admin-key`), or, when no
admin key is set, one of the API keys; with no key configured at all, only clients on the
loopback interface (a newcomer's `./scripts/serve`). Keys are compared in constant time.
"""

from __future__ import annotations

import json
import math

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.core import Gateway
from zeroserve.gateway.errors import APIError, invalid_request
from zeroserve.gateway.http.auth import ApiKeys, is_loopback_host
from zeroserve.gateway.http.error_response import error_response
from zeroserve.gateway.logging import get_logger

log = get_logger("admin")

DEFAULT_DEADLINE_S = 30.0
MAX_DEADLINE_S = 3600.0
_MAX_BODY_BYTES = 4096


class AdminApi:
    def __init__(self, config: GatewayConfig, gateway: Gateway):
        self.gateway = gateway
        self.keys = ApiKeys(tuple(config.admin_keys or config.api_keys))

    def routes(self) -> list[Route]:
        return [
            Route("/admin/workers", self.list_workers, methods=["GET"]),
            Route("/admin/workers/{worker_id}/drain", self.drain, methods=["POST"]),
            Route("/admin/workers/{worker_id}/undrain", self.undrain, methods=["POST"]),
            Route("/admin/workers/{worker_id}/restart", self.restart, methods=["POST"]),
        ]

    # --- endpoints ---------------------------------------------------------------------

    async def list_workers(self, request: Request) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return error_response(refusal)
        workers = [w.describe() for w in self.gateway.registry.workers.values()]
        return JSONResponse({"workers": sorted(workers, key=lambda w: w["worker_id"])})

    async def drain(self, request: Request) -> Response:
        return await self._drain(request, exit_when_drained=False)

    async def restart(self, request: Request) -> Response:
        return await self._drain(request, exit_when_drained=True)

    async def undrain(self, request: Request) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return error_response(refusal)
        worker_id = request.path_params["worker_id"]
        if not self.gateway.undrain_worker(worker_id):
            return error_response(_unknown_worker(worker_id))
        return JSONResponse({"worker_id": worker_id, "action": "undrain"})

    async def _drain(self, request: Request, exit_when_drained: bool) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return error_response(refusal)
        worker_id = request.path_params["worker_id"]
        try:
            deadline_s = _deadline(await request.body())
        except APIError as e:
            return error_response(e)
        if not self.gateway.drain_worker(worker_id, deadline_s, exit_when_drained):
            return error_response(_unknown_worker(worker_id))
        action = "restart" if exit_when_drained else "drain"
        return JSONResponse({"worker_id": worker_id, "action": action,
                             "deadline_s": deadline_s})

    # --- who may call --------------------------------------------------------------------

    def _refusal(self, request: Request) -> APIError | None:
        if not self.keys.is_enabled:
            if request.client is not None and is_loopback_host(request.client.host):
                return None
            return APIError(403, "The admin API answers only loopback clients unless an "
                                 "admin key is set (--admin-key).", type="permission_error",
                            code="admin_forbidden")
        if self.keys.match(request.headers.get("authorization")) is not None:
            return None
        log.warning("refused an admin call without a valid key",
                    extra={"path": request.url.path})
        return APIError(401, "A valid admin key is required (Authorization: Bearer KEY).",
                        type="authentication_error", code="invalid_admin_key",
                        headers={"WWW-Authenticate": "Bearer"})


def _deadline(raw: bytes) -> float:
    if not raw.strip():
        return DEFAULT_DEADLINE_S
    if len(raw) > _MAX_BODY_BYTES:
        raise APIError(413, "The request body is too large.", code="request_too_large")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise invalid_request("The request body is not valid JSON.") from None
    value = body.get("deadline_s", DEFAULT_DEADLINE_S) if isinstance(body, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value <= MAX_DEADLINE_S and math.isfinite(value)):
        raise invalid_request(f"'deadline_s' must be a number in [0, {MAX_DEADLINE_S:g}].",
                              param="deadline_s")
    return float(value)


def _unknown_worker(worker_id: str) -> APIError:
    return APIError(404, f"No worker with id {worker_id!r} is connected.",
                    code="worker_not_found")

