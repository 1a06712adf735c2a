"""Run as a script on purpose (``python -m rig.base.testdeps``, by ``nox -s tests``): what the suite needs from the
system.

The integration tests drive real tools: ccache from Debian's packages is one
of them, zstd another. On a fresh machine (CI) it is installed with apt-get when we are
root; elsewhere the missing tool is named and the tests that need it say so.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from rig.base.console import note

#: command -> Debian package
DEBIAN = {"ccache": "ccache", "readelf": "binutils", "patch": "patch", "sha256sum": "coreutils", "zstd": "zstd",
          "logrotate": "logrotate", "systemd-analyze": "systemd", "buildah": "buildah", "busybox": "busybox-static",
          "promtool": "prometheus", "prometheus-node-exporter": "prometheus-node-exporter"}
#: What the CPU image's run adds (``-m image``): podman runs it, with runc where crun refuses the host's cgroups.
IMAGE_RUN = {"podman": "podman", "runc": "runc"}
#: What the tests under a booted systemd add (``-m systemd``: tests/booted.py makes and boots the container).
BOOTED = {"debootstrap": "debootstrap", "systemd-nspawn": "systemd-container", "nsenter": "util-linux"}


def ensure(tools: dict[str, str] = DEBIAN) -> list[str]:
    """Install the missing packages of ``tools`` (command -> package) when possible; return what is still missing."""
    missing = sorted({pkg for cmd, pkg in tools.items() if not shutil.which(cmd)})
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        note(f"tests: installing Debian packages {' '.join(missing)}")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], env=env, check=False)
        missing = sorted({pkg for cmd, pkg in tools.items() if not shutil.which(cmd)})
    if missing:
        note(f"tests: missing {' '.join(missing)} (apt-get install -y {' '.join(missing)})")
    return missing


if __name__ == "__main__":
    import sys

    extra = {**(BOOTED if "--booted" in sys.argv[1:] else {}), **(IMAGE_RUN if "--image" in sys.argv[1:] else {})}
    raise SystemExit(1 if ensure({**DEBIAN, **extra}) else 0)
