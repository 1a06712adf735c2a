"""Command-line entry points behind the nox sessions (and so the wrappers)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rig import config, console
from rig.console import guard
from rig.steps import pipeline
from rig.steps.order import steps


def _epilog() -> str:
    lines = ["steps:"]
    for n, st in enumerate(steps(), 1):
        lines.append(f"  {n}. {st.name:10} {st.summary}")
    lines.append("")
    lines.append("variables (from the environment):")
    for v in config.VARS:
        lines.append(f"  {v.name:18} default {v.default.replace('`', '')}: {v.meaning.replace('`', '')}")
    return "\n".join(lines)


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description, epilog=_epilog(),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def _steps_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build(argv: Sequence[str]) -> int:
    """``./build.sh``: every step, or the ones ``--only`` names."""
    p = _parser("build.sh", "Build patched vLLM: run the build steps, skipping the current ones.")
    p.add_argument("--only", type=_steps_list, metavar="STEP[,STEP]",
                   help="run only these steps; the steps they need are checked, not re-run")
    p.add_argument("--force", action="store_true", help="run the steps even when they are current")
    p.add_argument("--accept", action="store_true",
                   help="tree step: record the tree the series builds as the expected one in series.toml")
    p.add_argument("--verify", action="store_true", help="re-hash the build products instead of the fast check")
    p.add_argument("--no-pack", action="store_true", help="skip step 8, the kernel pack (PACK=0)")
    a = p.parse_args(argv)
    return guard(lambda: _run(a.only, a.force, a.accept, a.verify, not a.no_pack, "build"))


def tree(argv: Sequence[str]) -> int:
    """``nox -s tree``: step 2 alone."""
    p = _parser("nox -s tree --", "Step 2 alone: make vllm/ = upstream tag + patches/, checked.")
    p.add_argument("--accept", action="store_true",
                   help="record the tree the series builds as the expected one in series.toml")
    p.add_argument("--force", action="store_true", help="re-apply the series even when the tree is current")
    a = p.parse_args(argv)
    return guard(lambda: _run(["tree"], a.force, a.accept, False, True, "tree"))


def pack(argv: Sequence[str]) -> int:
    """``nox -s pack``: step 8 alone (the steps it needs are checked, not re-run)."""
    p = _parser("nox -s pack --", "Step 8 alone: pack the built kernels into ARTIFACTS_DIR.")
    p.add_argument("--force", action="store_true", help="pack again even when artifacts/ is current")
    p.add_argument("--verify", action="store_true", help="re-hash the tarball when checking artifacts/")
    a = p.parse_args(argv)
    return guard(lambda: _run(["pack"], a.force, False, a.verify, True, "pack"))


def verify(argv: Sequence[str]) -> int:
    """``nox -s verify``: check a kernels tarball against this build's target, item by item."""
    p = argparse.ArgumentParser(prog="nox -s verify --", description="Check ARTIFACTS_DIR (or --artifacts) against "
                                "this box's target (OPS_OBJ, architecture, CPython, CUDA, torch) by the same "
                                "check the container build runs; installs into --dest, or a scratch folder.")
    p.add_argument("--artifacts", help="the folder to check (default: ARTIFACTS_DIR)")
    p.add_argument("--dest", help="install the verified kernels here (default: a scratch folder, then removed)")

    def go() -> int:
        import shutil
        from pathlib import Path

        from rig import leftovers, record, verify
        from rig.kernels.target import expected, of_build
        from rig.steps.pipeline import BuildLock

        a = p.parse_args(argv)
        s = config.settings()
        rec = record.load(s.state_dir, s.device)
        target = {**of_build(s, rec).as_dict(), "route": rec.ops.route if rec.ops else None}
        src = Path(a.artifacts) if a.artifacts else s.artifacts_dir
        want = expected(s, rec)
        # The build lock: a build may be rewriting artifacts/ or the tree's kernels. The scratch destination is
        # the rig's own, so a verify that is killed leaves nothing the next one does not remove.
        with BuildLock(s, "verify"):
            leftovers.clean(s, console.say)
            scratch = s.state_dir / leftovers.VERIFY_DEST
            dest = Path(a.dest) if a.dest else scratch
            try:
                n, against = verify.verify(src, dest, target, verify.read_expected(want) if want else None,
                                           say=console.say)
            finally:
                if not a.dest:
                    shutil.rmtree(scratch, ignore_errors=True)
        shown = ", ".join(f"{k} {v}" for k, v in target.items() if v)
        print(f"verify: {src} fits this target ({shown}); {n} files, the set checked against {against}")
        return 0

    return guard(go)


