#!/usr/bin/env bash
# The prepared GPU check: one H200 whose image has CUDA PyTorch and transformers; everything else draftline
# needs comes as wheels carried in benchmarks/wheels/ (never committed).
#
#   benchmarks/gpu_check.sh --build-wheels      here, with the project's venv: download/build the wheels
#                                               (CPython 3.12, x86-64 Linux; <= 64 MiB; see MANIFEST.json)
#   benchmarks/gpu_check.sh [--shape real|tiny] [--parts ...] [--out FILE]
#                                               on the GPU machine: install the carried wheels that are not
#                                               installed there, then run the check (<= 8 minutes) ->
#                                               benchmarks/results/gpu-check.json
# The logic is in benchmarks/gpu_check.py (parts, JSON) and benchmarks/gpu_wheels.py (which wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELS=${DRAFTLINE_GPU_CHECK_WHEELS:-benchmarks/wheels}
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [[ "${1:-}" == "--build-wheels" ]]; then
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  rm -rf "$WHEELS"
  exec "$PY" -m benchmarks.gpu_wheels build "$WHEELS"
fi

PY=${PYTHON:-python3}
if [[ -d "$WHEELS" ]]; then
  "$PY" -m benchmarks.gpu_wheels install "$WHEELS" || echo "gpu_check: installing the wheels failed; parts that miss them are skipped" >&2
else
  echo "gpu_check: no $WHEELS (build it with --build-wheels); using what is installed" >&2
fi
# 8 minutes in all: installing the wheels (~30 s), the parts (440 s between them), and this backstop
exec timeout 450 "$PY" -m benchmarks.gpu_check "$@"
