"""The container build's own commands, so the Dockerfile stays a list of calls into the rig.

* ``fact NAME`` / ``target``: what a kernels tarball must have been built for, read from this
  tree's build record and venv: OPS_OBJ, CPython minor, CUDA major, torch. Standard library
  only, like the ``python3 -m rig.artifacts verify`` they feed.
* ``adopt --artifacts DIR``: after verify has installed the kernels of ``artifacts/`` into the
  tree, record them as the ops step's products and install vllm editable without compiling, so
  ``./build.sh`` then finds the ops step current and runs only the install step's import check.
  It needs the rig's dependencies: ``uv run --no-project --with-editable . python3 -m rig.container
  adopt ...``.

  python3 -m rig.container --help
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from rig import config
from rig.console import say
from rig.errors import BadInput, RigError, WorkFailed, problem

FACTS = ("ops_obj", "arch", "python", "cuda", "torch")
#: rig.steps.pipeline.record_path, not imported: that module needs tomli-w.
RECORD = "build.toml"
FIRST = "./build.sh --only tools,tree,venv,runtime,toolchain"


def record_path(s: config.Settings) -> Path:
    return s.state_dir / RECORD


def _outputs(record: dict, step: str, key: str, s: config.Settings) -> str:
    value = record.get("steps", {}).get(step, {}).get("outputs", {}).get(key)
    if not value:
        raise BadInput(problem(f"{record_path(s)}: the {step} step's {key}", "recorded", "none",
                               f"run {FIRST} first"))
    return str(value)


def venv_minor(venv: Path) -> str | None:
    """``3.13`` from the venv's pyvenv.cfg (uv writes ``version_info``, ``python -m venv`` ``version``)."""
    try:
        m = re.search(r"^(?:version|version_info)\s*=\s*(\d+\.\d+)", (venv / "pyvenv.cfg").read_text(), re.M)
    except FileNotFoundError:
        return None
    return m[1] if m else None


def installed_version(venv: Path, minor: str, name: str) -> str | None:
    """A distribution's version from its ``.dist-info`` folder name, as the runtime step reads it."""
    for d in sorted((venv / "lib" / f"python{minor}" / "site-packages").glob(f"{name}-*.dist-info")):
        return d.name[len(name) + 1:-len(".dist-info")]
    return None


def target(s: config.Settings) -> dict[str, str]:
    """The target verify checks a tarball against: this tree, this venv, ``ARCH``."""
    try:
        record = tomllib.loads(record_path(s).read_text())
    except (FileNotFoundError, tomllib.TOMLDecodeError):
        raise BadInput(problem(f"the build record {record_path(s)}", "the record of steps 1-5", "none or unreadable",
                               f"run {FIRST} first")) from None
    minor = venv_minor(s.venv_dir)
    if minor is None:
        raise BadInput(problem(f"the venv {s.venv_dir}", "a venv with pyvenv.cfg", "none", f"run {FIRST} first"))
    torch = installed_version(s.venv_dir, minor, "torch")
    if torch is None:
        raise BadInput(problem(f"torch in {s.venv_dir}", "installed", "none", f"run {FIRST} first"))
    return {"ops_obj": _outputs(record, "tree", "ops_obj", s), "arch": s.arch, "python": minor,
            "cuda": _outputs(record, "toolchain", "torch_cuda", s).split(".")[0], "torch": torch}


