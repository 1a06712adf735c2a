"""The layers (docs/layers.md): a module's folder under rig/ is its layer. No import runs upward, none closes a
circle, every module lies in a layer folder, and an import inside a function says why it is there. A module named by
a string counts as an import: the front door's commands (``COMMAND_MODULES`` in rig/cli.py), a ``python -m rig.…``
target, the log writer run by its path; each must exist. The files around the rig (Dockerfile, compose, scripts,
units, READMEs, docs, benchmarks) name no ``rig.…`` module and no ``rig/…`` path that is not there."""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

import pytest
from conftest import ROOT

RIG = ROOT / "rig"
NAME = r"[a-z_][a-z0-9_]*"
#: A module by its dotted name (``rig.running.health``), not part of another word or path (``.rig``, ``vllm-rig``).
DOTTED = re.compile(rf"(?<![\w.\-/])rig(?:\.{NAME})+")
#: A path in rig/ (``rig/running/logpump.py``, ``rig/build/steps/``, ``../rig/…``), not ``.rig/`` or ``/usr/share/rig``.
PATH = re.compile(rf"(?:(?<=\./)|(?<![\w.\-/]))rig(?:/{NAME})*(?:\.py)?/?(?![\w-])")
#: What comes before a module that is started (``python -m rig.x``, ``["-m", "rig.x"]``).
STARTED = re.compile(r"""(?:-m\s+|["']-m["'],\s*["'])$""")
#: The files around the rig that name its modules (checked by test_every_module_and_path_named_around_the_rig_exists).
AROUND = ("Dockerfile", "docker-compose*.yml", ".env.example", "*.sh", "noxfile.py", "README*.md", "docs/*.md",
          "scripts/*", "systemd/*", "benchmarks/*", "rig/**/*.py", "tests/*.py")


def layer_order(root: Path = ROOT) -> list[str]:
    """The layer folders from the bottom up, as docs/layers.md's headings name them (the one place the order is
    written): ``base`` ... ``control``, then ``cli`` (rig/cli.py, the front door)."""
    text = (root / "docs" / "layers.md").read_text()
    return [m[1] for m in re.finditer(r"^## `rig/(\w+)(?:/|\.py)`", text, re.M)]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the rig by its name without the ``rig.`` prefix (``rig`` itself for the package)."""
    out = {}
    for p in (root / "rig").rglob("*.py"):
        parts = p.relative_to(root / "rig").with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name or "rig"] = p
    return out


def layer_of(name: str, order: list[str]) -> int | None:
    """A module's layer: its folder's place in the order (rig/__init__.py: the bottom); None outside the folders."""
    if name == "rig":
        return 0
    top = name.split(".")[0]
    return order.index(top) if top in order else None


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


@functools.cache
def defined(path: Path) -> frozenset[str]:
    """The names a module binds at its top level (what ``rig.x.NAME`` may name)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for n in body:
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(n.name)
            elif isinstance(n, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in n.names)
            elif isinstance(n, ast.Assign | ast.AnnAssign | ast.AugAssign):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    names.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(n, field, None)
                if isinstance(inner, list) and not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    visit([x for x in inner if isinstance(x, ast.stmt)] +
                          [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body])

    visit(ast.parse(path.read_text()).body)
    return frozenset(names)


def resolve(ref: str, mods: dict[str, Path], started: bool = False, exact: bool = False) -> str | None:
    """The module ``rig.x.y`` (or ``rig.x.y.NAME``, a name it binds) names; None where it names nothing. ``started``:
    run with ``-m``, so a module itself, a package only with its ``__main__``. ``exact``: a module, no name after."""
    parts = ref.split(".")[1:]
    for k in range(len(parts), -1, -1):
        name = ".".join(parts[:k]) or "rig"
        if name in mods:
            rest, path = parts[k:], mods[name]
            if started:
                return name if not rest and (path.name != "__init__.py" or (path.parent / "__main__.py").exists()) \
                    else None
            return name if not rest or (not exact and rest[0] in defined(path)) else None
    return None


def _str(n: ast.AST) -> str | None:
    return n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None


def _path_parts(n: ast.AST) -> list[str | None]:
    """``a / "b" / "c"`` -> [None, "b", "c"] (None: not a string)."""
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
        return _path_parts(n.left) + _path_parts(n.right)
    return [_str(n)]


