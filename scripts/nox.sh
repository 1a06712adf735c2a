#!/usr/bin/env bash
# Run a nox session of the rig: find uv (install it with pip when missing), then
# `uv run noxfile.py`, which brings nox and the rig's dependencies itself.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
uv="${UV:-}"; case "$uv" in ""|0) uv="$(command -v uv || true)";; esac
if [ -z "$uv" ]; then
  uv="$(python3 -m site --user-base)/bin/uv"
  if [ ! -x "$uv" ]; then
    echo "uv not found: installing it with python3 -m pip install --user uv" >&2
    python3 -m pip install --user --quiet uv >&2
  fi
fi
export PATH="$(dirname "$uv"):$PATH"
exec "$uv" run --quiet --script "$root/noxfile.py" -f "$root/noxfile.py" "$@"
