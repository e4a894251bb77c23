#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only) from the sources vendored in the
# llama-cpp-python sdist on PyPI: the peer zeroserve is compared with (docs/benchmarks.md).
#
# Everything goes under .bench/ (gitignored); the binary ends at .bench/bin/llama-server.
# The machine is shared, so the build runs under `nice` with 2 jobs (about ten minutes).
#
#   benchmarks/build_llama_server.sh            # build once (no-op if the binary exists)
#   FORCE=1 benchmarks/build_llama_server.sh    # rebuild
#   LLAMA_CPP_PYTHON_VERSION=0.3.16 ...      # pin the sdist (default: newest)
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,/^set -euo/p' "$0" | grep '^#' | cut -c3-
    exit 0
fi
cd "$(dirname "$0")/.."
ROOT="$PWD"
BENCH="$ROOT/.bench"
SRC_DIR="$BENCH/llama-src"
BUILD_DIR="$BENCH/llama-build"
BIN="$BENCH/bin/llama-server"
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
PIP="${PIP:-$ROOT/.venv/bin/python -m pip}"

if [[ -x "$BIN" && -z "${FORCE:-}" ]]; then
    echo "llama-server already built: $BIN"
    exit 0
fi
mkdir -p "$BENCH/sdist" "$BENCH/bin"

spec="llama-cpp-python"
[[ -n "${LLAMA_CPP_PYTHON_VERSION:-}" ]] && spec="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
sdist="$(ls "$BENCH"/sdist/llama_cpp_python-*.tar.gz 2>/dev/null | sort -V | tail -1 || true)"
if [[ -z "$sdist" ]]; then
    echo "downloading the $spec sdist"
    $PIP download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        --dest "$BENCH/sdist" "$spec"
    sdist="$(ls "$BENCH"/sdist/llama_cpp_python-*.tar.gz | sort -V | tail -1)"
fi
echo "sdist: $sdist"

rm -rf "$SRC_DIR"
mkdir -p "$SRC_DIR"
tar -xzf "$sdist" -C "$SRC_DIR" --strip-components=1
LLAMA="$SRC_DIR/vendor/llama.cpp"
[[ -f "$LLAMA/CMakeLists.txt" ]] || { echo "no vendor/llama.cpp in $sdist" >&2; exit 1; }

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
# CPU only, no libcurl (no network model downloads), server only; GGML_NATIVE tunes the
# kernels for this CPU like a user building it here would.
nice -n "$NICE" cmake -S "$LLAMA" -B "$BUILD_DIR" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DBUILD_SHARED_LIBS=OFF
nice -n "$NICE" cmake --build "$BUILD_DIR" --config Release --target llama-server -j "$JOBS"

built="$(find "$BUILD_DIR" -type f -name llama-server -perm -u+x | head -1)"
[[ -n "$built" ]] || { echo "llama-server binary not found after the build" >&2; exit 1; }
cp "$built" "$BIN"
"$BIN" --version 2>&1 | head -3 || true
echo "built $BIN"