def adopt(s: config.Settings, artifacts_dir: Path) -> int:
    """Record the verified kernels as the ops step's products and install vllm without compiling."""
    from rig import artifacts, products
    from rig.steps import pipeline
    from rig.steps.install import installed_vllm
    from rig.steps.ops import OpsStep

    manifest = artifacts.read_manifest(artifacts_dir / artifacts.MANIFEST)
    listed = artifacts.read_sums(artifacts_dir / artifacts.SUMS)
    ctx = pipeline.Context(s, pipeline.Options(), pipeline.load_record(s))
    # The facts the ops step itself compares, so that it finds these kernels current.
    facts, route, why = OpsStep()._facts(ctx)
    if manifest["route"] != route:
        raise BadInput(problem(f"{artifacts_dir / artifacts.MANIFEST}: route", f"{route!r} ({why})",
                               repr(manifest["route"]), f"build the image with --build-arg "
                               f"OPS_ROUTE={manifest['route']}, or pack again with the route the image takes"))
    _install_editable(s, ctx, facts["version"])
    version, wrong = installed_vllm(s)
    if wrong:
        raise WorkFailed(f"after the editable install: {wrong}. Fix: remove {s.venv_dir} and build again")
    rec = products.collect(s.vllm_dir, {**facts, "log": "", "from_artifacts": manifest["tarball_sha256"]})
    extra = sorted(set(rec.files) - set(listed))
    missing = sorted(set(listed) - set(rec.files))
    changed = sorted(n for n in set(rec.files) & set(listed) if rec.files[n]["sha256"] != listed[n])
    if extra or missing or changed:
        first = (f"{extra[0]} is in the tree but not in {artifacts.SUMS}" if extra else
                 f"{missing[0]} is in {artifacts.SUMS} but not in the tree" if missing else
                 f"{changed[0]} differs from {artifacts.SUMS}")
        raise BadInput(f"{s.vllm_dir}: the products are not the verified kernels: {first}. Fix: build from a "
                       "fresh tree (nothing but verify may add files under vllm/vllm/)")
    products.write(s.vllm_dir, rec)
    say(f"adopted {len(rec.files)} verified products for OPS_OBJ {facts['ops_obj'][:12]} ({route}), "
        f"recorded in {s.vllm_dir / products.RECORD}; vllm {version} installed editable, nothing compiled")
    return len(rec.files)


def _install_editable(s: config.Settings, ctx, version: str) -> None:
    """``pip install -e`` of the tree with ``VLLM_TARGET_DEVICE=empty``: vLLM's setup.py then builds no extension."""
    from rig.gitutil import Git
    from rig.steps.ops import build_env
    from rig.steps.venv import venv_python

    env = build_env(s, ctx, "precompiled", version, None)
    for key in ("VLLM_USE_PRECOMPILED", "VLLM_PRECOMPILED_WHEEL_LOCATION"):
        env.pop(key, None)  # the kernels are in the tree already; nothing is to be copied over them
    env["VLLM_TARGET_DEVICE"] = "empty"
    cmd = [str(venv_python(s)), "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-cache-dir",
           "-e", str(s.vllm_dir)]
    say(f"installing vllm editable, no extension built: {' '.join(cmd[2:])}")
    r = subprocess.run(cmd, env=env, cwd=s.vllm_dir, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stdout + r.stderr).strip().splitlines()[-15:]
        raise WorkFailed(f"the editable install of {s.vllm_dir} failed (exit {r.returncode}): "
                         + " | ".join(tail))
    repo = Git(s.vllm_dir)  # setup.py rewrites the tracked vllm/_version.py; keep the tree as the series made it
    if "vllm/_version.py" in repo.tracked_changes():
        repo.run("checkout", "--", "vllm/_version.py")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m rig.container", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fact", help="one fact of the target verify checks a tarball against")
    f.add_argument("name", choices=FACTS)
    sub.add_parser("target", help="every fact of that target, one 'name: value' a line")
    a = sub.add_parser("adopt", help="record the verified kernels as the ops step's products (needs the rig's "
                       "dependencies)")
    a.add_argument("--artifacts", type=Path, required=True, help="the folder verify checked (manifest, sums list)")
    args = ap.parse_args(argv)
    try:
        s = config.settings()
        if args.cmd == "adopt":
            adopt(s, args.artifacts)
            return 0
        t = target(s)
        print(t[args.name] if args.cmd == "fact" else "\n".join(f"{k}: {v}" for k, v in t.items()))
    except RigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
