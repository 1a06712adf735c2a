#!/usr/bin/env bash
# Serve patched vLLM: build on a first run, check the box, start the engine, wait healthy (./start.sh --help).
exec "$(dirname "${BASH_SOURCE[0]}")/scripts/nox.sh" -s start -- "$@"