def rig_links(path: Path, mods: dict[str, Path], root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(module, line, as written) for each module ``path`` names by a string: a whole string ``rig.x.y`` (the front
    door's COMMAND_MODULES, what ``-m`` runs), ``-m rig.x`` in a string, a file ``"rig" / ... / "x.py"`` or
    ``"rig/x/y.py"``. The module is "" where the string names none. Docstrings are prose, not links."""
    tree = ast.parse(path.read_text())
    prose = {id(b.body[0].value) for b in ast.walk(tree)
             if isinstance(b, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
             and b.body and isinstance(b.body[0], ast.Expr) and _str(b.body[0].value) is not None}
    by_path = {p.relative_to(root).as_posix(): m for m, p in mods.items()}
    found = set()
    for n in ast.walk(tree):
        refs: list[tuple[str, str]] = []  # (as written, how: "module", "started" or "file")
        if _str(n) is not None and id(n) not in prose:
            if re.fullmatch(rf"rig(?:\.{NAME})+", n.value):
                refs.append((n.value, "module"))
            refs += [(m[1], "started") for m in re.finditer(rf"-m\s+(rig(?:\.{NAME})+)", n.value)]
            if re.fullmatch(rf"rig(?:/{NAME})+\.py", n.value):
                refs.append((n.value, "file"))
        elif isinstance(n, ast.List | ast.Tuple):
            refs += [(_str(b), "started") for a, b in zip(n.elts, n.elts[1:], strict=False)
                     if _str(a) == "-m" and (_str(b) or "").startswith("rig.")]
        elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            parts = _path_parts(n)
            if "rig" in parts and (parts[-1] or "").endswith(".py") and None not in parts[parts.index("rig"):]:
                refs.append(("/".join(parts[parts.index("rig"):]), "file"))
        for ref, how in refs:
            target = by_path.get(ref, "") if how == "file" else \
                resolve(ref, mods, started=how == "started", exact=True) or ""
            found.add((target, n.lineno, ref))
    return sorted(found, key=lambda f: (f[1], f[2]))


def build_graph(root: Path = ROOT):
    """(layer of each module, its imports, its links by string) for the rig under ``root``."""
    mods, order = modules(root), layer_order(root)
    return ({m: layer_of(m, order) for m in mods}, {m: rig_imports(m, p, set(mods)) for m, p in mods.items()},
            {m: [link for link in rig_links(p, mods, root) if link[0] != m] for m, p in mods.items()})


def upward(layers, imports, links) -> list[str]:
    edges = [(m, t, line, "imports") for m, found in imports.items() for t, line, _, _ in found] + \
            [(m, t, line, "names") for m, found in links.items() for t, line, _ in found]
    return [f"{_file(m)}: line {line} {how} {t} (layer {layers[t]} above {layers[m]})" for m, t, line, how in edges
            if t and layers[m] is not None and layers[t] is not None and layers[t] > layers[m]]


def _file(m: str) -> str:
    return "rig/__init__.py" if m == "rig" else f"rig/{m.replace('.', '/')}"


@pytest.fixture(scope="module")
def graph():
    return build_graph()


def test_the_order_is_read_and_every_module_lies_in_a_layer_folder(graph):
    layers, _, _ = graph
    order = layer_order()
    assert len(order) == 8 and order[-1] == "cli", f"docs/layers.md's headings name the layers: {order}"
    assert [f for f in order[:-1] if not (RIG / f / "__init__.py").exists()] == []
    assert [_file(m) for m, n in sorted(layers.items()) if n is None] == [], "move these into a layer folder"


def test_no_import_runs_upward(graph):
    assert upward(*graph) == []


def test_every_module_named_by_a_string_exists(graph):
    _, _, links = graph
    assert [f"{_file(m)}: line {line} names {ref}" for m, found in links.items() for t, line, ref in found
            if not t] == []


def test_the_front_door_names_every_module_it_imports_in_one_place():
    """cli imports its commands' modules lazily, through COMMAND_MODULES only (so the links above see them all)."""
    tree = ast.parse((RIG / "cli.py").read_text())
    table = next(n.value for n in tree.body if isinstance(n, ast.AnnAssign | ast.Assign)
                 and "COMMAND_MODULES" in [t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target])])
    keys = {_str(k) for k in table.keys}
    assert None not in keys and all(_str(v) for v in table.values)
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "_use"]
    assert uses and [ast.unparse(n) for n in uses if len(n.args) != 1 or _str(n.args[0]) not in keys] == []
    for path in sorted(RIG.rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and ast.unparse(n.func) in ("importlib.import_module", "import_module",
                                                                     "__import__"):
                arg = ast.unparse(n.args[0]) if n.args else ""
                assert _str(n.args[0]) or (path.name == "cli.py" and arg.startswith("COMMAND_MODULES[")), \
                    f"{path.relative_to(ROOT)}:{n.lineno} imports {arg}: name the module by a string"


def test_no_import_closes_a_circle(graph):
    _, imports, links = graph
    edges = {m: {t for t, *_ in found if t} | {t for t, *_ in links[m] if t} for m, found in imports.items()}
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
    _, imports, _ = graph
    bare = [f"{_file(m)}:{line} {t or '(not the rig)'}" for m, found in imports.items()
            for t, line, inner, reason in found if inner and not reason]
    assert bare == []


def test_the_checker_sees_an_upward_import_and_a_circle(tmp_path, monkeypatch):
    """The checks above could fail: on a made-up pair of modules they do."""
    (tmp_path / "low.py").write_text("from rig import high  # a reason\n")
    (tmp_path / "high.py").write_text("def f():\n    from rig import low\n")
    names = {"low", "high"}
    low, high = rig_imports("low", tmp_path / "low.py", names), rig_imports("high", tmp_path / "high.py", names)
    assert low == [("high", 1, False, True)] and high == [("low", 2, True, False)]


# -- what the files around the rig name -------------------------------------------------------------------------


def files_around(root: Path = ROOT) -> list[Path]:
    """The files that name the rig's modules and paths (this file's own examples left out)."""
    out = {p for pattern in AROUND for p in root.glob(pattern) if p.is_file()}
    return sorted(out - {root / "tests" / "test_layers.py"})


def _prose_spans(text: str) -> list[tuple[int, int]]:
    """Where a Python file's strings and comments are (its code is not prose: ``rig.returncode`` may be a variable)."""
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    kinds = {tokenize.STRING, tokenize.COMMENT} | {v for k, v in tokenize.tok_name.items() if k == "FSTRING_MIDDLE"}
    return [(starts[t.start[0] - 1] + t.start[1], starts[t.end[0] - 1] + t.end[1])
            for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type in kinds]


def stale_names(root: Path = ROOT, files: list[Path] | None = None) -> list[str]:
    """Each ``rig.…`` module (``python -m rig.x``, ``rig.x.y`` in a command or a sentence) and each ``rig/…`` path
    the files around the rig name that does not exist, as ``file:line: what``."""
    mods, out = modules(root), []
    for f in files_around(root) if files is None else files:
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        spans = _prose_spans(text) if f.suffix == ".py" else [(0, len(text))]
        rel = f.relative_to(root)
        for a, b in spans:
            for m in DOTTED.finditer(text, a, b):
                if resolve(m[0], mods, started=bool(STARTED.search(text, max(0, m.start() - 12), m.start()))) is None:
                    out.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m[0]}")
            for m in PATH.finditer(text, a, b):
                if not (root / m[0]).exists():
                    out.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m[0]}")
        if f.suffix == ".py":
            for n in ast.walk(ast.parse(text)):
                names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                    [f"{n.module}.{a.name}" for a in n.names] if isinstance(n, ast.ImportFrom) and not n.level and \
                    (n.module or "").split(".")[0] == "rig" else []
                out += [f"{rel}:{n.lineno}: import {name}" for name in names
                        if name.split(".")[0] == "rig" and resolve(name, mods) is None]
    return out


