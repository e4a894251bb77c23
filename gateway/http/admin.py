"""The admin API: operators list, drain, undrain and restart workers (`zeroserve workers ...`).

    GET  /admin/workers                       every worker, its status, load and incarnation
    POST /admin/workers/{id}/drain            {"deadline_s": 30}: no new work; streams finish
                                              or, at the deadline, move to another worker
    POST /admin/workers/{id}/undrain          take new work again
    POST /admin/workers/{id}/restart          {"deadline_s": 30}: drain, then the worker exits
                                              0 and its supervisor (serve, compose, k8s) starts
                                              it again; it comes back with a new incarnation
    POST /admin/workers/{id}/exited           {"pid": 1234, "exit_code": -9}: that process of
                                              the worker exited (`serve`'s supervisor reaped
                                              it): lost at once, its streams move on; ignored
                                              unless `pid` is the process registered now
    GET  /admin/models                        served models, their versions and workers, and
                                              the aliases with their weights
    POST /admin/models/{alias}/weights        {"weights": {"smollm@v1": 90, "smollm@v2": 10}}:
                                              an alias's weights from now on (a new alias too),
                                              in every gateway of the tier (workers/alias_file.py)
    GET  /admin/classes                       the queue's policy and priority classes: share,
                                              queue fraction, requests queued and shed
    POST /admin/classes/{name}/share          {"share": 2}: a class's share of the queue's
                                              service from now on (this gateway), kept across
                                              its restart until the limits file changes that
                                              class's share (gateway/class_shares.py)

Who may call it: gateway/http/admin_access.py (an admin key; keyless only from this machine,
with the admin token where API keys are set; never a web page).
"""

from __future__ import annotations

import json
import math
import os
import signal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from zeroserve.common.logging_setup import RateLimited, printable
from zeroserve.gateway.admission import Admission
from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.core import Gateway
from zeroserve.gateway.errors import APIError, invalid_request
from zeroserve.gateway.http.admin_access import AdminAccess
from zeroserve.gateway.http.error_response import error_response
from zeroserve.gateway.logging import get_logger
from zeroserve.gateway.priority_classes import PriorityConfigError, check_share
from zeroserve.gateway.workers.models import alias_from_weights

log = get_logger("admin")

DEFAULT_DEADLINE_S = 30.0
MAX_DEADLINE_S = 3600.0
_MAX_BODY_BYTES = 4096


