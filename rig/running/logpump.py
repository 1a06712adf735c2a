"""Run as a script on purpose (``logpump.py LOG -- CMD``): CMD's output appended to a log that may be rotated.

``python rig/running/logpump.py LOG [--status FILE] -- CMD ...`` (how rig/running/supervise.py runs it) starts CMD with
its stdout and stderr
on a pipe and appends every byte to LOG (O_APPEND). With ``--status``, CMD's own exit status (negative: the
signal that killed it) is written to FILE the moment CMD exits, before the drain: the supervisor tells a server
that shut down from one that was killed by that, not by timing. Before each write it checks that LOG still names the
file it has open; when logrotate has renamed it, it opens a new LOG. So rotation by rename loses
nothing, where ``copytruncate`` loses what is written between the copy and the truncation.

It ignores SIGTERM, SIGINT and SIGHUP (they are meant for CMD, which shares its process group):
it keeps writing until CMD has exited and said its last lines, then exits with CMD's status. A write that fails
(the log's disk full, its folder gone) never stops it: it keeps reading CMD's output, so the engine never blocks
on a full pipe, drops what it cannot write, tries again each second, and once a write succeeds puts one line in
the log saying how much it dropped, between when and why. What was written before stays as it was.
Standard library only, and no import of the rig: it runs before anything of the rig or the engine, as a script
with no path to the repository (where the tree's folder vllm/ would shadow the installed package). So its one
message, the usage line, is a plain ``print`` and not rig/base/console.py's.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

RETRY = 1.0  # seconds between tries to write again after a failed write


class Appender:
    """Appends to ``path``, reopening it when the path no longer names the open file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1
        self.ino = -1
        self.dropped = self.lines = 0  # bytes and lines not written since the first failure, and when, and why
        self.since, self.why, self.retry_at = 0.0, "", 0.0
        self.mid_line = False  # the log ends inside a line (a write cut short): the note starts a line of its own
        try:
            self._open()
        except OSError as exc:
            self._drop(b"", exc)

    def _open(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        self.ino = os.fstat(self.fd).st_ino

    def write(self, data: bytes) -> None:
        """Append ``data``; what cannot be written is dropped and counted, and the write is tried again after
        ``RETRY`` seconds, led by a line saying what was dropped."""
        if self.since and time.monotonic() < self.retry_at:
            self._drop(data)
            return
        writing = False  # the note and the reopening come first: a failure there leaves all of ``data``
        try:
            try:
                moved = self.fd < 0 or os.stat(self.path).st_ino != self.ino
            except FileNotFoundError:
                moved = True
            if moved:
                self._open()
            if self.since:
                self._all(self._note())
                self.dropped = self.lines = 0
                self.since, self.why = 0.0, ""
            writing = True
            self._all(data)
        except OSError as exc:
            self._drop(getattr(exc, "left", data) if writing else data, exc)

    def _all(self, data: bytes) -> bytes:
        """Write all of ``data``; on a failure, the OSError carries what was left unwritten."""
        while data:
            try:
                n = os.write(self.fd, data)
                self.mid_line, data = not data[:n].endswith(b"\n"), data[n:]
            except OSError as exc:
                exc.left = data  # type: ignore[attr-defined]
                raise
        return data

    def _drop(self, data: bytes, exc: OSError | None = None) -> None:
        if exc is not None:
            self.why = self.why or (exc.strerror or str(exc))
            self.retry_at = time.monotonic() + RETRY
        self.since = self.since or time.time()
        self.dropped += len(data)
        self.lines += data.count(b"\n")

    def _note(self) -> bytes:
        t0, t1 = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) for t in (self.since, time.time()))
        lead = "\n" if self.mid_line else ""
        return (f"{lead}==== {t1} the log writer dropped {self.lines} line(s), {self.dropped} bytes of the engine's "
                f"output from {t0} to {t1}: {self.why or 'a write failed'} ({self.path})\n").encode()


def run(log: str, cmd: list[str], drain: float = 1.0, status: str = "") -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)  # a handler, not SIG_IGN: CMD must not inherit the ignoring
    out = Appender(log)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as exc:
        out.write(f"ERROR could not start {cmd[0]}: {exc}\n".encode())
        return 127
    fd = proc.stdout.fileno()
    exited_at = None
    while True:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # every writer has closed the pipe
            out.write(chunk)
        if proc.poll() is not None:
            # CMD is gone; a child it left may hold the pipe open: take what is there, then stop.
            if exited_at is None and status:
                _status(status, proc.returncode)
            exited_at = exited_at or time.monotonic()
            if not ready and time.monotonic() - exited_at > drain:
                break
    code = proc.wait()
    if exited_at is None and status:
        _status(status, code)
    return code if code >= 0 else 128 - code


def _status(path: str, code: int) -> None:
    """CMD's exit status into ``path``, atomically (written beside it, then renamed)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as fh:
            fh.write(f"{code}\n")
        os.replace(tmp, path)
    except OSError:
        pass  # the supervisor then knows only the log writer's own exit status, and says so


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    status = ""
    if len(argv) > 2 and argv[1] == "--status":
        status, argv = argv[2], [argv[0], *argv[3:]]
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m rig.running.logpump LOG [--status FILE] -- CMD [ARGS]", file=sys.stderr)
        return 2
    return run(argv[0], argv[2:], status=status)


if __name__ == "__main__":
    raise SystemExit(main())
