"""The pinned llama-benchy: its version, what the bench venv installs beside it, and how it is run.

Kept apart so ``noxfile.py`` (which builds the bench venv from ``TOOL`` and ``TOOL_DEPS``) and the
run share one pin, and so the API key handling of the launch lives in one place.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from rig.base.console import plain
from rig.base.errors import BadInput, problem

TOOL = "llama-benchy==0.4.0"
TOOL_VERSION = TOOL.partition("==")[2]
#: What llama-benchy 0.4.0 imports, installed beside it with ``--no-deps``: its full install adds
#: transformers (~300 MB), which it only needs when ``tokenizers`` cannot read the tokenizer.
TOOL_DEPS = ("aiohttp>=3.9", "numpy>=1.26", "pydantic>=2.12.5", "requests>=2.31", "tabulate>=0.9",
             "tokenizers>=0.15", "matplotlib>=3.8")
END_GRACE = 5.0  # seconds llama-benchy has to stop after SIGINT before it is killed
CACHED = "Saved text to cache: "  # llama-benchy's line naming its cached copy of a fetched book
#: Runs llama-benchy with the API key taken from the environment, so it never shows on a command line.
BOOT = ("import os, sys\nfrom llama_benchy.__main__ import main\nkey = os.environ.pop('RIG_BENCH_API_KEY', '')\n"
        "sys.argv = ['llama-benchy', *sys.argv[1:], *(['--api-key', key] if key else [])]\nmain()\n")


def ensure_installed() -> None:
    """BadInput (exit 2) unless the pinned llama-benchy is what this Python imports."""
    from importlib import metadata  # only a run asks; `python3 -m rig.control.bench table` never does

    try:
        found = metadata.version("llama-benchy")
    except metadata.PackageNotFoundError:
        found = "none installed"
    if found != TOOL_VERSION:
        raise BadInput(problem("llama-benchy", TOOL_VERSION, found,
                               "run benchmarks/bench.sh (nox -s bench installs it into its own venv)"))


def run_tool(cmd: list[str], env: dict[str, str], own_book: bool) -> tuple[int, str]:
    """Run llama-benchy, showing its output as it comes; (exit status, the whole output).

    With ``own_book``, the copy of the loopback book it caches is removed as soon as it names it
    (it has the text in memory by then), so not even a killed run leaves one behind.
    """
    out: list[str] = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as p, _ended_with(p):
        assert p.stdout is not None
        for line in p.stdout:
            plain(line.rstrip("\n"))
            out.append(line)
            if own_book and line.startswith(CACHED):
                Path(line.removeprefix(CACHED).strip()).unlink(missing_ok=True)
    return p.returncode, "".join(out)


@contextlib.contextmanager
def _ended_with(p: subprocess.Popen) -> Iterator[None]:
    """llama-benchy ends with this process: on Ctrl-C, on SIGTERM (nox sends it when its child is slow to stop
    after Ctrl-C) and on any error, it is sent SIGINT, then killed after :data:`END_GRACE` seconds. A run left
    behind would hold the caller's output open and keep the server busy."""
    def term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, term)
    try:
        yield
    except BaseException:
        if p.poll() is None:
            quiet = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
            try:
                p.send_signal(signal.SIGINT)
                p.wait(END_GRACE)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            finally:
                signal.signal(signal.SIGINT, quiet)
        raise
    finally:
        signal.signal(signal.SIGTERM, before)
