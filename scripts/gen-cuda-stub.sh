#!/usr/bin/env bash
# Write a link-time libcuda.so.1 stub from a toolkit's cuda.h (see rig/build/cudastub.py; --help).
PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m rig.build.cudastub "$@"
