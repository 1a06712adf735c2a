"""systemd's readiness protocol (``sd_notify``), with the standard library: a datagram to ``$NOTIFY_SOCKET``.

The unit is ``Type=notify``: systemd counts the service as started when the foreground supervisor sends
``READY=1``, which it does once a one-token generation answered, so ``TimeoutStartSec`` bounds the real
start. ``STATUS=`` lines show in ``systemctl status``. Outside systemd (no ``NOTIFY_SOCKET``) every call is a
no-op. The engine never gets the variable (:func:`engine_env`): only the supervisor may say the service is ready.
``NOTIFY_SOCKET`` is systemd's to set, not a setting of the rig, so it is read here and not in rig/facts/config.py.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from rig.base.console import warn

VAR = "NOTIFY_SOCKET"
_failed: list[str] = []  # the first failure, said once: a broken socket must not flood the journal


def notify(*fields: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``fields`` (``READY=1``, ``STATUS=...``) as one datagram; False when there is no socket to send to."""
    addr = (os.environ if env is None else env).get(VAR, "")
    if not addr or addr[0] not in "@/":  # unset, or a vsock address (a VM's manager), which this rig never has
        return False
    target = "\0" + addr[1:] if addr[0] == "@" else addr  # '@' names an abstract socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(fields).encode(), target)
    except OSError as exc:
        if not _failed:
            _failed.append(str(exc))
            warn(f"could not tell systemd ({VAR}={addr}): {exc}; a Type=notify unit then times out at "
                 "TimeoutStartSec")
        return False
    return True


def engine_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the notify socket: the engine's processes must not be able to mark the service ready."""
    return {k: v for k, v in env.items() if k != VAR}
