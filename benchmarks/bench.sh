#!/usr/bin/env bash
# Benchmark the running server with llama-benchy (benchmarks/bench.sh --help; logic in rig/control/bench/):
#   benchmarks/bench.sh [PP] [TG] [CONCURRENCY] [DEPTH] [llama-benchy arguments]
exec "$(dirname "${BASH_SOURCE[0]}")/../scripts/nox.sh" -s bench -- "$@"
