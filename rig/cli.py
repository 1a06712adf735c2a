"""The front door: one table of the rig's commands, and one ``main`` that runs any of them through one guard.

Each row names the command, its program name and description, its arguments, and what it does: a few lines that
hand the parsed arguments to the module that does the work. That module is imported when its command runs
(``_use``), so a no-op ``./build.sh`` imports the build side only, never the serve side, NVML or an HTTP client.
The nox sessions (noxfile.py) and ``python -m rig.cli COMMAND`` (the bench's own venv) both come in here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from rig.base.console import guard, plain, say
from rig.base.errors import BadInput, problem
from rig.facts import config, slots

Args = argparse.Namespace


#: Every module the commands use, by its full dotted name: the one place the front door names them. ``_use``
#: imports one when its command runs (a no-op ./build.sh never imports the serve side); tests/test_layers.py
#: reads these names as imports of this module, so each must exist and none may sit above.
COMMAND_MODULES: dict[str, str] = {
    "bench": "rig.control.bench", "buildlock": "rig.build.buildlock", "bundle": "rig.build.bundle",
    "bundlewrite": "rig.control.bundlewrite", "control": "rig.control.control", "image": "rig.build.image",
    "logview": "rig.control.logview", "netif": "rig.base.netif", "patches": "rig.build.patches",
    "profiles": "rig.facts.profiles", "raycluster": "rig.nodes.raycluster", "report": "rig.control.report",
    "service": "rig.control.service",
    "start": "rig.control.start", "steps.order": "rig.build.steps.order", "steps.pack": "rig.build.steps.pack",
    "steps.pipeline": "rig.build.steps.pipeline", "steps.runtime": "rig.build.steps.runtime",
    "update": "rig.control.update",
}


def _use(module: str) -> ModuleType:
    """The module a command needs (its key in COMMAND_MODULES), imported when that command runs (see the module's
    docstring)."""
    return importlib.import_module(COMMAND_MODULES[module])


@dataclass(frozen=True)
class Command:
    """One command: how it is called, what it says about itself, and what it does."""

    prog: str
    description: str
    does: Callable[[Args], int]
    arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None
    epilog: Callable[[], str] = lambda: _variables(with_meaning=False)
    parse: bool = True  # False: the command parses its own arguments (``args``: the list as given)

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=self.prog, description=self.description, epilog=self.epilog(),
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        self.arguments(p)
        return p


def _variables(with_meaning: bool) -> str:
    lines = ["variables (from the environment):"]
    for v in config.VARS:
        meaning = f": {v.meaning.replace('`', '')}" if with_meaning else ""
        lines.append(f"  {v.name:24} default {v.default.replace('`', '')}{meaning}")
    return "\n".join(lines)


def _steps_and_variables() -> str:
    """The build's help: its steps in order, then every variable with its meaning."""
    steps = _use("steps.order").steps()
    lines = ["steps:", *(f"  {n}. {st.name:10} {st.summary}" for n, st in enumerate(steps, 1)), ""]
    return "\n".join(lines) + _variables(with_meaning=True)


# -- the build ---------------------------------------------------------------------------------------------------


def _step_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _build_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", type=_step_list, metavar="STEP[,STEP]",
                   help="run only these steps; the steps they need are checked, not re-run")
    p.add_argument("--force", action="store_true", help="run the steps even when they are current")
    p.add_argument("--accept", action="store_true",
                   help="tree step: record the tree the series builds as the expected one in series.toml")
    p.add_argument("--verify", action="store_true", help="re-hash the build products instead of the fast check")
    p.add_argument("--no-pack", action="store_true", help="skip step 8, the kernel pack (PACK=0)")
    p.add_argument("--pre-start", action="store_true",
                   help="the service's ExecStartPre: once an update or rollback has switched builds, the build it "
                   "switched to is served as built (a new series is built beside it by the update), else as without")


def _tree_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accept", action="store_true",
                   help="record the tree the series builds as the expected one in series.toml")
    p.add_argument("--force", action="store_true", help="re-apply the series even when the tree is current")


def _pack_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="pack again even when artifacts/ is current")
    p.add_argument("--verify", action="store_true", help="re-hash the tarball when checking artifacts/")
    p.add_argument("--offline", type=Path, metavar="DIR", help="then write the offline bundle into DIR: the tree, "
                   "the kernels, the wheels, uv and nox, for OFFLINE=DIR ./build.sh on a box with no network")
    p.add_argument("--part-size", metavar="SIZE", help="with --offline: no file larger than SIZE (50M, 1G): big ones "
                   "are cut into parts, joined again when the bundle is opened")
    p.add_argument("--python", metavar="X.Y", help="with --offline: the offline box's CPython minor (default: this "
                   "venv's), whose wheels the bundle carries")


