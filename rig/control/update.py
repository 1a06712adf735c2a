"""``nox -s update`` and ``nox -s rollback`` (and the service's ``update`` / ``rollback``): a new build beside the
current one, one switch, and the old build back when the new engine is not healthy.

The update builds into a new slot (rig/facts/slots.py: its own tree, venv, kernels and record) while the engine keeps
serving the current build; a build that fails (a patch that breaks the import fails the build's import check)
is refused with the engine untouched. Then the engine is stopped, the pointer file is switched (one rename) and
the engine is started on the new build; when it is not healthy within ``START_TIMEOUT``, the pointer is switched
back, the old engine started and checked, and the update exits 1 saying what failed. The current build and the
previous one are kept (``nox -s rollback`` switches between them); older slots are removed.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO

from rig.base.console import say, warn
from rig.base.errors import BadInput, RigError, WorkFailed, problem
from rig.build.buildlock import BuildLock, held_alone
from rig.build.steps import pipeline
from rig.build.steps.order import steps
from rig.control import control, start
from rig.facts import config, slots
from rig.facts.config import Settings
from rig.running import enginerec


@dataclass(frozen=True)
class Engine:
    """How the update stops and starts the engine: directly (``nox -s update``) or through systemd."""

    running: Callable[[], bool]
    stop: Callable[[], None]
    start: Callable[[], None]  # returns once healthy; raises RigError when it is not


def direct(env: Mapping[str, str]) -> Engine:
    """The engine as ``./start.sh`` (detached) and ``nox -s stop`` run it, with ``env``'s settings. Each call reads
    which build is current: a switch between two calls moves the engine to the other build."""
    def running() -> bool:  # the engine's record alone, as stop: a damaged pointer must not block either
        rec = enginerec.load(config.settings(env))
        return rec is not None and enginerec.server_alive(rec)

    def stop() -> None:
        control.stop(config.settings(env), config.serve_settings(env))

    def begin() -> None:
        code = start.run(slots.settings(env), env, foreground=False, dry_run=False, build=False, box_check=True,
                         clear_cache=False)
        if code != 0:
            raise WorkFailed(problem("./start.sh", "exit 0", f"exit {code}", "its output is above"))

    return Engine(running, stop, begin)


def systemd(unit: str) -> Engine:
    """The engine as the unit runs it, with the unit's own environment file: ``systemctl`` stops and starts it.
    The unit is Type=notify and its supervisor sends READY=1 only after a one-token generation, so a start that
    returns 0 is a healthy engine; one that fails is told by the journal's lines of that start. Each start of an
    update or rollback resets the unit's start counter first: the restarts of a crash loop earlier in the
    StartLimitIntervalSec= window would otherwise refuse it ("Start request repeated too quickly")."""
    def ctl(*args: str) -> int:
        return subprocess.run(["systemctl", *args, unit]).returncode

    def begin() -> None:
        since = f"@{int(time.time())}"
        ctl("reset-failed")  # a deliberate start: earlier crashes must not spend the unit's StartLimitBurst on it
        if ctl("start") != 0:
            raise WorkFailed(problem(f"systemctl start {unit}", "exit 0 (READY=1 after a one-token generation)",
                                     f"failed: {journal_reason(unit, since)}", f"journalctl -u {unit} -n 50"))

    def stop() -> None:
        if ctl("stop") != 0:
            raise WorkFailed(problem(f"systemctl stop {unit}", "exit 0", "failed", f"journalctl -u {unit} -n 50"))

    return Engine(lambda: ctl("is-active", "--quiet") == 0, stop, begin)


def journal_reason(unit: str, since: str) -> str:
    """Why a start failed, from the unit's journal since ``since``: the rig's last ``error:`` line, else the last
    line there is."""
    r = subprocess.run(["journalctl", "-u", unit, "--since", since, "--no-pager", "-o", "cat"], capture_output=True,
                       text=True)
    lines = [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    return (errors or lines or ["the journal has no line of it"])[-1][:600]


def switched_build(s: Settings, env: Mapping[str, str]) -> bool:
    """``./build.sh --pre-start`` (the unit's ExecStartPre): True, having said so, when an update or rollback chose
    the build to serve. A start then serves it as built: building the checkout's series in its place would undo a
    rollback and is the in-place, non-atomic update that ``update`` exists to avoid."""
    current, _ = slots.read(s.state_dir, s.device)
    if current is None or any(env.get(n) for n in slots.VARIABLES):
        return False
    stale = pipeline.first_stale(steps(), s, upto="pack")
    say(f"pre-start: {current.describe()} is the build an update or rollback switched to "
        f"({slots.pointer(s.state_dir, s.device)}); served as built"
        + (f". The checkout differs from it (step {stale[0]}: {stale[1]}): scripts/install-as-service.sh update "
           "builds that beside it" if stale else ", and it is the checkout's series"))
    return True


def _lock(s: Settings) -> IO[str]:
    """One update or rollback at a time (the builds have their own locks)."""
    return held_alone(s.state_dir / "update.lock", "the update lock", "another update or rollback",
                      "wait for it to finish")


def _settings(env: Mapping[str, str]) -> tuple[Settings, slots.Slot, slots.Slot | None]:
    """The current build's settings, the current slot and the previous one; refused where the user names the
    build's paths (an update keeps builds side by side under RIG_STATE and chooses the paths itself)."""
    named = [n for n in slots.VARIABLES if env.get(n)]
    if named:
        raise BadInput(problem(", ".join(named), "unset (an update keeps each build in its own folder under "
                               "RIG_STATE/slots and chooses the paths)", "set", f"unset {' '.join(named)}, or "
                               "build in place with ./build.sh"))
    if (nodes := config.serve_settings(env).nodes) > 1:
        raise BadInput(problem("NODES", "1 (an update restarts this box's engine on its own)", str(nodes),
                               "across nodes: nox -s stop on the head, ./build.sh on every node, then ./start.sh"))
    s = config.settings(env)  # the pointer is read here, explicitly: a current slot gone is for update to rebuild
    current, previous = slots.read(s.state_dir, s.device)
    if current is None or not current.name:
        current = slots.own(s.vllm_dir, s.venv_dir, s.artifacts_dir, s.state_dir)
    return s, current, previous


def update(env: Mapping[str, str], engine: Engine, *, force: bool = False) -> int:
    """Build the checkout's series beside the current build, switch to it, and roll back when its engine fails."""
    s, current, previous = _settings(env)
    with _lock(s):  # nothing is pruned before the switch succeeds: a slot may serve though no pointer names it
        stale = pipeline.first_stale(steps(), slots.place(s, current), upto="pack")
        if stale is None and not force:
            say(f"update: {current.describe()} is this checkout's series and lock already; nothing to do "
                "(--force builds it again beside it)")
            return 0
        why = f"step {stale[0]}: {stale[1]}" if stale else "--force"
        new = slots.new(s.state_dir, s.device, s.vllm_dir.name, s.venv_dir.name, s.artifacts_dir.name)
        ns = slots.place(s, new)
        say(f"update: building into {new.record_dir} ({why}); the engine keeps serving {current.describe()}")
        t0 = time.monotonic()
        try:
            with BuildLock(ns, "update"):
                pipeline.run(steps(), ns, pipeline.Options(pack=s.pack, bytecode_from=current.venv_dir))
        except RigError as exc:
            slots.remove(new)
            raise WorkFailed(problem("the update's build", "a complete build", exc.message, "fix what it names "
                                     f"and update again; the engine and {current.describe()} were not touched")
                             ) from None
        except BaseException:
            slots.remove(new)
            raise
        say(f"update: the new build is complete in {time.monotonic() - t0:.0f} s")
        _switch(s, engine, new, (current, previous), "update")
        for name in slots.prune(s.state_dir, s.device, [new, current]):  # the engine runs from new now
            say(f"removed slot {name} (two builds are kept: the current one and the previous one)")
        _disk(new, current)
    return 0


def rollback(env: Mapping[str, str], engine: Engine) -> int:
    """Switch back to the previous build on purpose (the engine restarted on it when one runs)."""
    s, current, previous = _settings(env)
    if previous is None:
        raise BadInput(problem("the previous build", f"named in {slots.pointer(s.state_dir, s.device)}",
                               "none (no update has switched builds yet)", "nothing to roll back to"))
    python = previous.venv_dir / "bin" / "python"
    if not python.exists():
        raise BadInput(problem(f"the previous build ({previous.describe()})", f"its venv at {previous.venv_dir}",
                               "missing", "build the checkout again beside the current build with nox -s update -- "
                               "--force (it becomes the previous build to roll back to)"))
    with _lock(s):
        _switch(s, engine, previous, (current, previous), "rollback")
    return 0


def _switch(s: Settings, engine: Engine, to: slots.Slot, was: tuple[slots.Slot, slots.Slot | None],
            what: str) -> None:
    """Switch to ``to`` (the current build ``was[0]`` becomes the previous one) and restart a running engine on
    it; when that engine is not healthy, put the pointer back as it ``was`` and start the old engine again."""
    back = was[0]
    running = engine.running()
    t0 = time.monotonic()
    if running:
        say(f"{what}: stopping the engine of {back.describe()}")
        engine.stop()
    slots.write(s.state_dir, s.device, to, back)
    say(f"{what}: switched to {to.describe()} ({to.vllm_dir}); the previous build is {back.describe()}")
    if not running:
        say(f"{what}: no engine was running; the next start serves {to.describe()}")
        return
    try:
        engine.start()
    except RigError as exc:
        failed = exc.message
        warn(f"{what}: the engine of {to.describe()} failed: {failed}; switching back to {back.describe()}")
        _stop_quietly(engine)
        slots.write(s.state_dir, s.device, *was)
        try:
            engine.start()
        except RigError as again:
            raise WorkFailed(problem(f"the {what}", f"the engine of {to.describe()} healthy, or the old one back",
                                     f"the new one failed ({failed}), and after switching back to "
                                     f"{back.describe()} the old one failed too ({again.message})",
                                     "read the engine log; ./start.sh once the cause is fixed")) from None
        down = time.monotonic() - t0
        kept = f"the failed build is kept in {to.record_dir} until an update succeeds" if what == "update" else \
            f"{to.describe()} stays the previous build"
        raise WorkFailed(problem(f"the {what}'s engine", "healthy within START_TIMEOUT", failed,
                                 f"rolled back: {back.describe()} serves again (down {down:.0f} s); {kept}")
                         ) from None
    say(f"{what}: the engine of {to.describe()} is healthy; the engine was down {time.monotonic() - t0:.1f} s")


def _stop_quietly(engine: Engine) -> None:
    try:
        engine.stop()
    except RigError as exc:
        warn(f"stopping what is left of the failed engine: {exc.message}")


def _disk(*kept: slots.Slot) -> None:
    sizes = [(k, *slots.disk(k)) for k in kept]
    say("builds kept: " + "; ".join(f"{k.describe()} {n / 1e9:.1f} GB ({(n - shared) / 1e9:.1f} GB its own, the "
                                    f"rest linked from uv's cache)" for k, n, shared in sizes)
        + f"; {sum(n - shared for _, n, shared in sizes) / 1e9:.1f} GB of their own in all")
