#!/usr/bin/env bash
# Build patched vLLM: the eight build steps of the rig (./build.sh --help lists them).
exec "$(dirname "${BASH_SOURCE[0]}")/scripts/nox.sh" -s build -- "$@"
