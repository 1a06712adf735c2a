"""The layer map (docs/layers.md) holds: no import runs upward, none closes a circle, every module is placed, and
an import inside a function says why it is there."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest
from conftest import ROOT

RIG = ROOT / "rig"


def layer_table() -> dict[str, int]:
    """Module pattern -> layer, from the table in docs/layers.md (the one place the map is written)."""
    table = {}
    for line in (ROOT / "docs" / "layers.md").read_text().splitlines():
        m = re.match(r"^\| (\d+) \| [^|]+ \| (.+) \|$", line)
        if m:
            for pattern in re.findall(r"`([^`]+)`", m[2]):
                table[pattern] = int(m[1])
    return table


def modules() -> dict[str, Path]:
    """Every module of the rig by its name without the ``rig.`` prefix (``rig`` itself for the package)."""
    out = {}
    for p in RIG.rglob("*.py"):
        parts = p.relative_to(RIG).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name or "rig"] = p
    return out


def layer_of(name: str, table: dict[str, int]) -> int | None:
    hits = {layer for pattern, layer in table.items() if fnmatch.fnmatchcase(name, pattern)}
    assert len(hits) <= 1, f"{name} matches the patterns of layers {sorted(hits)}"
    return hits.pop() if hits else None


def rig_imports(name: str, path: Path, names: set[str]) -> list[tuple[str, int, bool, bool]]:
    """(imported module, line, inside a function, has a reason) for each import of a rig module."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    inner: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            inner.update(id(n) for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".") if package and package != "rig" else []
                up = up[: len(up) - node.level + 1] if node.level > 1 else up
                base = ".".join(["rig", *up, *([base] if base else [])])
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        reason = _has_reason(lines, node.lineno - 1)
        for t in targets:
            if t != "rig" and not t.startswith("rig."):
                if id(node) in inner:
                    found.append(("", node.lineno, True, reason))  # a third-party or standard import in a function
                continue
            t = t.removeprefix("rig.") if t != "rig" else "rig"
            while t not in names and "." in t:
                t = t.rpartition(".")[0]
            if t in names and t != name:
                found.append((t, node.lineno, id(node) in inner, reason))
    return found


def _has_reason(lines: list[str], i: int) -> bool:
    """A comment on the import's line, or above it in the run of imports and comments it belongs to."""
    if "#" in lines[i]:
        return True
    while i > 0 and lines[i - 1].strip().startswith(("import ", "from ", "#")):
        i -= 1
        if lines[i].strip().startswith("#") or "#" in lines[i]:
            return True
    return False


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, int], dict[str, list[tuple[str, int, bool, bool]]]]:
    table, mods = layer_table(), modules()
    return {m: layer_of(m, table) for m in mods}, {m: rig_imports(m, p, set(mods)) for m, p in mods.items()}


def test_the_table_is_read_and_places_every_module(graph):
    layers, _ = graph
    assert len(set(layer_table().values())) == 8
    assert [m for m, n in sorted(layers.items()) if n is None] == [], "add these to docs/layers.md's table"


def test_no_import_runs_upward(graph):
    layers, imports = graph
    upward = [f"rig/{m.replace('.', '/')}: line {line} imports {t} (layer {layers[t]} above {layers[m]})"
              for m, found in imports.items() for t, line, _, _ in found
              if t and layers[m] is not None and layers[t] is not None and layers[t] > layers[m]]
    assert upward == []


def test_no_import_closes_a_circle(graph):
    _, imports = graph
    edges = {m: {t for t, *_ in found if t} for m, found in imports.items()}
    circles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                circles.append(" -> ".join(path[path.index(t):] + [m, t]) if t in path else f"{m} -> {t}")
            elif t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert circles == []


def test_an_import_inside_a_function_says_why(graph):
    _, imports = graph
    bare = [f"rig/{m.replace('.', '/')}:{line} {t or '(not the rig)'}" for m, found in imports.items()
            for t, line, inner, reason in found if inner and not reason]
    assert bare == []


def test_the_checker_sees_an_upward_import_and_a_circle(tmp_path, monkeypatch):
    """The checks above could fail: on a made-up pair of modules they do."""
    (tmp_path / "low.py").write_text("from rig import high  # a reason\n")
    (tmp_path / "high.py").write_text("def f():\n    from rig import low\n")
    names = {"low", "high"}
    low, high = rig_imports("low", tmp_path / "low.py", names), rig_imports("high", tmp_path / "high.py", names)
    assert low == [("high", 1, False, True)] and high == [("low", 2, True, False)]


# -- one voice ---------------------------------------------------------------------------------------------------

ERRORS = ("BadInput", "WorkFailed", "Refused", "RigError")
#: Runs before the rig exists (standard library only, its own usage line): the one print outside console.py.
PRINTS_ON_ITS_OWN = {"console.py", "logpump.py"}


def voice_breaks(path: Path) -> list[str]:
    """A print() outside console.py, and an error raised with text written on the spot instead of problem()'s
    item, expected, found and fix (a variable or a join of problems passes: problem() made them)."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Call) and path.name not in PRINTS_ON_ITS_OWN and \
                ast.unparse(n.func) in ("sys.stdout.write", "sys.stderr.write"):
            out.append(f"{path.name}:{n.lineno} {ast.unparse(n.func)}()")
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
            continue
        if n.func.id == "print" and path.name not in PRINTS_ON_ITS_OWN:
            out.append(f"{path.name}:{n.lineno} print()")
        if n.func.id in ERRORS and n.args and isinstance(n.args[0], ast.JoinedStr | ast.Constant):
            out.append(f"{path.name}:{n.lineno} {n.func.id} with free text")
    return out


def test_one_voice_every_message_through_console_and_every_refusal_through_problem():
    assert [b for p in sorted(RIG.rglob("*.py")) for b in voice_breaks(p)] == []


def test_the_voice_check_sees_a_print_and_free_text(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("print('hi')\nraise WorkFailed(f'it broke: {x}')\nraise BadInput(problem('a', 'b', 'c', 'd'))\n"
                   "sys.stderr.write('x')\n")
    assert voice_breaks(bad) == ["bad.py:1 print()", "bad.py:2 WorkFailed with free text",
                                 "bad.py:4 sys.stderr.write()"]


# -- small pieces ------------------------------------------------------------------------------------------------

MODULE_LINES, FUNCTION_LINES = 450, 60


def sizes(root: Path) -> list[str]:
    """Modules over MODULE_LINES lines and functions over FUNCTION_LINES, as ``path: what``."""
    out = []
    for p in sorted(root.rglob("*.py")):
        text = p.read_text()
        if (n := len(text.splitlines())) > MODULE_LINES:
            out.append(f"{p.relative_to(root)}: {n} lines")
        for f in ast.walk(ast.parse(text)):
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.end_lineno - f.lineno >= FUNCTION_LINES:
                out.append(f"{p.relative_to(root)}: {f.name}() {f.end_lineno - f.lineno + 1} lines")
    return out


def test_no_module_over_450_lines_and_no_function_over_60():
    assert sizes(RIG) == []


def test_the_size_check_sees_a_long_function(tmp_path):
    (tmp_path / "long.py").write_text("def f():\n" + "    x = 1\n" * 60)
    assert sizes(tmp_path) == ["long.py: f() 61 lines"]
