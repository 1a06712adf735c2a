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
from pathlib import Path

from rig import config
from rig.console import guard, say
from rig.errors import BadInput, WorkFailed, problem

FACTS = ("device", "ops_obj", "arch", "python", "cuda", "torch", "expect")


def target(s: config.Settings) -> dict[str, str]:
    """The target verify checks a tarball against: this tree, this venv, ``ARCH`` (rig/kernels/target.py), and
    ``expect``, the list of this tree's kernels the tarball must hold (empty when none is known)."""
    from rig import record
    from rig.kernels.target import expected, of_build

    rec = record.load(s.state_dir, s.device)
    return {**of_build(s, rec).as_dict(), "expect": str(expected(s, rec) or "")}


def adopt(s: config.Settings, artifacts_dir: Path) -> int:
    """Record the verified kernels as the ops step's products and install vllm without compiling."""
    from rig import artifacts, products, venvs
    from rig.kernels import pip, route
    from rig.steps import pipeline

    manifest = artifacts.read_manifest(artifacts_dir / artifacts.MANIFEST)
    listed = artifacts.read_sums(artifacts_dir / artifacts.SUMS)
    ctx = pipeline.context(s)
    rec = ctx.record
    # The facts the ops step itself compares, so that it finds these kernels current.
    facts, way, why = route.facts(s, rec, ctx.series)
    if manifest["route"] != way:
        raise BadInput(problem(f"{artifacts_dir / artifacts.MANIFEST}: route", f"{way!r} ({why})",
                               repr(manifest["route"]), f"build the image with --build-arg "
                               f"OPS_ROUTE={manifest['route']}, or pack again with the route the image takes"))
    say("installing vllm editable, no extension built (the verified kernels are in the tree already)")
    pip.install(s, rec, "none", facts["version"], None, "editable install")
    version, wrong = venvs.installed_vllm(s.venv_dir, s.vllm_dir)
    if wrong:
        raise WorkFailed(f"after the editable install: {wrong}. Fix: remove {s.venv_dir} and build again")
    got = products.collect(s.vllm_dir, {**facts, "log": "", "from_artifacts": manifest["tarball_sha256"]})
    extra = sorted(set(got.files) - set(listed))
    missing = sorted(set(listed) - set(got.files))
    changed = sorted(n for n in set(got.files) & set(listed) if got.files[n]["sha256"] != listed[n])
    if extra or missing or changed:
        first = (f"{extra[0]} is in the tree but not in {artifacts.SUMS}" if extra else
                 f"{missing[0]} is in {artifacts.SUMS} but not in the tree" if missing else
                 f"{changed[0]} differs from {artifacts.SUMS}")
        raise BadInput(f"{s.vllm_dir}: the products are not the verified kernels: {first}. Fix: build from a "
                       "fresh tree (nothing but verify may add files under vllm/vllm/)")
    products.write(s.vllm_dir, got)
    say(f"adopted {len(got.files)} verified products for OPS_OBJ {facts['ops_obj'][:12]} ({way}), "
        f"recorded in {s.vllm_dir / products.RECORD}; vllm {version} installed editable, nothing compiled")
    return len(got.files)


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
    def go() -> int:
        s = config.settings()
        if args.cmd == "adopt":
            adopt(s, args.artifacts)
            return 0
        t = target(s)
        print(t[args.name] if args.cmd == "fact" else "\n".join(f"{k}: {v}" for k, v in t.items()))
        return 0

    return guard(go)


if __name__ == "__main__":
    raise SystemExit(main())