def test_every_module_and_path_named_around_the_rig_exists():
    assert stale_names() == []


def test_the_checkers_see_a_bad_path_a_bad_link_and_an_upward_import(tmp_path):
    """On a made-up rig: an import from a higher folder, a command whose module is not there, a ``-m`` target and
    a path that do not exist, and a module outside the layer folders are each found."""
    rig = tmp_path / "rig"
    files = {"__init__.py": "", "base/__init__.py": "", "base/low.py": "from rig.control import high  # why\n",
             "control/__init__.py": "", "control/high.py": "from rig.base import low\n", "stray.py": "",
             "cli.py": 'COMMAND_MODULES = {"a": "rig.control.high", "b": "rig.control.gone"}\n'
                       'ARGV = ["python", "-m", "rig.base.low", "-m", "rig.base.nosuch"]\n'}
    for rel, text in files.items():
        (rig / rel).parent.mkdir(parents=True, exist_ok=True)
        (rig / rel).write_text(text)
    (tmp_path / "docs").mkdir()
    order = ["base", "facts", "build", "plan", "running", "nodes", "control", "cli"]
    (tmp_path / "docs" / "layers.md").write_text("".join(f"## `rig/{f}/`\n" for f in order[:-1]) + "## `rig/cli.py`\n")
    doc = tmp_path / "docs" / "x.md"
    doc.write_text("`python -m rig.base.low` and rig/base/low.py are there;\n"
                   "`python -m rig.base.gone`, rig.control.high.nothing and rig/base/gone.py are not.\n"
                   "Nor are .rig/x, vllm-rig/x or /usr/share/rig/x the rig's.\n")
    layers, imports, links = build_graph(tmp_path)
    assert upward(layers, imports, links) == ["rig/base/low: line 1 imports control.high (layer 6 above 0)"]
    assert [ref for found in links.values() for t, _, ref in found if not t] == ["rig.control.gone", "rig.base.nosuch"]
    assert [m for m, n in layers.items() if n is None] == ["stray"]
    assert stale_names(tmp_path, [doc]) == ["docs/x.md:2: rig.base.gone", "docs/x.md:2: rig.control.high.nothing",
                                            "docs/x.md:2: rig/base/gone.py"]


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