def _pack(a: Args) -> int:
    if (a.part_size or a.python) and not a.offline:
        raise BadInput(problem("--part-size/--python", "given with --offline DIR", "without it",
                               "add --offline DIR, or drop them"))
    size = _use("bundle").parse_size(a.part_size) if a.part_size else None
    _steps("pack", ["pack"])(a)
    if a.offline:
        ctx = _use("steps.pipeline").context(slots.settings())
        _use("bundlewrite").write(ctx.settings, a.offline, size, a.python, ctx.uv)
    return 0


def _steps(what: str, only: list[str] | None = None) -> Callable[[Args], int]:
    """Run the build's steps (``only``: these, else the command's ``--only`` or all) under the build lock."""
    def does(a: Args) -> int:
        pipeline = _use("steps.pipeline")
        s = slots.settings()
        if getattr(a, "pre_start", False) and _use("update").switched_build(s, os.environ):
            return 0
        asked = what == "pack"  # nox -s pack packs: PACK=0 and --no-pack are the build's (./build.sh)
        opts = pipeline.Options(force=a.force, accept=getattr(a, "accept", False), verify=getattr(a, "verify", False),
                                pack=asked or (not getattr(a, "no_pack", False) and s.pack))
        with _use("buildlock").BuildLock(s, what):
            pipeline.run(_use("steps.order").steps(), s, opts, only or a.only)
        return 0
    return does


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--artifacts", type=Path, help="the folder to check (default: ARTIFACTS_DIR)")
    p.add_argument("--dest", type=Path, help="install the verified kernels here (default: a scratch folder, then "
                   "removed)")


def _verify(a: Args) -> int:
    return _use("steps.pack").check_artifacts(slots.settings(), a.artifacts, a.dest)


def _image_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="print the plan (builder, base, secret, the build command) "
                   "and stop")


def _image(a: Args) -> int:
    return _use("image").run(slots.settings(), config.image_settings(), a.dry_run)


def _lock_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", action="store_true", help="only scripts/ray.lock (Ray for DIST_BACKEND=ray)")


def _lock(a: Args) -> int:
    ctx = _use("steps.pipeline").context(slots.settings())
    runtime = _use("steps.runtime")
    if a.ray:
        runtime.lock_ray(ctx.settings, ctx.uv)
    else:
        runtime.lock_main(ctx.settings, ctx.uv, ctx.series.version)
    return 0


def _patches_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("check", help="one line per patch: applies, files, compiled inputs, why")
    rb = sub.add_parser("rebase", help="try the series on another upstream version, in scratch")
    rb.add_argument("version", help="e.g. v0.31.0")
    rb.add_argument("--keep-going", action="store_true", help="go on past a conflict to see the rest")
    rb.add_argument("--out", type=Path, help="where the rebased series goes (default patches-vX.Y.Z/)")
    nw = sub.add_parser("new", help="export the commits on top of the series in vllm/ as the next patches")
    nw.add_argument("name", help="the patch name, NNNN-NAME.patch")


def _patches(a: Args) -> int:
    ctx, tool = _use("steps.pipeline").context(slots.settings()), _use("patches")
    if a.verb == "check":
        return tool.check(ctx)
    if a.verb == "rebase":
        return tool.rebase(ctx, a.version, a.keep_going, a.out.resolve() if a.out else None)
    return tool.new(ctx, a.name)


# -- serving -----------------------------------------------------------------------------------------------------


def _start_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", nargs="?", metavar="CKPT", help="the checkpoint folder (default: the CKPT variable)")
    p.add_argument("--foreground", action="store_true",
                   help="stay attached until the engine ends (systemd, the container); LOG= implies it")
    p.add_argument("--dry-run", action="store_true",
                   help="print the box report, the topology, the command and its environment; start nothing")
    p.add_argument("--no-build", action="store_true", help="serve what is built without checking the build")
    p.add_argument("--skip-box-check", action="store_true",
                   help="start on a box unlike the reference one (the engine fails on its own if it cannot run)")
    p.add_argument("--demo", action="store_true",
                   help="serve the demo model (PROFILE=demo): the CPU build unless the CUDA one is current on a GPU "
                   "box; the tiny checkpoint is made on the box when missing")
    p.add_argument("--clear-cache", action="store_true",
                   help="empty CACHE_ROOT first (compile caches a crash left corrupt or locked)")


def _start(a: Args) -> int:
    start = _use("start")
    env = {**os.environ, **({"CKPT": a.ckpt} if a.ckpt else {})}
    env = start.demo_env(env) if a.demo else start.profile_device(env)
    return start.run(slots.settings(env), env, foreground=a.foreground, dry_run=a.dry_run, build=not a.no_build,
                     box_check=not a.skip_box_check, clear_cache=a.clear_cache)


