#!/usr/bin/env bash
# Run a nox session of the rig: find uv (UV, PATH, the rig's own in .rig/uv; else fetch the pinned one there
# with the standard library: no pip, nothing in the system Python; with OFFLINE, the bundle's), then
# `uv run noxfile.py`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
uv="${UV:-}"; case "$uv" in ""|0) uv="$(command -v uv || true)";; esac
if [ -n "${OFFLINE:-}" ]; then  # a bundle: checked and opened by the standard library, then uv and all wheels from it
  sh="$(PYTHONPATH="$root" python3 -m rig.build.bundle open --shell "$OFFLINE")" || exit $?; eval "$sh"
elif [ -z "$uv" ]; then
  uv="$root/.rig/uv/uv"
  [ -x "$uv" ] || uv="$(python3 "$root/scripts/bootstrap_uv.py" "$root/.rig/uv")"
fi
export PATH="$(dirname "$uv"):$PATH"
# uv trusts the system's certificate store, as the bootstrap (Python's ssl) does, unless its own TLS variable is set.
[ -n "${UV_SYSTEM_CERTS:-}${UV_NATIVE_TLS:-}" ] || export UV_SYSTEM_CERTS=1
exec "$uv" run --quiet --script "$root/noxfile.py" -f "$root/noxfile.py" "$@"
