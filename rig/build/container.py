"""The image build's own commands: the Dockerfile runs them as ``python3 -m rig.build.container`` (so a ``__main__``).

The Dockerfile stays a list of calls into the rig:

* ``target``: what a kernels tarball must have been built for (rig/build/kernels/target.py), read
  from this tree's build record and venv: device, OPS_OBJ, architectures, CPython minor, CUDA
  major, torch, and the list of this tree's kernels. Standard library only.
* ``verify --artifacts DIR``: that target, and the tarball of ``DIR`` checked against it and
  installed into the tree (rig/build/verify.py), in one process. Standard library only (plus the
  ``zstd`` program), like everything this module imports: the image's python3 runs it before
  the rig's dependencies are installed.
* ``adopt --artifacts DIR``: after verify has installed the kernels of ``DIR`` into the tree,
  record them as the ops step's products and install vllm editable without compiling, so
  ``./build.sh`` then finds the ops step current and runs only the install step's import check.
  It writes TOML, so it needs the rig's dependencies: ``uv run --no-project --with-editable .
  python3 -m rig.build.container adopt ...``.

  python3 -m rig.build.container --help
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rig.base import venvs
from rig.base.console import guard, plain, say
from rig.base.errors import BadInput, WorkFailed, problem
from rig.build import artifacts, verify
from rig.build.kernels import pip, route, target
from rig.facts import config, products, record, series, slots


def show(s: config.Settings) -> dict[str, str]:
    """The target as the ``target`` command prints it: its facts, and ``expect``, where this tree's kernels are
    listed (empty when none is known)."""
    kt = target.of_build(s, record.load(s.record_dir, s.device))
    return {**kt.facts(), "expect": kt.expected.source if kt.expected else ""}


def verify_tarball(s: config.Settings, artifacts_dir: Path) -> int:
    """Check the tarball of ``artifacts_dir`` against this tree's target and install it into the tree."""
    kt = target.of_build(s, record.load(s.record_dir, s.device))
    n, against = verify.verify(artifacts_dir, kt.vllm_dir, kt.checks(), kt.expected, say=say)
    plain(f"verified and installed {n} files into {kt.vllm_dir}; the file set checked against {against}")
    return n


def adopt(s: config.Settings, artifacts_dir: Path) -> int:
    """Record the verified kernels as the ops step's products and install vllm without compiling."""
    manifest = artifacts.read_manifest(artifacts_dir / artifacts.MANIFEST)
    listed = artifacts.read_sums(artifacts_dir / artifacts.SUMS)
    rec = record.load(s.record_dir, s.device)
    # The facts the ops step itself compares, so that it finds these kernels current.
    facts, way, why = route.facts(s, rec, series.load(s.patches_dir))
    if manifest["route"] != way:
        raise BadInput(problem(f"{artifacts_dir / artifacts.MANIFEST}: route", f"{way!r} ({why})",
                               repr(manifest["route"]), f"build the image with OPS_ROUTE={manifest['route']} "
                               "scripts/nox.sh -s image (a --build-arg of the same name to the builder), or pack "
                               "again with the route the image takes"))
    say("installing vllm editable, no extension built (the verified kernels are in the tree already)")
    pip.install(s, rec, "none", facts["version"], None, "editable install")
    version, wrong = venvs.installed_vllm(s.venv_dir, s.vllm_dir)
    if wrong:
        raise WorkFailed(problem(f"vllm in {s.venv_dir} after the editable install", f"vllm {facts['version']} "
                                 f"from {s.vllm_dir}", wrong, f"remove {s.venv_dir} and build again"))
    got = products.collect(s.vllm_dir, {**facts, "log": "", "from_artifacts": manifest["tarball_sha256"]})
    extra = sorted(set(got.files) - set(listed))
    missing = sorted(set(listed) - set(got.files))
    changed = sorted(n for n in set(got.files) & set(listed) if got.files[n]["sha256"] != listed[n])
    if extra or missing or changed:
        first = (f"{extra[0]} is in the tree but not in {artifacts.SUMS}" if extra else
                 f"{missing[0]} is in {artifacts.SUMS} but not in the tree" if missing else
                 f"{changed[0]} differs from {artifacts.SUMS}")
        raise BadInput(problem(f"{s.vllm_dir}: the products", "the verified kernels", first, "build from a fresh "
                               "tree (nothing but verify may add files under vllm/vllm/)"))
    products.write(s.vllm_dir, got)
    say(f"adopted {len(got.files)} verified products for OPS_OBJ {facts['ops_obj'][:12]} ({way}), "
        f"recorded in {s.vllm_dir / products.RECORD}; vllm {version} installed editable, nothing compiled")
    return len(got.files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m rig.build.container", description="The image build's own commands: "
                                 "the kernel target, verify against it, and adopting the verified kernels.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("target", help="the target verify checks a tarball against, one 'name: value' a line")
    v = sub.add_parser("verify", help="check a kernels tarball against this tree's target and install it "
                       "(standard library only)")
    a = sub.add_parser("adopt", help="record the verified kernels as the ops step's products (needs the rig's "
                       "dependencies)")
    for p in (v, a):
        p.add_argument("--artifacts", type=Path, required=True, help="the folder with manifest.toml, ops.sha256 "
                       "and the tarball")
    args = ap.parse_args(argv)

    def go() -> int:
        s = slots.settings()
        if args.cmd == "adopt":
            adopt(s, args.artifacts)
        elif args.cmd == "verify":
            verify_tarball(s, args.artifacts)
        else:
            plain("\n".join(f"{k}: {v}" for k, v in show(s).items()))
        return 0

    return guard(go)


if __name__ == "__main__":
    raise SystemExit(main())