def _update_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--demo", action="store_true", help="the demo's build and engine, as ./start.sh --demo has them")
    p.add_argument("--force", action="store_true", help="build again beside the current build even when it is "
                   "this checkout's series and lock already")


def _update_env(a: Args) -> dict[str, str]:
    return _use("start").demo_env(os.environ) if a.demo else dict(os.environ)


def _update(a: Args) -> int:
    env = _update_env(a)
    up = _use("update")
    return up.update(env, up.direct(env), force=a.force)


def _rollback(a: Args) -> int:
    env = _update_env(a)
    up = _use("update")
    return up.rollback(env, up.direct(env))


def _doctor(a: Args) -> int:
    s = slots.settings()
    for line in _use("control").doctor(s, _use("profiles").load(s.profile), config.serve_settings()):
        plain(line)
    return 0


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path.cwd(), help="the folder the archive goes to (default: here)")


def _report(a: Args) -> int:
    env = _use("start").profile_device(os.environ)  # the profile's build, as a start would take it
    _use("report").write(slots.settings(env), env, a.out)
    return 0


def _fit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cards", type=int, default=0, help="answer for a box of N cards (default: this box's)")
    p.add_argument("--card-memory", default="", help="each card's memory as torch sees it, e.g. 24GiB or 80GB "
                   "(default: this box's, read by NVML)")


def _fit(a: Args) -> int:
    return _use("control").fit_report(_use("start").profile_device(os.environ), a.cards, _mib(a.card_memory))


def _mib(text: str) -> float:
    """A memory size: a number with GiB, GB, MiB or MB (24GiB, 80GB); '' is 0 (read the box)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(GiB|GB|MiB|MB)\s*", text)
    if text and not m:
        raise BadInput(problem("--card-memory", "a size such as 24GiB, 80GB or 24576MiB", repr(text),
                               "write the number and its unit, e.g. --card-memory 24GiB"))
    if not text:
        return 0.0
    return float(m[1]) * {"GiB": 1024, "GB": 1e9 / 2**20, "MiB": 1, "MB": 1e6 / 2**20}[m[2]]


def _logs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--follow", action="store_true", help="follow the log file (LOG)")
    p.add_argument("-n", "--lines", type=int, default=None, help="start from the last N lines (default 500 with -f)")
    p.add_argument("--since", default="10m", help="with docker: how far back (default 10m)")
    p.add_argument("--file", help="read this file instead of LOG")


def _logs(a: Args) -> int:
    return _use("logview").show(slots.settings(), a.follow, a.lines, a.since, a.file)


def _service_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("verb", choices=_use("service").VERBS)
    p.add_argument("--root", help="write under this prefix instead of / (default: DESTDIR, else /)")
    p.add_argument("-n", "--lines", type=int, default=200, help="logs: start from the last N lines")
    p.add_argument("--node-rank", type=int, metavar="N", help="install: this node's rank in a multi-node engine "
                   "(0 the head, 1.. the workers), written to the environment file with the unit")


def _service(a: Args) -> int:
    return _use("service").run(slots.settings(), a.verb, a.root, a.lines, a.node_rank)


def _ray_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("up", "status", "down"))


def _ray(a: Args) -> int:
    s, v = slots.settings(), config.serve_settings()
    ray = _use("raycluster")
    if a.action == "down":
        say(f"ray: {ray.stop(s)}")
        return 0
    if not v.head_addr:
        raise BadInput(problem("HEAD_ADDR", "the Ray head's address", "unset",
                               "set HEAD_ADDR (the head's own address on the head)"))
    if a.action == "status":
        n = ray.active_nodes(s, v)
        say(f"ray: {n if n is not None else 'no answer: no'} active node(s) at {v.head_addr}:{v.head_port}, "
            f"{v.nodes} expected (NODES)")
        return 0 if n is not None and n >= v.nodes else 1
    ray.ensure(s)
    address = _use("netif").choose(v.net_iface, v.head_addr, v.head_port).address
    (ray.start_head if v.node_rank == 0 else ray.join)(s, v, address)
    return 0


# -- the table ---------------------------------------------------------------------------------------------------

COMMANDS: dict[str, Command] = {
    "build": Command("build.sh", "Build patched vLLM: run the build steps, skipping the current ones.",
                     _steps("build"), _build_arguments, _steps_and_variables),
    "tree": Command("nox -s tree --", "Step 2 alone: make vllm/ = upstream tag + patches/, checked.",
                    _steps("tree", ["tree"]), _tree_arguments, _steps_and_variables),
    "pack": Command("nox -s pack --", "Step 8 alone: pack the built kernels into ARTIFACTS_DIR.",
                    _pack, _pack_arguments, _steps_and_variables),
    "verify": Command("nox -s verify --", "Check ARTIFACTS_DIR (or --artifacts) against this box's target (OPS_OBJ, "
                      "architecture, CPython, CUDA, torch) by the same check the container build runs; installs "
                      "into --dest, or a scratch folder.", _verify, _verify_arguments),
    "image": Command("nox -s image --", "Build the rig's image from the kernels ./build.sh packed (the Dockerfile's "
                     "route 1) with the builder this box has (docker buildx, podman or buildah), on a base it can "
                     "get (debootstrap when no registry answers); records its size and build time.", _image,
                     _image_arguments),
    "lock": Command("nox -s lock --", "Regenerate RUNTIME_LOCK with uv pip compile --generate-hashes from the "
                    "official wheel's requirements (needs the network); scripts/ray.lock with it.", _lock,
                    _lock_arguments),
    "patches": Command("nox -s patches --", "Series tooling: check the series, try it on another upstream version, "
                       "export new commits from vllm/ as patches.", _patches, _patches_arguments),
    "start": Command("start.sh", "Serve the built vLLM: build on a first run, check the box, choose the topology, "
                     "start `vllm serve` under supervision and wait for a one-token generation.", _start,
                     _start_arguments),
    "stop": Command("nox -s stop --", "Stop the engine: SIGTERM to its whole process group, SIGKILL after "
                    "STOP_TIMEOUT seconds, then check that no process of it is left.",
                    lambda a: _use("control").stop(config.settings(), config.serve_settings())),  # the record alone
    "status": Command("nox -s status --", "Report the engine: pid, uptime, port, health (a one-token generation), "
                      "the hang watchdog (HANG_WINDOW) and the KV cache line. Exit 0 healthy, 1 running but not "
                      "healthy or hung, 3 not running.",
                      lambda a: _use("control").status(slots.settings(), config.serve_settings())),
    "update": Command("nox -s update --", "Build this checkout's series beside the current build, switch to it "
                      "and restart a running engine on it; when that engine is not healthy, switch back and start "
                      "the old one (exit 1). The current and the previous build are kept.", _update,
                      _update_arguments),
    "rollback": Command("nox -s rollback --", "Switch back to the previous build, restarting a running engine on "
                        "it (and back again when it is not healthy).", _rollback, _update_arguments),
    "doctor": Command("nox -s doctor --", "Report the box: every check, pass/fail/warn, and the facts of every card.",
                      _doctor),
    "fit": Command("nox -s fit --", "Will it fit: the weights, the KV cache and the verdict per card for the plan a "
                   "start would make, before any engine starts (exit 2: it does not fit).", _fit, _fit_arguments),
    "report": Command("nox -s report --", "One archive to attach to a bug report: the doctor's report, the build "
                      "records, the series, the profile, the engine's command and record, the versions, the rig's "
                      "metrics and the log's last lines; every secret replaced by <redacted>.", _report,
                      _report_arguments),
    "logs": Command("vllm-logs.sh", "vLLM's stats lines, one coloured line per update.", _logs, _logs_arguments),
    "service": Command("scripts/install-as-service.sh", "Run the rig under systemd: the unit, its environment file, "
                       "the logrotate policy.", _service, _service_arguments),
    "ray": Command("nox -s ray --", "A Ray cluster across the nodes, without an engine: `up` on the head "
                   "(NODE_RANK=0) starts Ray's head, on a worker joins it (HEAD_ADDR, HEAD_PORT, NET_IFACE as for "
                   "./start.sh); `status` counts the active nodes (exit 1 when fewer than NODES); `down` stops Ray "
                   "on this node.", _ray, _ray_arguments),
    "bench": Command("bench.sh", "llama-benchy against the served model; results saved, compared, plotted.",
                     lambda a: _use("bench").main(a.args), parse=False),
}


def run(name: str, argv: Sequence[str]) -> int:
    """Run the command ``name`` with its arguments; returns its exit status (argparse exits 2 on bad usage)."""
    cmd = COMMANDS[name]
    args = cmd.parser().parse_args(list(argv)) if cmd.parse else Args(args=list(argv))
    return guard(lambda: cmd.does(args))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rig.cli COMMAND [ARGS]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        return guard(lambda: _unknown(argv[0] if argv else ""))
    return run(argv[0], argv[1:])


def _unknown(name: str) -> int:
    raise BadInput(problem("the command", f"one of {', '.join(COMMANDS)}", repr(name) if name else "none",
                           "python -m rig.cli COMMAND [ARGS] (nox -l lists the sessions)"))


if __name__ == "__main__":  # the front door itself: the bench session runs it in its own venv
    raise SystemExit(main())
