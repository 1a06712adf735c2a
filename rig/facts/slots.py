"""Builds side by side, so that an update can switch to a new one and back (rig/control/update.py).

A build lives in four places: its tree (``VLLM_DIR``), its venv (``VENV_DIR``), its kernels folder
(``ARTIFACTS_DIR``) and its record. The checkout's own paths are the first build; an update makes the next one in
a slot, ``RIG_STATE/slots/<device>-<time>/``, and ``RIG_STATE/slots-<device>.json`` names the current build and
the previous one. Switching is one rename of that file, so a start, a build or a rollback reads either the old
pair or the new one, never half of each. The settings (rig/facts/config.py) are a pure function of the
environment; which build is current is read here, once per command at the front door (:func:`settings`) and
again by an update right after its switch: with no pointer file, or with any of the three variables set by the
user, the paths are the variables' own.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rig.base import atomic
from rig.base.errors import BadInput, problem
from rig.facts import config
from rig.facts.config import Settings

FOLDER = "slots"
VARIABLES = ("VLLM_DIR", "VENV_DIR", "ARTIFACTS_DIR")
KEEP = 2  # the current build and the previous one


@dataclass(frozen=True)
class Slot:
    """Where one build lives. ``name`` is "" for the checkout's own paths (its record in ``RIG_STATE``)."""

    name: str
    vllm_dir: Path
    venv_dir: Path
    artifacts_dir: Path
    record_dir: Path

    def describe(self) -> str:
        return f"slot {self.name}" if self.name else "the checkout's own build"

    def folders(self) -> list[Path]:
        """What removing this build removes: the slot folder, or nothing for the checkout's own paths."""
        return [self.record_dir] if self.name else []


def pointer(state_dir: Path, device: str) -> Path:
    return Path(state_dir) / f"{FOLDER}-{device}.json"


FIELDS = ("name", "vllm_dir", "venv_dir", "artifacts_dir", "record_dir")
REMOVE = "remove the file: the checkout's own build is used again (./build.sh builds it)"


def _slot(entry: Any, which: str, where: Path, state_dir: Path) -> Slot:
    """One entry of the pointer, checked against this tree: a slot's folders are under RIG_STATE/slots/<name>."""
    if not isinstance(entry, dict) or any(not isinstance(entry.get(k), str) for k in FIELDS):
        found = type(entry).__name__ if not isinstance(entry, dict) else "fields " + ", ".join(
            f"{k}={entry.get(k)!r}" for k in FIELDS if not isinstance(entry.get(k), str))
        raise BadInput(problem(f"{where} ({which})", f"an object with the strings {', '.join(FIELDS)}", found,
                               REMOVE)) from None
    slot = Slot(entry["name"], *(Path(entry[k]) for k in FIELDS[1:]))
    if slot.name:
        home = (Path(state_dir).resolve() / FOLDER / slot.name)
        outside = [str(p) for p in (slot.record_dir, slot.vllm_dir, slot.venv_dir, slot.artifacts_dir)
                   if p != home and home not in p.parents]
        if "/" in slot.name or slot.name in (".", "..") or outside:
            raise BadInput(problem(f"{where} ({which})", f"the folders of slot {slot.name!r} under {home}",
                                   ", ".join(outside) or slot.name, REMOVE)) from None
    return slot


def read(state_dir: Path, device: str) -> tuple[Slot | None, Slot | None]:
    """The current build and the previous one; (None, None) before the first update."""
    path = pointer(state_dir, device)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInput(problem(str(path), "JSON written by nox -s update", f"unreadable ({exc})", REMOVE)) from None
    if not isinstance(data, dict):
        raise BadInput(problem(str(path), "a JSON object written by nox -s update", type(data).__name__, REMOVE))
    prev = data.get("previous")
    return (_slot(data.get("current"), "current", path, state_dir),
            _slot(prev, "previous", path, state_dir) if prev is not None else None)


