"""The resource limits the service asks for, against what this process got.

``systemd/vllm.service`` asks for ``LimitNOFILE=65536`` (the API server's connections) and
``LimitMEMLOCK=infinity`` (NCCL and CUDA pin host memory). A box whose root lacks ``CAP_SYS_RESOURCE`` (some
containers) cannot raise a hard limit, and systemd then starts the service with the lower one without a word.
The unit's own lines are the one source of what is asked: they are read from the unit file itself.
"""

from __future__ import annotations

import re
import resource
from collections.abc import Callable
from pathlib import Path

from rig import REPO_ROOT

UNIT = REPO_ROOT / "systemd" / "vllm.service"
#: The unit's Limit*= lines the rig checks: the limit, what it is for and what a lower one costs, said in a warning.
LIMITS = {"LimitNOFILE": (resource.RLIMIT_NOFILE, "open files: a socket per client connection",
                          "expect fewer connections"),
          "LimitMEMLOCK": (resource.RLIMIT_MEMLOCK, "locked memory: NCCL and CUDA pin host memory for transfers",
                           "expect NCCL or pinned copies to fail or to fall back to slower paths")}


def asked(unit: Path = UNIT) -> dict[str, int]:
    """The unit's Limit*= values the rig checks (``infinity`` as ``RLIM_INFINITY``)."""
    out = {}
    for m in re.finditer(r"^(Limit[A-Z]+)=(\S+)\s*$", unit.read_text(), re.M):
        if m[1] in LIMITS:
            out[m[1]] = resource.RLIM_INFINITY if m[2] == "infinity" else int(m[2])
    return out


def _shown(n: int) -> str:
    return "infinity" if n == resource.RLIM_INFINITY else str(n)


def _below(got: int, want: int) -> bool:
    return want == resource.RLIM_INFINITY and got != resource.RLIM_INFINITY or \
        got != resource.RLIM_INFINITY and got < want


def shortfalls(want: dict[str, int], get: Callable[[int], tuple[int, int]] = resource.getrlimit) -> list[str]:
    """One line per limit this process got below what the unit asks for (its soft limit, which is what counts)."""
    out = []
    for name, value in want.items():
        which, why, cost = LIMITS[name]
        soft, hard = get(which)
        if _below(soft, value):
            out.append(f"{name}: the unit asks for {_shown(value)}, this process got {_shown(soft)} (hard limit "
                       f"{_shown(hard)}) for {why}; the box did not grant it (its root lacks CAP_SYS_RESOURCE, or a "
                       "container caps it): raise it where the box is made (docker/podman --ulimit), or "
                       f"{cost}")
    return out