def logs(argv: Sequence[str]) -> int:
    """``./vllm-logs.sh``: the engine's stats lines, one coloured line per update."""
    def go() -> int:
        from rig import logs as reader

        s = config.settings()
        p = argparse.ArgumentParser(prog="vllm-logs.sh", description="vLLM's stats lines, one coloured line per "
                                    "update.")
        p.add_argument("-f", "--follow", action="store_true", help=f"follow the log file (LOG, now {s.log or 'unset'})")
        p.add_argument("-n", "--lines", type=int, default=None,
                       help="start from the last N lines (default 500 with -f)")
        p.add_argument("--since", default="10m", help="with docker: how far back (default 10m)")
        p.add_argument("--file", help="read this file instead of LOG")
        a = p.parse_args(argv)
        return reader.show(s, a.follow, a.lines, a.since, a.file)

    return guard(go)


def doctor(argv: Sequence[str]) -> int:
    """``nox -s doctor``: the box report."""
    argparse.ArgumentParser(prog="nox -s doctor --", description="Report the box: every check, pass/fail/warn, "
                            "and the facts of every card.").parse_args(argv)

    def go() -> int:
        from rig import box, profiles

        s = config.settings()
        print("\n".join(box.doctor(s, profiles.load(s.profile), config.serve_settings())))
        return 0

    return guard(go)