class AdminApi:
    def __init__(self, config: GatewayConfig, gateway: Gateway):
        self.gateway = gateway
        self.access = AdminAccess(config, log)
        self._warn = RateLimited()

    def routes(self) -> list[Route]:
        return [
            Route("/admin/workers", self.list_workers, methods=["GET"]),
            Route("/admin/workers/{worker_id}/drain", self.drain, methods=["POST"]),
            Route("/admin/workers/{worker_id}/undrain", self.undrain, methods=["POST"]),
            Route("/admin/workers/{worker_id}/restart", self.restart, methods=["POST"]),
            Route("/admin/workers/{worker_id}/exited", self.exited, methods=["POST"]),
            Route("/admin/models", self.list_models, methods=["GET"]),
            Route("/admin/models/{alias}/weights", self.set_weights, methods=["POST"]),
            Route("/admin/classes", self.list_classes, methods=["GET"]),
            Route("/admin/classes/{name}/share", self.set_share, methods=["POST"]),
        ]

    # --- endpoints ---------------------------------------------------------------------

    async def list_workers(self, request: Request) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return error_response(refusal)
        workers = [w.describe() for w in self.gateway.registry.workers.values()]
        return JSONResponse({"workers": sorted(workers, key=lambda w: w["worker_id"])})

    async def list_models(self, request: Request) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return error_response(refusal)
        workers = [(w.model, w.version, w.worker_id, w.status.value)
                   for w in self.gateway.registry.workers.values()]
        return JSONResponse(self.gateway.models.describe(workers))

    async def set_weights(self, request: Request) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return error_response(refusal)
        name = request.path_params["alias"]
        try:
            body = json_object_body(await request.body())
            alias = self.gateway.models.set_alias(alias_from_weights(name, body.get("weights")))
        except APIError as e:
            return error_response(e)
        except ValueError as e:
            return error_response(invalid_request(str(e), param="weights"))
        except OSError as e:  # nothing changed, here or in the file
            log.error("could not share alias weights", extra={"error": str(e)})
            return error_response(APIError(500, f"The weights could not be written to the "
                                                f"tier's aliases file: {e}", type="server_error"))
        log.info("alias weights set", extra={"alias": printable(name),
                                             "weights": alias.describe()["weights"]})
        return JSONResponse(alias.describe())

    async def list_classes(self, request: Request) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return error_response(refusal)
        return JSONResponse(describe_classes(self.gateway.admission))

    async def set_share(self, request: Request) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return error_response(refusal)
        name = request.path_params["name"]
        admission = self.gateway.admission
        try:
            share = json_object_body(await request.body()).get("share")
            check_share(share, "share")
        except APIError as e:
            return error_response(e)
        except PriorityConfigError as e:
            return error_response(invalid_request(str(e), param="share"))
        if not admission.set_share(name, float(share)):
            return error_response(APIError(
                404, f"No priority class {printable(name)!r}; the classes are "
                     f"{', '.join(admission.classes.names)}.", code="class_not_found"))
        is_kept = self.gateway.class_shares.record(name, float(share))
        log.info("class share set", extra={"priority_class": name, "share": float(share),
                                           "is_kept": is_kept})
        return JSONResponse({**describe_classes(admission), "kept_across_restart": is_kept})

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

    async def exited(self, request: Request) -> Response:
        """A worker's process exited: its supervisor says so the moment it reaps it
        (cli/supervisor.py), long before the worker's heartbeats would lapse. The gateway
        takes that process out and fails its streams over, only if it is the one registered
        under the id now (a notice about an older incarnation does not remove its
        successor). 200 either way, naming this gateway's pid: `serve --gateways N` tells
        each of the gateways sharing the port."""
        refusal = self._refusal(request)
        if refusal is not None:
            return error_response(refusal)
        worker_id = request.path_params["worker_id"]
        try:
            pid, exit_code = exit_fields(json_object_body(await request.body()))
        except APIError as e:
            return error_response(e)
        is_removed = self.gateway.worker_exited(worker_id, pid, describe_exit(exit_code))
        return JSONResponse({"worker_id": worker_id, "action": "exited", "pid": pid,
                             "exit_code": exit_code, "removed": is_removed,
                             "gateway_pid": os.getpid()})

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

    def refusal(self, request: Request) -> APIError | None:
        """Why this caller may not use an admin route (None: it may); for the admin routes
        of other modules too (gateway/http/debug.py)."""
        return self._refusal(request)

    def _refusal(self, request: Request) -> APIError | None:
        refusal = self.access.refusal(request)
        num_held = None if refusal is None else self._warn.allow(refusal.code or "")
        if num_held is not None:  # a flood of refusals must not flood the log
            log.warning("refused an admin call (%s)", refusal.code, extra={
                "path": printable(request.url.path), "num_refused_since_last_line": num_held,
                "client": None if request.client is None else request.client.host})
        return refusal


def json_object_body(raw: bytes, allow_empty: bool = False) -> dict:
    """An admin call's body: a JSON object of at most 4 KiB (413, 400 otherwise); with
    `allow_empty`, a blank body is {}."""
    if len(raw) > _MAX_BODY_BYTES:
        raise APIError(413, "The request body is too large.", code="request_too_large")
    if allow_empty and not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise invalid_request("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body


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


_MAX_PID = 2**22  # Linux's pid_max at most


def exit_fields(body: dict) -> tuple[int, int | None]:
    """An exit notice's process id and exit code (Popen's: -N for death by signal N; absent:
    None)."""
    pid, code = body.get("pid"), body.get("exit_code")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= _MAX_PID:
        raise invalid_request(f"'pid' must be an integer in [1, {_MAX_PID}].", param="pid")
    if code is not None and (isinstance(code, bool) or not isinstance(code, int)
                             or not -128 <= code <= 255):
        raise invalid_request("'exit_code' must be an integer in [-128, 255] (-N: killed by "
                              "signal N).", param="exit_code")
    return pid, code


def describe_exit(exit_code: int | None) -> str:
    """How the worker's process ended, as the loss's reason: 'exited (killed by SIGKILL)'."""
    if exit_code is None:
        return "exited"
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        return f"exited (killed by {name})"
    return f"exited (exit code {exit_code})"


def describe_classes(admission: Admission) -> dict:
    """The queue's policy and classes, most important first (also the console's view)."""
    shares = admission.shares()
    classes = []
    for rank, c in enumerate(admission.classes.classes):
        figures = admission.stats.by_class[rank]
        classes.append({"name": c.name, "share": shares[c.name],
                        "queue_fraction": c.queue_fraction,
                        "default": rank == admission.classes.default_rank,
                        "num_queued": figures.num_queued, "num_shed": figures.num_shed,
                        "num_served_from_queue": figures.num_served})
    return {"policy": "fair" if admission.is_fair else "fcfs",
            "max_queued": admission.max_queued, "classes": classes}


def _unknown_worker(worker_id: str) -> APIError:
    return APIError(404, f"No worker with id {worker_id!r} is connected.",
                    code="worker_not_found")

