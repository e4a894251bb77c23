"""The client side of the gateway's admin API, for `zeroserve workers ...` (plain urllib, so
the CLI stays light; works against any gateway URL).

To a gateway it reaches by a loopback address it also sends this user's admin token
(common/admin_token.py), so an operator on the gateway's machine needs no admin key where
API keys are set; the token never goes to another machine."""

from __future__ import annotations

import ipaddress
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from zeroserve.common.admin_token import TOKEN_HEADER, read_token


class AdminError(RuntimeError):
    """The gateway said no (or did not answer); the message is for the operator."""


@dataclass(frozen=True)
class AdminClient:
    url: str  # the gateway's base URL
    key: str | None = None
    timeout_s: float = 10.0

    def workers(self) -> list[dict]:
        return self._call("GET", "/admin/workers")["workers"]

    def drain(self, worker_id: str, deadline_s: float) -> dict:
        return self._call("POST", f"/admin/workers/{worker_id}/drain", {"deadline_s": deadline_s})

    def undrain(self, worker_id: str) -> dict:
        return self._call("POST", f"/admin/workers/{worker_id}/undrain")

    def restart(self, worker_id: str, deadline_s: float) -> dict:
        return self._call("POST", f"/admin/workers/{worker_id}/restart",
                          {"deadline_s": deadline_s})

    def worker_exited(self, worker_id: str, pid: int, exit_code: int) -> dict:
        return self._call("POST",
                          f"/admin/workers/{urllib.parse.quote(worker_id, safe='')}/exited",
                          {"pid": pid, "exit_code": exit_code})

    def models(self) -> dict:
        return self._call("GET", "/admin/models")

    def set_weights(self, alias: str, weights: dict[str, float]) -> dict:
        return self._call("POST", f"/admin/models/{urllib.parse.quote(alias, safe='')}/weights",
                          {"weights": weights})

    def classes(self) -> dict:
        return self._call("GET", "/admin/classes")

    def set_share(self, name: str, share: float) -> dict:
        return self._call("POST", f"/admin/classes/{urllib.parse.quote(name, safe='')}/share",
                          {"share": share})

    def debug(self, kind: str, worker_id: str | None, args: dict,
              wait_s: float = 0.0) -> dict:
        """A live look inside the gateway (no worker) or a worker: `kind` is stacks,
        profile, memory or torch-profile (gateway/http/debug.py); `wait_s`: how long the
        call itself runs (a profile's seconds), added to the timeout."""
        timeout_s = self.timeout_s + wait_s + 60.0
        if kind == "stacks":
            query = "" if worker_id is None else "?" + urllib.parse.urlencode(
                {"worker": worker_id})
            return self._call("GET", "/admin/debug/stacks" + query, timeout_s=timeout_s)
        body = dict(args) if worker_id is None else {**args, "worker": worker_id}
        return self._call("POST", f"/admin/debug/{kind}", body, timeout_s=timeout_s)

    def _call(self, method: str, path: str, body: dict | None = None,
              timeout_s: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url.rstrip("/") + path, data=data, method=method)
        request.add_header("content-type", "application/json")
        if self.key:
            request.add_header("authorization", f"Bearer {self.key}")
        token = read_token() if _is_loopback_url(self.url) else None
        if token is not None:
            request.add_header(TOKEN_HEADER, token)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = e.reason
            raise AdminError(f"{method} {path}: {e.code} {message}") from None
        except OSError as e:
            raise AdminError(f"{self.url} does not answer: {e}") from None


def _is_loopback_url(url: str) -> bool:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def wait_restarted(client: AdminClient, worker_id: str, old_incarnation: str,
                   timeout_s: float, poll_s: float = 0.25) -> float:
    """Wait until `worker_id` is ready again as a new process; the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            for worker in client.workers():
                if (worker["worker_id"] == worker_id and worker["status"] == "ready"
                        and worker["incarnation"] != old_incarnation):
                    return time.monotonic() - started
        except AdminError:
            pass  # the gateway may be busy; keep asking until the timeout
        time.sleep(poll_s)
    raise AdminError(f"{worker_id} was not ready again within {timeout_s:g}s")


def restart(client: AdminClient, worker_id: str, deadline_s: float, timeout_s: float,
            say: Callable[[str], None]) -> float:
    """Restart one worker and wait until it is ready again as a new process (its drain
    deadline plus `timeout_s` at most); the seconds it took."""
    incarnation = _incarnation(client, worker_id)
    client.restart(worker_id, deadline_s)
    say(f"{worker_id}: draining (deadline {deadline_s:g}s), restarting ...")
    took = wait_restarted(client, worker_id, incarnation, deadline_s + timeout_s)
    say(f"{worker_id}: ready again after {took:.1f}s")
    return took


def rolling_restart(client: AdminClient, deadline_s: float, timeout_s: float,
                    say: Callable[[str], None]) -> list[str]:
    """Restart every worker, one at a time: the next only once the last is ready again.
    Returns the ids restarted; raises AdminError at the first one that does not come back."""
    ids = sorted(w["worker_id"] for w in client.workers())
    if not ids:
        raise AdminError("no worker is connected")
    for worker_id in ids:
        restart(client, worker_id, deadline_s, timeout_s, say)
    return ids


def _incarnation(client: AdminClient, worker_id: str) -> str:
    for worker in client.workers():
        if worker["worker_id"] == worker_id:
            return worker["incarnation"]
    raise AdminError(f"no worker with id {worker_id!r} is connected")
