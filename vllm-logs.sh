#!/usr/bin/env bash
# vLLM's stats lines as one coloured line each (./vllm-logs.sh --help; logic in rig/running/logs.py).
exec "$(dirname "${BASH_SOURCE[0]}")/scripts/nox.sh" -s logs -- "$@"
