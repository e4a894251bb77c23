"""The weight cache: prepared weights written once, memory-mapped on every later start.

Parsing a GGUF file, dequantizing it and building the fused, converted and packed tensors
(worker.model.prepare) takes seconds; mapping the result takes milliseconds, and on the CPU
every worker that maps the same file shares its pages. One file per (model path, dtype,
device kind, packing): `<dir>/<model>-<hash>.pt`, a torch zip archive loaded with
`torch.load(mmap=True, weights_only=True)` (no code runs on load).

Safe by construction:
- Written to a temporary file, fsynced and renamed into place: a reader sees a whole file
  or none. A writer killed half-way leaves a temporary file that the next writer removes.
- The file records its key: format version, the model files' sizes, mtimes and a hash of
  their first and last 64 KiB, dtype, device kind, packing, torch and gguf versions. Any
  difference (a changed model file, another torch) is a miss, and the entry is rebuilt.
- Every tensor's CRC-32 is recorded and checked on load; a file that does not load (cut
  short) or fails a check is reported and rebuilt, never used.
- Workers starting together take a lock (flock, released by the kernel if a holder dies)
  around build-and-write, so one builds and the others map its result.
- Any cache failure (read-only directory, full disk) is logged and the worker starts
  without the cache: the cache can make a start faster, never make it fail.

Bump FORMAT_VERSION whenever worker.model.prepare or the tensors' meaning changes.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from zeroserve.worker.model.llama_config import LlamaConfig
from zeroserve.worker.model.weights import PreparedWeights

logger = logging.getLogger(__name__)

# 2: architectures (biases, q/k norms, rope_freqs, windows in the config); 3: fp32 keeps the
# file's Q4/Q8_0 blocks for the native kernels; 4: those blocks in panels of 16 features;
# 5: each panel's blocks one uint8 tensor, scales in fp16 where exact.
FORMAT_VERSION = 5
_PROBE_BYTES = 64 << 10  # hashed from each end of every model file
_LOCK_TIMEOUT_S = 600.0  # then build without the lock (the rename keeps it safe anyway)


def default_directory() -> Path:
    """$ZEROSERVE_CACHE_DIR/weights, else $XDG_CACHE_HOME/zeroserve/weights, else
    ~/.cache/zeroserve/weights."""
    root = os.environ.get("ZEROSERVE_CACHE_DIR")
    if root:
        return Path(root) / "weights"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "zeroserve" / "weights"


def _model_files(model_path: Path) -> list[Path]:
    if model_path.is_dir():
        return sorted(p for p in model_path.iterdir()
                      if p.is_file() and p.suffix in (".safetensors", ".json"))
    return [model_path]


def _fingerprint(path: Path) -> list:
    """[name, size, mtime_ns, sha256 of the first and last 64 KiB]: a changed file shows
    even if an edit kept its size and mtime (GGUF and safetensors headers lead the file)."""
    stat = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_PROBE_BYTES))
        if stat.st_size > _PROBE_BYTES:
            f.seek(max(_PROBE_BYTES, stat.st_size - _PROBE_BYTES))
            digest.update(f.read(_PROBE_BYTES))
    return [path.name, stat.st_size, stat.st_mtime_ns, digest.hexdigest()]


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "none"


def _crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy())


class WeightCache:
    def __init__(self, directory: Path | str):
        self.directory = Path(directory)

    def entry(self, model_path: Path, dtype: torch.dtype, device: torch.device,
              pack: str) -> CacheEntry:
        model_path = model_path.resolve()
        slot = {"model": str(model_path), "dtype": str(dtype), "device": device.type,
                "pack": pack}
        key = {**slot, "format": FORMAT_VERSION,
               "files": [_fingerprint(p) for p in _model_files(model_path)],
               "torch": str(torch.__version__), "gguf": _gguf_version()}
        # The file name leaves out what changes with an update (model file, versions), so a
        # rebuild replaces the stale file instead of leaving it behind.
        digest = hashlib.sha256(json.dumps(slot, sort_keys=True).encode()).hexdigest()[:16]
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", model_path.stem)[:64]
        return CacheEntry(self.directory / f"{stem}-{digest}.pt", key)


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    path: Path
    key: dict

    def load(self) -> PreparedWeights | None:
        """The cached weights (memory-mapped), or None: missing, stale or damaged (the
        caller rebuilds it)."""
        try:
            data = torch.load(self.path, mmap=True, weights_only=True, map_location="cpu")
        except FileNotFoundError:
            return None
        except OSError as exc:  # an unusable directory: the caller builds without the cache
            logger.warning("cannot read the weight cache %s (%s)", self.path, exc)
            return None
        except Exception as exc:  # a cut-short or garbled archive: zip, pickle or size errors
            return self._discard(f"unreadable ({type(exc).__name__}: {exc})")
        if not isinstance(data, dict) or data.get("key") != self.key:
            logger.info("weight cache %s is stale (model file, version or settings changed); "
                        "rebuilding", self.path)
            return None
        try:
            tensors = data["tensors"]
            checksums = data["checksums"]
            if tensors.keys() != checksums.keys():
                return self._discard("tensor list does not match its checksums")
            # zlib releases the GIL: a few threads read the file's pages in parallel.
            with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
                crcs = pool.map(_crc, tensors.values())
                for name, crc in zip(tensors, crcs, strict=True):
                    if crc != checksums[name]:
                        return self._discard(f"checksum mismatch in {name}")
            return PreparedWeights(
                config=LlamaConfig(**data["config"]), tensors=tensors,
                eos_token_ids=tuple(data["eos_token_ids"]), bos_token_id=data["bos_token_id"],
            )
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
            return self._discard(f"malformed ({type(exc).__name__}: {exc})")

    def store(self, prepared: PreparedWeights) -> None:
        """Write atomically; a failure is logged, never raised."""
        # A tensor that is a view saves its whole storage: clone those to save only the view.
        tensors = {name: t if t.untyped_storage().nbytes() == t.nbytes else t.clone()
                   for name, t in prepared.tensors.items()}
        payload = {
            "key": self.key,
            "config": dataclasses.asdict(prepared.config),
            "eos_token_ids": list(prepared.eos_token_ids),
            "bos_token_id": prepared.bos_token_id,
            "tensors": tensors,
            "checksums": {name: _crc(t) for name, t in tensors.items()},
        }
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(tmp, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            _fsync_directory(self.path.parent)
        except (OSError, RuntimeError) as exc:  # torch's zip writer raises RuntimeError
            logger.warning("could not write the weight cache %s (%s); later starts will "
                           "rebuild the weights", self.path, exc)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Held while building and writing this entry: a second worker starting now waits
        and then maps the first one's file instead of building it too."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path.with_name(self.path.name + ".lock"),
                         os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            logger.warning("weight cache lock unavailable (%s); building without it", exc)
            yield
            return
        try:
            if _flock(fd, _LOCK_TIMEOUT_S):
                self._remove_abandoned_temporaries()
            else:
                logger.warning("weight cache %s still locked after %.0f s; building without "
                               "the lock", self.path, _LOCK_TIMEOUT_S)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _remove_abandoned_temporaries(self) -> None:
        """Under the lock, another writer's temporary file is one whose writer died."""
        for tmp in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            tmp.unlink(missing_ok=True)

    def _discard(self, reason: str) -> None:
        # Not removed here: another worker may be renaming a good file into place right now.
        # The rebuild's rename replaces it.
        logger.warning("weight cache %s is damaged (%s); rebuilding it", self.path, reason)
        return None


def _flock(fd: int, timeout_s: float) -> bool:
    """Take an exclusive flock on fd, waiting up to timeout_s; False if it stayed taken."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (a crash right after must not lose the new name)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
