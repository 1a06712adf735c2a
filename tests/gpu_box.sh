#!/usr/bin/env bash
# docs/gpu.md's run on a GPU box with no network: the host's torch, the offline bundle, then the GPU checks.
#   tests/gpu_box.sh BUNDLE figures [ARGS]     build from the bundle (timed), then benchmarks/gpu_figures.py ARGS
#   tests/gpu_box.sh BUNDLE tests [PYTEST...]  the GPU tests (tests/test_gpu.py, tests/test_gpu_serve.py)
#   tests/gpu_box.sh BUNDLE ple [PYTEST...]    the PLE offload on the card (tests/test_ple_gpu.py, which runs
#                                              benchmarks/ple_offload.py and prints its figures)
#   tests/gpu_box.sh BUNDLE reference [PYTEST...]  the reference's shape on the card (tests/test_reference_gpu.py);
#                                              its figures: figures --profile reference-tiny
# PYTHON (default: python3) is the interpreter whose torch the rig stands on; its pytest runs the tests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export OFFLINE="$1" TORCH=host PYTHON="${PYTHON:-$(command -v python3)}" PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" CACHE_ROOT="${CACHE_ROOT:-/tmp/rig-gpu-cache}"
cd "$root"
case "${2:-}" in
  figures) shift 2; exec "$PYTHON" benchmarks/gpu_figures.py --build --out "${FIGURES_OUT:-/tmp/gpu-figures.json}" "$@" ;;
  tests) shift 2; exec "$PYTHON" -m pytest -p no:cacheprovider -s -v tests/test_gpu.py tests/test_gpu_serve.py "$@" ;;
  ple) shift 2; exec "$PYTHON" -m pytest -p no:cacheprovider -s -v tests/test_ple_gpu.py "$@" ;;
  reference) shift 2; exec "$PYTHON" -m pytest -p no:cacheprovider -s -v tests/test_reference_gpu.py "$@" ;;
  *) echo "usage: tests/gpu_box.sh BUNDLE figures|tests|ple|reference [arguments]" >&2; exit 2 ;;
esac
