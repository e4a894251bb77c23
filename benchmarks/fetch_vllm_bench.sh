#!/usr/bin/env bash
# Fetch vLLM's serving benchmark client (`vllm-rs bench serve`, a static Rust binary inside
# the `vllm` wheel on PyPI) into .bench/vllm/, and save the default model's tokenizer as a
# directory at .bench/tokenizer (vllm-rs needs --tokenizer DIR). Used by
# benchmarks/crosscheck_vllm.py to check benchmarks/bench_serving.py against a client no one here
# wrote. Nothing is installed: the wheel is only unzipped.
#
#   benchmarks/fetch_vllm_bench.sh          # no-op when .bench/vllm/vllm-rs exists
#   VLLM_VERSION=0.33.0 benchmarks/fetch_vllm_bench.sh
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,/^set -euo/p' "$0" | grep '^#' | cut -c3-
    exit 0
fi
cd "$(dirname "$0")/.."
DIR=".bench/vllm"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$DIR"
if [[ ! -x "$DIR/vllm-rs" ]]; then
    spec="vllm"
    [[ -n "${VLLM_VERSION:-}" ]] && spec="vllm==$VLLM_VERSION"
    wheel="$(ls "$DIR"/vllm-*.whl 2>/dev/null | sort -V | tail -1 || true)"
    if [[ -z "$wheel" ]]; then
        "$PY" -m pip download --quiet --disable-pip-version-check --no-deps -d "$DIR" "$spec"
        wheel="$(ls "$DIR"/vllm-*.whl | sort -V | tail -1)"
    fi
    unzip -o -j -q "$wheel" vllm/vllm-rs -d "$DIR"
    chmod +x "$DIR/vllm-rs"
fi
"$DIR/vllm-rs" --version
# Writes .bench/tokenizer once (benchmarks/bench_data.py:load_tokenizer).
"$PY" -c "import sys; sys.path.insert(0, '.'); from benchmarks.bench_data import load_tokenizer; load_tokenizer()"
ls .bench/tokenizer
