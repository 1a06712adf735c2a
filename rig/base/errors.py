"""The rig's kinds of failure, each with its exit code.

Every message names the item, the expected and the found value, and the fix;
the command-line entry points print it and exit with the code.
"""

from __future__ import annotations


class RigError(Exception):
    """A failure the user can act on; ``code`` is the process exit status."""

    code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadInput(RigError):
    """Bad input, or a box that cannot do the work: exit 2."""

    code = 2


class Busy(RigError):
    """The box is busy for now (the port taken): exit 75, EX_TEMPFAIL. The unit restarts it, where it does not
    restart exit 2, a configuration to fix (RestartPreventExitStatus=2)."""

    code = 75


class WorkFailed(RigError):
    """The work itself failed (a compile, a download): exit 1."""

    code = 1


def problem(item: str, expected: str, found: str, fix: str) -> str:
    """One message in the rig's shape: what, expected, found, what to do."""
    return f"{item}: expected {expected}, found {found}. Fix: {fix}"
