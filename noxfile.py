# /// script
# requires-python = ">=3.11"
# dependencies = [
#   "nox>=2025.11.12", "tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24",
# ]
# ///
"""The rig's jobs, one session each; every session is a few lines over rig/."""

import sys

import nox

nox.needs_version = ">=2025.11.12"
nox.options.default_venv_backend = "uv"
nox.options.sessions = ["tests", "lint"]

# Sessions that do the rig's work run in this process, with the dependencies
# of the script block above: no venv of their own, so a no-op run is fast.
WORK = {"venv_backend": "none", "default": False}


def _rig(session: nox.Session, command: str) -> None:
    from rig import cli  # after nox has put the repository on sys.path

    code = cli.run(command, session.posargs)
    if code:
        sys.exit(code)  # keep the rig's exit status (2: bad input) instead of nox's 1


@nox.session(**WORK)
def build(session: nox.Session) -> None:
    """Build patched vLLM: every step, skipping current ones (./build.sh)."""
    _rig(session, "build")


@nox.session(**WORK)
def tree(session: nox.Session) -> None:
    """Make vllm/ = upstream tag + patches/ and check it (--accept records it)."""
    _rig(session, "tree")


@nox.session(**WORK)
def pack(session: nox.Session) -> None:
    """Pack the built kernels into artifacts/ (step 8 alone)."""
    _rig(session, "pack")


@nox.session(**WORK)
def verify(session: nox.Session) -> None:
    """Check a kernels tarball against this build's target, item by item."""
    _rig(session, "verify")


@nox.session(**WORK)
def logs(session: nox.Session) -> None:
    """Show the engine's stats lines, one coloured line per update (./vllm-logs.sh)."""
    _rig(session, "logs")


@nox.session(**WORK)
def doctor(session: nox.Session) -> None:
    """Report the box: GPUs, driver, PCIe, P2P, power, RAM, /dev/shm, disk, port, checkpoint."""
    _rig(session, "doctor")


@nox.session(**WORK)
def start(session: nox.Session) -> None:
    """Serve: build if needed, check the box, choose the topology, start vllm serve, wait healthy (./start.sh)."""
    _rig(session, "start")


@nox.session(**WORK)
def fit(session: nox.Session) -> None:
    """Will it fit: weights, KV cache and verdict per card, before any engine starts (-- --cards N --card-memory M)."""
    _rig(session, "fit")


@nox.session(**WORK)
def report(session: nox.Session) -> None:
    """One archive for a bug report: doctor, build records, series, profile, engine, versions, log tail; no secret."""
    _rig(session, "report")


@nox.session(**WORK)
def stop(session: nox.Session) -> None:
    """Stop the engine: SIGTERM to its process group, SIGKILL after STOP_TIMEOUT, none left behind."""
    _rig(session, "stop")


@nox.session(**WORK)
def status(session: nox.Session) -> None:
    """Report the engine: pid, uptime, port, health (one-token generation), hang watchdog, KV cache line."""
    _rig(session, "status")


@nox.session(**WORK)
def update(session: nox.Session) -> None:
    """Build beside the current build, switch, restart; switch back when the new engine is not healthy."""
    _rig(session, "update")


@nox.session(**WORK)
def rollback(session: nox.Session) -> None:
    """Switch back to the previous build (and restart a running engine on it)."""
    _rig(session, "rollback")


@nox.session(**WORK)
def service(session: nox.Session) -> None:
    """The systemd service: install, start, stop, status, update, rollback, logs, uninstall."""
    _rig(session, "service")


@nox.session(**WORK)
def patches(session: nox.Session) -> None:
    """The series: check it, rebase it onto another tag (in scratch), export new commits from vllm/."""
    _rig(session, "patches")


@nox.session(**WORK)
def ray(session: nox.Session) -> None:
    """A Ray cluster across the nodes on its own: up (head or worker by NODE_RANK), status, down."""
    _rig(session, "ray")


@nox.session(**WORK)
def image(session: nox.Session) -> None:
    """Build the image from artifacts/ with docker buildx, podman or buildah; record its size and build time."""
    _rig(session, "image")


@nox.session(**WORK)
def lock(session: nox.Session) -> None:
    """Regenerate the hash-pinned runtime lock (scripts/runtime.lock) with uv."""
    _rig(session, "lock")


@nox.session(default=False, reuse_venv=True)
def bench(session: nox.Session) -> None:
    """Benchmark the running server with pinned llama-benchy in its own venv: saved, compared, plotted."""
    import subprocess
    from pathlib import Path

    from rig.control.bench import TOOL, TOOL_DEPS

    session.install("--no-deps", TOOL)
    session.install("-e", ".", *TOOL_DEPS)
    with subprocess.Popen([str(Path(session.bin) / "python"), "-m", "rig.cli", "bench", *session.posargs]) as p:
        try:
            code = p.wait()
        except KeyboardInterrupt:  # the run got the same Ctrl-C: let it clean up and say so
            code = p.wait()
    if code:
        sys.exit(code)  # keep the rig's exit status (2: bad input)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite: two lanes of pytest at once, or one pytest with the extra arguments."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "rig.base.testdeps")
    session.run("python", "-m", "rig.base.testlanes", *session.posargs)  # no arguments: two lanes at once


@nox.session
def lint(session: nox.Session) -> None:
    """Check the code with ruff."""
    session.install("ruff")
    session.run("ruff", "check", ".")


if __name__ == "__main__":
    nox.main()