def _serve_parser(prog: str, description: str) -> argparse.ArgumentParser:
    lines = ["variables (from the environment):"]
    lines += [f"  {v.name:24} default {v.default.replace('`', '')}" for v in config.VARS]
    return argparse.ArgumentParser(prog=prog, description=description, epilog="\n".join(lines),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def start(argv: Sequence[str]) -> int:
    """``./start.sh``: build if needed, test the box, choose the topology, start the engine, prove it healthy."""
    p = _serve_parser("start.sh", "Serve the built vLLM: build on a first run, check the box, choose the topology, "
                      "start `vllm serve` under supervision and wait for a one-token generation.")
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
    a = p.parse_args(argv)

    def go() -> int:
        import os

        from rig import serve

        env = dict(os.environ)
        if a.ckpt:
            env["CKPT"] = a.ckpt
        return serve.start(env, foreground=a.foreground, dry_run=a.dry_run, build=not a.no_build,
                           box_check=not a.skip_box_check, clear_cache=a.clear_cache, demo_model=a.demo)

    return guard(go)


def stop(argv: Sequence[str]) -> int:
    """``nox -s stop``: SIGTERM the engine's process group, SIGKILL after STOP_TIMEOUT, confirm none is left."""
    _serve_parser("nox -s stop --", "Stop the engine: SIGTERM to its whole process group, SIGKILL after "
                  "STOP_TIMEOUT seconds, then check that no process of it is left.").parse_args(argv)

    def go() -> int:
        from rig import control

        return control.stop(config.settings(), config.serve_settings())

    return guard(go)


def status(argv: Sequence[str]) -> int:
    """``nox -s status``: pid, uptime, health, port, the KV cache line."""
    _serve_parser("nox -s status --", "Report the engine: pid, uptime, port, health (a one-token generation), the "
                  "hang watchdog (HANG_WINDOW) and the KV cache line. Exit 0 healthy, 1 running but not healthy or "
                  "hung, 3 not running.").parse_args(argv)

    def go() -> int:
        from rig import control

        return control.status(config.settings(), config.serve_settings())

    return guard(go)


def service(argv: Sequence[str]) -> int:
    """``scripts/install-as-service.sh VERB``: the systemd service."""
    from rig import service as svc

    p = argparse.ArgumentParser(prog="scripts/install-as-service.sh", description="Run the rig under systemd: the "
                                "unit, its environment file, the logrotate policy.")
    p.add_argument("verb", choices=svc.VERBS)
    p.add_argument("--root", help="write under this prefix instead of / (default: DESTDIR, else /)")
    p.add_argument("-n", "--lines", type=int, default=200, help="logs: start from the last N lines")
    p.add_argument("--node-rank", type=int, metavar="N", help="install: this node's rank in a multi-node engine "
                   "(0 the head, 1.. the workers), written to the environment file with the unit")
    a = p.parse_args(argv)
    return guard(lambda: svc.run(config.settings(), a.verb, a.root, a.lines, a.node_rank))


def patches(argv: Sequence[str]) -> int:
    """``nox -s patches -- check | rebase vX.Y.Z | new NAME``: the series tooling."""
    from pathlib import Path

    from rig import patches as tool

    p = argparse.ArgumentParser(prog="nox -s patches --", description="Series tooling: check the series, try it "
                                "on another upstream version, export new commits from vllm/ as patches.")
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("check", help="one line per patch: applies, files, compiled inputs, why")
    rb = sub.add_parser("rebase", help="try the series on another upstream version, in scratch")
    rb.add_argument("version", help="e.g. v0.31.0")
    rb.add_argument("--keep-going", action="store_true", help="go on past a conflict to see the rest")
    rb.add_argument("--out", type=Path, help="where the rebased series goes (default patches-vX.Y.Z/)")
    nw = sub.add_parser("new", help="export the commits on top of the series in vllm/ as the next patches")
    nw.add_argument("name", help="the patch name, NNNN-NAME.patch")
    a = p.parse_args(argv)

    def go() -> int:
        ctx = pipeline.context(config.settings())
        if a.verb == "check":
            return tool.check(ctx)
        if a.verb == "rebase":
            return tool.rebase(ctx, a.version, a.keep_going, a.out.resolve() if a.out else None)
        return tool.new(ctx, a.name)

    return guard(go)


def bench(argv: Sequence[str]) -> int:
    """``benchmarks/bench.sh``: llama-benchy against the served model; results saved, compared, plotted."""
    from rig import bench as tool

    return guard(lambda: tool.main(list(argv)))


def ray(argv: Sequence[str]) -> int:
    """``nox -s ray``: the Ray cluster on its own (DIST_BACKEND=ray brings it up with the engine)."""
    p = argparse.ArgumentParser(prog="nox -s ray --", description="A Ray cluster across the nodes, without an "
                                "engine: `up` on the head (NODE_RANK=0) starts Ray's head, on a worker joins it "
                                "(HEAD_ADDR, HEAD_PORT, NET_IFACE as for ./start.sh); `status` counts the active "
                                "nodes (exit 1 when fewer than NODES); `down` stops Ray on this node.")
    p.add_argument("action", choices=("up", "status", "down"))
    a = p.parse_args(argv)

    def go() -> int:
        from rig import netif, raycluster
        from rig.console import say
        from rig.errors import BadInput, problem

        s, v = config.settings(), config.serve_settings()
        if a.action == "down":
            say(f"ray: {raycluster.stop(s)}")
            return 0
        if not v.head_addr:
            raise BadInput(problem("HEAD_ADDR", "the Ray head's address", "unset", "set HEAD_ADDR (the head's "
                                   "own address on the head)"))
        if a.action == "status":
            n = raycluster.active_nodes(s, v)
            say(f"ray: {n if n is not None else 'no answer: no'} active node(s) at {v.head_addr}:{v.head_port}, "
                f"{v.nodes} expected (NODES)")
            return 0 if n is not None and n >= v.nodes else 1
        raycluster.ensure(s)
        iface = netif.choose(v.net_iface, v.head_addr, v.head_port)
        if v.node_rank == 0:
            raycluster.start_head(s, v, iface.address)
        else:
            raycluster.join(s, v, iface.address)
        return 0

    return guard(go)


def lock(argv: Sequence[str]) -> int:
    """``nox -s lock``: regenerate the hash-pinned runtime lock."""
    p = argparse.ArgumentParser(prog="nox -s lock --", description="Regenerate RUNTIME_LOCK with uv pip compile "
                                "--generate-hashes from the official wheel's requirements (needs the network); "
                                "scripts/ray.lock with it.")
    p.add_argument("--ray", action="store_true", help="only scripts/ray.lock (Ray for DIST_BACKEND=ray)")
    a = p.parse_args(argv)

    def go() -> int:
        from rig.steps import runtime

        ctx = pipeline.context(config.settings())
        if a.ray:
            runtime.lock_ray(ctx.settings, ctx.uv)
        else:
            runtime.lock_main(ctx.settings, ctx.uv, ctx.series.version)
        return 0

    return guard(go)


def _run(only, force, accept, verify, pack, what) -> int:
    s = config.settings()
    opts = pipeline.Options(force=force, accept=accept, verify=verify, pack=pack and s.pack)
    with pipeline.BuildLock(s, what):
        pipeline.run(steps(), s, opts, only)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m rig.cli COMMAND [ARGS]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"build": build, "tree": tree, "lock": lock, "pack": pack, "verify": verify,
                "logs": logs, "doctor": doctor, "start": start, "stop": stop, "status": status,
                "service": service, "patches": patches, "bench": bench, "ray": ray}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m rig.cli {{{','.join(commands)}}} [ARGS]", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(commands[argv[0]](argv[1:]))


if __name__ == "__main__":
    main()
