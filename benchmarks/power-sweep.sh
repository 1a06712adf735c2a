#!/usr/bin/env bash
# Benchmark at each GPU power limit: benchmarks/power-sweep.sh "220 250 285" [bench.sh arguments]
# Sets every card's limit with nvidia-smi -pl (root), runs bench.sh, writes one table; the
# original limits come back on any exit: success, failure, Ctrl-C or SIGTERM.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
limits="${1:-}"; shift || true
[[ "$limits" =~ ^[[:space:]]*[0-9]+([.][0-9]+)?([[:space:]]+[0-9]+([.][0-9]+)?)*[[:space:]]*$ ]] || {
  echo "error: LIMITS: expected watts separated by spaces, like \"220 250 285\", found \"$limits\". Fix: benchmarks/power-sweep.sh \"220 250 285\" [bench.sh arguments]" >&2; exit 2; }
orig="$(nvidia-smi --query-gpu=index,power.limit --format=csv,noheader,nounits)"; out="$(mktemp)"
restore() { rm -f "$out"; while IFS=', ' read -r i w; do nvidia-smi -i "$i" -pl "$w" >/dev/null || echo "error: GPU $i: could not restore its power limit to $w W" >&2; done <<<"$orig"; }
trap restore EXIT; trap 'exit 130' INT; trap 'exit 143' TERM
runs=()
for w in $limits; do
  nvidia-smi -pl "$w"
  "$here/bench.sh" "$@" | tee "$out"
  runs+=("$w W=$(sed -n 's/^results: //p' "$out" | tail -n 1)")
done
PYTHONPATH="$here/.." python3 -m rig.control.bench table "power limit" "${runs[@]}"
