"""Put the pinned uv under the rig's state, with the standard library alone: no pip, nothing in the system Python.

Stock Debian 12/13 and Ubuntu 24.04 mark their python3 externally managed (PEP 668), so
``pip install --user uv`` is refused there. This fetches uv's wheel for this machine from the
package index (PEP 691 JSON), checks its sha256 against the pin below and the index, and unpacks
its ``uv`` binary to ``DEST/uv`` (written to a temporary name, then renamed). It prints the path.

  python3 scripts/bootstrap_uv.py DEST        (scripts/nox.sh runs it when no uv is found)
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

VERSION = "0.13.9"
#: The manylinux wheels of uv VERSION, by machine: file name and sha256 (from the index, 2026-12-03).
WHEELS = {
    "x86_64": ("uv-0.13.9-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
               "d7f459fe4fd247d830351c75686d3996ace3c6f3f728eb0e85a30b7ada0cef19"),
}


def fail(msg: str, code: int = 2) -> None:
    """Stop with the rig's exit codes: 2 for bad input (a machine, a pin, an index without the file), 1 for a
    download that failed (the network: running again may pass)."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(code)


def main(dest: Path) -> Path:
    machine = platform.machine()
    if machine not in WHEELS:
        fail(f"uv for this machine: expected one of {', '.join(WHEELS)}, found {machine}. "
             "Fix: install uv yourself (https://docs.astral.sh/uv/) and put it on PATH, or set UV=/path/to/uv")
    name, pinned = WHEELS[machine]
    index = os.environ.get("INDEX_URL", "").strip().rstrip("/") or "https://pypi.org/simple"
    try:
        req = urllib.request.Request(f"{index}/uv/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
    except OSError as exc:
        fail(f"uv {VERSION}: the index {index}/uv/ did not answer ({type(exc).__name__}: {exc}). "
             "Fix: check the network (a proxy's CA must be in the system's certificate store), "
             "or set INDEX_URL to a reachable index", 1)
    except ValueError as exc:
        fail(f"uv {VERSION} from {index}/uv/: expected a PEP 691 JSON listing, found {exc}. "
             "Fix: set INDEX_URL to an index that speaks PEP 691")
    try:
        entry = next(f for f in files if f["filename"] == name)
    except (TypeError, KeyError, StopIteration) as exc:
        fail(f"uv {VERSION} from {index}/uv/: expected {name} listed, found {type(exc).__name__}: {exc}. "
             "Fix: check the network, or set INDEX_URL to an index that has it")
    if entry["hashes"].get("sha256") != pinned:
        fail(f"sha256 of {name} at {index}: expected {pinned} (the pin), found {entry['hashes'].get('sha256')}. "
             "Fix: use the official index")
    dest.mkdir(parents=True, exist_ok=True)
    print(f"uv not found: fetching uv {VERSION} into {dest} (no pip, nothing installed into the system)",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        whl = Path(tmp) / name
        h = hashlib.sha256()
        try:
            with urllib.request.urlopen(urllib.parse.urljoin(f"{index}/uv/", entry["url"]), timeout=300) as r, \
                    open(whl, "wb") as out:
                while chunk := r.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
        except OSError as exc:
            fail(f"download of {name} from {index}: {type(exc).__name__}: {exc}. Fix: check the network and "
                 "run again (nothing was kept)", 1)
        if h.hexdigest() != pinned:
            fail(f"sha256 of the downloaded {name}: expected {pinned}, found {h.hexdigest()}. Fix: run again", 1)
        with zipfile.ZipFile(whl) as z:
            member = next(m for m in z.namelist() if m.endswith(".data/scripts/uv"))
            binary = Path(tmp) / "uv"
            binary.write_bytes(z.read(member))
        binary.chmod(0o755)
        os.replace(binary, dest / "uv")
    return dest / "uv"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        fail("usage: python3 scripts/bootstrap_uv.py DEST")
    print(main(Path(sys.argv[1])))