def write(state_dir: Path, device: str, current: Slot, previous: Slot | None) -> None:
    """Name ``current`` and ``previous``: one atomic rename, the switch itself."""
    def entry(s: Slot) -> dict[str, str]:
        return {k: str(v) for k, v in dataclasses.asdict(s).items()}

    data = {"current": entry(current), "previous": entry(previous) if previous else None,
            "switched": dt.datetime.now().astimezone().isoformat(timespec="seconds")}
    atomic.write_text(pointer(state_dir, device), json.dumps(data, indent=1) + "\n")


def own(vllm_dir: Path, venv_dir: Path, artifacts_dir: Path, state_dir: Path) -> Slot:
    """The checkout's own build: the variables' paths, the record in ``RIG_STATE``."""
    return Slot("", Path(vllm_dir), Path(venv_dir), Path(artifacts_dir), Path(state_dir))


def current(s: Settings, env: Mapping[str, str]) -> Settings:
    """``s`` with the current build's paths, where an update switched to a slot and the user did not name the
    paths (one read of the pointer file)."""
    if any(env.get(n) for n in VARIABLES):
        return s
    now, previous = read(s.state_dir, s.device)
    if now is None or not now.name:
        return s
    if not now.venv_dir.is_dir():
        back = "nox -s rollback switches to the previous build; " if previous else ""
        raise BadInput(problem(f"{pointer(s.state_dir, s.device)} (current)", f"slot {now.name}'s venv at "
                               f"{now.venv_dir}", "no such folder (removed by hand?)",
                               f"{back}nox -s update builds this checkout's series again beside it"))
    return place(s, now)


def settings(env: Mapping[str, str] | None = None, root: Path | None = None) -> Settings:
    """The settings of the build serving now: the environment's, with the current build's paths. What a front
    door (a command, a benchmark) calls once and hands down."""
    return current(config.settings(env, root), os.environ if env is None else env)


def place(s: Settings, slot: Slot) -> Settings:
    """``s`` with ``slot``'s paths: its tree, venv, kernels folder and record."""
    return dataclasses.replace(s, vllm_dir=slot.vllm_dir, venv_dir=slot.venv_dir, artifacts_dir=slot.artifacts_dir,
                               slot_dir=slot.record_dir if slot.name else None)


def new(state_dir: Path, device: str, tree_name: str, venv_name: str, artifacts_name: str) -> Slot:
    """A new, empty slot, its folders named as the checkout's own are (``vllm``, ``.venv`` ...)."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = Path(state_dir).resolve() / FOLDER / f"{device}-{stamp}"
    n = 1
    while root.exists():
        n += 1
        root = root.with_name(f"{device}-{stamp}-{n}")
    root.mkdir(parents=True)
    return Slot(root.name, root / tree_name, root / venv_name, root / artifacts_name, root)


def remove(slot: Slot) -> None:
    """Remove a slot's folder (never the checkout's own paths)."""
    for d in slot.folders():
        shutil.rmtree(d, ignore_errors=True)


def prune(state_dir: Path, device: str, keep: list[Slot]) -> list[str]:
    """Remove every slot of ``device`` but those in ``keep``; the names removed."""
    names = {k.name for k in keep}
    gone = []
    for d in sorted((Path(state_dir) / FOLDER).glob(f"{device}-*")):
        if d.is_dir() and d.name not in names:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d.name)
    return gone


def disk(slot: Slot) -> tuple[int, int]:
    """Bytes on disk of one build, and how many of them are files linked from elsewhere too (uv links the wheels'
    files from its cache: those cost nothing more while the cache keeps them). A file linked twice counts once."""
    seen: set[tuple[int, int]] = set()
    total = shared = 0
    for top in (slot.vllm_dir, slot.venv_dir, slot.artifacts_dir):
        for folder, _, files in os.walk(top):
            for f in files:
                try:
                    st = os.lstat(os.path.join(folder, f))
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
                    shared += st.st_blocks * 512 if st.st_nlink > 1 else 0
    return total, shared
