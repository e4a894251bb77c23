"""CurveZMQ key sets for the worker plane (the ZeroMQ guide's "Ironhouse" pattern).

A key directory holds ZeroMQ certificate files (`zmq.auth`'s format: a public `NAME.key` and
a secret `NAME.key_secret`, Z85 text with metadata):

    DIR/gateway.key, DIR/gateway.key_secret        the gateway's pair
    DIR/workers/ID.key, DIR/workers/ID.key_secret  one pair per worker id

The gateway loads its own pair and every worker's public key, each bound to the worker id it
was issued for (the `worker-id` metadata of the certificate). A worker loads its own pair
and the gateway's public key: that is all a worker host needs.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

GATEWAY_NAME = "gateway"
WORKERS_DIR = "workers"
_WORKER_ID_META = "worker-id"
# Worker ids become file names: keep them to a safe alphabet.
_WORKER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class KeySetError(ValueError):
    """A key directory that is missing, incomplete, malformed or too open."""


class InsecurePlaneError(ValueError):
    """A worker-plane endpoint that anyone could speak on."""


def check_plane_security(addresses: tuple[str, ...], keys_dir: str | None,
                         insecure: bool) -> None:
    """tcp:// is open to the network: without keys, refuse unless told --insecure."""
    open_addresses = [a for a in addresses if not a.startswith(("ipc://", "inproc://"))]
    if keys_dir is None and not insecure and open_addresses:
        raise InsecurePlaneError(
            f"{', '.join(open_addresses)}: a tcp:// endpoint needs CurveZMQ keys (--keys-dir, "
            "made by `zeroserve keys generate DIR`); pass --insecure to run without them on "
            "a network you trust")


@dataclass(frozen=True)
class CurvePair:
    public: bytes  # Z85, 40 bytes
    secret: bytes


@dataclass(frozen=True)
class GatewayKeys:
    own: CurvePair
    workers: dict[bytes, str]  # a worker's public key (Z85) -> the worker id it may use


@dataclass(frozen=True)
class WorkerKeys:
    own: CurvePair
    gateway_public: bytes


def is_worker_id_valid(worker_id: str) -> bool:
    return bool(_WORKER_ID.match(worker_id))


def generate(key_dir: str | Path, worker_ids: list[str]) -> Path:
    """Write a gateway pair and one pair per worker id (existing files are replaced)."""
    key_dir = Path(key_dir)
    for worker_id in worker_ids:
        if not is_worker_id_valid(worker_id):
            raise KeySetError(f"worker id {worker_id!r}: use letters, digits, '.', '_', '-'")
    workers = key_dir / WORKERS_DIR
    workers.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(key_dir, 0o700)
    zmq.auth.create_certificates(key_dir, GATEWAY_NAME)
    for worker_id in worker_ids:
        zmq.auth.create_certificates(workers, worker_id, metadata={_WORKER_ID_META: worker_id})
    for path in [*key_dir.glob("*.key_secret"), *workers.glob("*.key_secret")]:
        os.chmod(path, 0o600)
    return key_dir


def ephemeral(worker_ids: list[str]) -> Path:
    """A fresh key set in a private temporary directory (the caller removes it)."""
    return generate(tempfile.mkdtemp(prefix="zeroserve-keys-"), worker_ids)


def remove(key_dir: Path) -> None:
    shutil.rmtree(key_dir, ignore_errors=True)


def load_gateway_keys(key_dir: str | Path) -> GatewayKeys:
    key_dir = Path(key_dir)
    own = _load_pair(key_dir / f"{GATEWAY_NAME}.key_secret")
    workers: dict[bytes, str] = {}
    for path in sorted((key_dir / WORKERS_DIR).glob("*.key")):
        public, _ = _load(path)
        worker_id = _worker_id_of(path)
        workers[public] = worker_id
    if not workers:
        raise KeySetError(f"{key_dir / WORKERS_DIR} holds no worker public keys (*.key)")
    return GatewayKeys(own, workers)


def load_worker_keys(key_dir: str | Path, worker_id: str) -> WorkerKeys:
    key_dir = Path(key_dir)
    gateway_public, _ = _load(key_dir / f"{GATEWAY_NAME}.key")
    own = _load_pair(key_dir / WORKERS_DIR / f"{worker_id}.key_secret")
    return WorkerKeys(own, gateway_public)


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeySetError(f"missing key file {path} (make a key set with `zeroserve keys "
                        "generate DIR`)")
    try:
        return zmq.auth.load_certificate(path)
    except (ValueError, OSError) as e:
        raise KeySetError(f"{path}: not a ZeroMQ certificate: {e}") from None


def _load_pair(secret_path: Path) -> CurvePair:
    if secret_path.exists() and secret_path.stat().st_mode & 0o077:
        raise KeySetError(f"{secret_path} is readable by others: chmod 600 it")
    public, secret = _load(secret_path)
    if secret is None:
        raise KeySetError(f"{secret_path} holds no secret key")
    return CurvePair(public, secret)


def _worker_id_of(public_path: Path) -> str:
    """The id a worker certificate was issued for: its metadata, else its file name."""
    text = public_path.read_text(errors="replace")
    match = re.search(rf'^\s*{_WORKER_ID_META}\s*=\s*"([^"]*)"', text, re.MULTILINE)
    worker_id = match.group(1) if match else public_path.stem
    if not is_worker_id_valid(worker_id):
        raise KeySetError(f"{public_path}: bad worker id {worker_id!r}")
    return worker_id


def curve_server(socket: zmq.Socket, keys: GatewayKeys, domain: bytes) -> None:
    """Make `socket` a CURVE server whose peers the ZAP handler of `domain` vets."""
    socket.curve_server = True
    socket.curve_secretkey = keys.own.secret
    socket.curve_publickey = keys.own.public
    socket.zap_domain = domain
    # Fail closed: with no ZAP handler listening (it died, or never bound), libzmq would
    # otherwise let any peer that knows our public key complete the handshake.
    socket.zap_enforce_domain = True


def curve_client(socket: zmq.Socket, keys: WorkerKeys) -> None:
    socket.curve_serverkey = keys.gateway_public
    socket.curve_publickey = keys.own.public
    socket.curve_secretkey = keys.own.secret
