"""``./start.sh``, the act: the build if needed, the plan (rig/serve.py), the free-GPU gate, the engine, the nodes.

The plan says what would run; this module does it, in order: an earlier engine's leftovers are ended (or a
running engine is reported), the build is brought up to date, the demo model is made, the box check stops a
box that fails it (exit 2), the caches are emptied on request, the free-GPU gate waits for the cards
(rig/gpugate.py), and the engine starts under supervision (rig/supervise.py). Across nodes it plays this node's
part (rig/nodes/): the head opens the registry and waits for every worker before its engine starts; a worker
joins, waits for the head's go, and starts headless beside its agent. ``--dry-run`` prints the plan, starts
nothing, and exits 2 after it when the box check or ``LOG`` would stop a real start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from rig import box, config, demo, engine, gpugate, limits, logs, raycluster, sdnotify, serve, supervise
from rig.buildlock import BuildLock
from rig.config import Serve, Settings
from rig.console import say, warn
from rig.errors import BadInput, problem
from rig.health import connect_host
from rig.nodes import agent, client, registry
from rig.steps import pipeline
from rig.steps.order import steps


def run(env: Mapping[str, str], *, foreground: bool, dry_run: bool, build: bool, box_check: bool,
        clear_cache: bool, demo_model: bool = False) -> int:
    """``./start.sh``; returns the exit status."""
    if demo_model:
        env = demo_env(env)
    s, v, p = serve.inputs(env)
    say(f"profile: {p.name} ({p.path}); the {s.device} build")
    if foreground and env.get(sdnotify.VAR):  # under the unit: the limits it asks for, as this process got them
        for line in limits.shortfalls(limits.asked()):
            warn(line)
    if not dry_run and _earlier_engine(s, v, attached=foreground or not s.log):
        return 0
    if build:
        _build_if_needed(s, dry_run)
    if p.name in demo.MADE:
        _demo_model(s, env, demo.MADE[p.name], dry_run)
    report = serve.check_box(s, v, p, box_check)
    serve.show_box(report, dry_run)
    if report.refusal and not dry_run:
        raise BadInput(report.refusal)
    plan = serve.plan(s, v, p, report, foreground=foreground)
    serve.show(plan)
    if dry_run:
        return _dry_run(plan)
    if clear_cache:
        removed = engine.clear_cache(v.cache_root)
        say(f"cache: emptied {v.cache_root} ({', '.join(removed) or 'nothing there yet'})")
    if plan.gate:  # last, so that nothing between the wait and the engine's own memory reading takes long
        gpugate.wait_free(box.read_nvml, plan.gate, v.gpu_wait)
    if v.nodes > 1:
        return _node(plan, env)
    code = supervise.start(_launch(plan))
    if code == 0 and not plan.foreground:
        key = ' -H "Authorization: Bearer $VLLM_API_KEY"' if v.api_key else ""
        say(f"try it: curl -s http://{connect_host(s.host)}:{s.port}/v1/chat/completions{key} "
            f"-H 'Content-Type: application/json' -d '{{\"model\": \"{v.names[0]}\", \"messages\": "
            f"[{{\"role\": \"user\", \"content\": \"hi\"}}], \"max_tokens\": 16}}'")
        say("stop it: scripts/nox.sh -s stop")
    return code


def _launch(plan: serve.Plan, *, on_spawn: Callable[[], None] | None = None,
            on_ready: Callable[[], None] | None = None,
            probe: Callable[[], tuple[bool, str]] | None = None,
            nodes_check: Callable[[], str] | None = None) -> supervise.Launch:
    """The supervisor's launch of the plan's engine, with this node's hooks."""
    return supervise.Launch(plan.s, plan.v, plan.engine, foreground=plan.foreground, health=plan.profile.health,
                            on_spawn=on_spawn, on_ready=on_ready, probe=probe, nodes_check=nodes_check)


def _dry_run(plan: serve.Plan) -> int:
    """The rest of the plan a dry run shows (the cards' state, the command, the log); exit 2 after it when the
    box check or ``LOG`` would stop a real start."""
    s, v = plan.s, plan.v
    refusals = [plan.report.refusal] if plan.report.refusal else []  # a build box has no GPU: show what would run
    if plan.gate:
        say(gpugate.summary(plan.report.reading, plan.gate, v.gpu_wait))
    serve.show_command(plan)
    if s.log:
        try:
            logs.check_log(s.log)
        except BadInput as exc:
            refusals.append(exc.message)
    say(f"log: {s.log or 'the terminal (LOG is empty)'}; mode: {'foreground' if plan.foreground else 'detached'}; "
        "dry run: nothing started")
    if refusals:
        raise BadInput("; ".join(refusals))
    return 0


def _earlier_engine(s: Settings, v: Serve, attached: bool) -> bool:
    """An engine of an earlier start: its leftovers are ended when its server is gone; one that runs is reported
    (True: nothing to start), or refused in the foreground. A worker refuses one that is not already its rank's
    part of this head's engine (:func:`_worker_engine`)."""
    rec = supervise.load(s)
    if rec and not supervise.server_alive(rec):
        warn(f"an earlier engine's server (pid {rec.pid}) is gone, but processes of its group are left: "
             f"{supervise.leftovers(rec)}; ending them before the start (they hold memory the new engine needs)")
        supervise.terminate(rec.pgid, v.stop_timeout)
        supervise.pid_path(s).unlink(missing_ok=True)
        return False
    if rec is None:
        return False
    if v.nodes > 1 and v.node_rank:
        return _worker_engine(s, v, rec)
    if attached:
        raise BadInput(problem("the engine", "not running", f"pid {rec.pid} on {rec.host}:{rec.port}",
                               "nox -s stop, then start again"))
    say(supervise.running_message(rec))
    return True


def _worker_engine(s: Settings, v: Serve, rec: supervise.Record) -> bool:
    """A worker's start that finds an engine of the rig running here: True (nothing to start) only when it is this
    rank's part of the head's engine, which the head's registry sees running; anything else is refused (exit 2)
    before the join, naming it: the head would otherwise wait in vLLM's init for an engine that never comes."""
    role, base = client.load_role(s), client.url(v)
    what = f"pid {rec.pid}, up {supervise.ago(rec.started)}"
    if role and role.role == "worker":
        what += f", worker {role.rank} of the head at {role.url}"
        if role.rank == v.node_rank and role.url == base:
            code, st = client.call(base, "/state", secret=v.nodes_secret, timeout=3)
            m = st.get("members", {}).get(str(v.node_rank)) if code == 200 else None
            if m and m["engine"] == "running" and st["now"] - m["beat"] < client.LOST:
                say(f"already running: worker {v.node_rank} of the head at {base} ({what}), part of its engine; "
                    "nothing started (nox -s stop on the head stops every node)")
                return True
            what += " (the head's registry does not see it running: it is an earlier head's)"
    elif role:
        what += f", the head of {role.url}"
    else:
        what += f", a one-node engine on {rec.host}:{rec.port}"
    raise BadInput(problem("this node's engine", f"none running, for worker {v.node_rank} to join the head at {base}",
                           f"an engine of the rig already runs here ({what})", "nox -s stop on this node, then start "
                           "it again (the head waits for it)"))


def _build_if_needed(s: Settings, dry_run: bool) -> None:
    t0 = time.monotonic()
    stale = pipeline.first_stale(steps(), s)
    if stale is None:
        say(f"build: current ({time.monotonic() - t0:.2f} s to check)")
        return
    step, reason = stale
    if dry_run:
        say(f"build: step {step} is not current ({reason}); a real start runs ./build.sh first")
        return
    say(f"build: step {step} is not current ({reason}): running ./build.sh first")
    opts = pipeline.Options(pack=s.pack)
    with BuildLock(s, "start"):
        pipeline.run(steps(), s, opts)


def demo_env(env: Mapping[str, str]) -> dict[str, str]:
    """``--demo``: the demo model on the CUDA build (``demo-gpu``: FP8 KV, CUDA graphs) when that build is current on
    a box with a driver, else on the CPU's (``demo``)."""
    env = {**env, "PROFILE": "demo"}
    if not env.get("DEVICE", "").strip():
        cuda = config.settings({**env, "DEVICE": "cuda"})
        try:
            box.read_nvml()
            current = pipeline.first_stale(steps(), cuda) is None
        except box.NoDriver:
            current = False
        env["DEVICE"] = "cuda" if current else "cpu"
        say("demo: the CUDA build is current on this GPU box: serving with it" if current else
            "demo: serving with the CPU build (DEVICE=cpu; ./build.sh makes it when needed)")
    env["PROFILE"] = demo.PROFILES.get(env["DEVICE"].strip(), "demo")  # a bad DEVICE: its own error, later
    return env


def _demo_model(s: Settings, env: Mapping[str, str], kind: str, dry_run: bool) -> None:
    """The demo checkpoint, made on the box when it is missing (only the profile's own folder: never a CKPT)."""
    if env.get("CKPT", "").strip():
        return
    if demo.ready(s.ckpt, kind):
        say(f"demo model: {s.ckpt}")
    elif dry_run:
        say(f"demo model: {s.ckpt} is not made yet; a real start makes it (about 15 s)")
    else:
        _, took = demo.ensure(s.venv_dir / "bin" / "python", s.ckpt, s.root, kind)
        say(f"demo model: made {s.ckpt} in {took:.1f} s (random weights, seeded: the same files every time)")


# -- one node of a multi-node engine ----------------------------------------------------------------------------


def _node(plan: serve.Plan, env: Mapping[str, str]) -> int:
    """One node of a multi-node engine: the head opens the registry, waits for every worker with its own build,
    then starts; a worker joins, waits for the head's engine, then starts headless beside its agent."""
    s, v = plan.s, plan.v
    ray = v.dist_backend == "ray"
    address = plan.iface.address if plan.iface else v.head_addr
    if ray:
        raycluster.ensure(s)
    ident = client.identity(s, len(plan.cards), ray=ray)
    if v.node_rank:
        return _worker(plan, env, ident, address)
    return _head(plan, ident, address)


def _worker(plan: serve.Plan, env: Mapping[str, str], ident: dict, address: str) -> int:
    s, v = plan.s, plan.v
    client.join(v, ident, address)
    client.wait_go(v)
    if v.dist_backend == "ray":  # Ray places this node's ranks from the head's engine: no vllm serve here
        raycluster.join(s, v, address)
        agent.start(s, v, dict(env))
        say("ray: this node serves through the head's engine; nox -s stop on the head stops it")
        return 0
    return supervise.start(_launch(plan, on_spawn=lambda: agent.start(s, v, dict(env)),
                                   probe=lambda: client.head_ready(v)))


def _head(plan: serve.Plan, ident: dict, address: str) -> int:
    s, v = plan.s, plan.v
    role = registry.open_registry(s, v, ident, v.head_addr)
    went: list[float] = []  # when the workers were told to start their engines

    def go() -> None:
        registry.tell(role, "go")
        went.append(time.time())

    def check() -> str:
        return registry.missing_engine(role, went[0]) if went else ""

    try:
        registry.wait_for_workers(v, role)
        if v.dist_backend == "ray":  # the Ray head first, then the workers join it, then the engine places its ranks
            raycluster.start_head(s, v, address)
            go()
            raycluster.wait_for_nodes(s, v)
            launch = _launch(plan, on_ready=lambda: registry.tell(role, "ready"), nodes_check=check)
        else:
            launch = _launch(plan, on_spawn=go, on_ready=lambda: registry.tell(role, "ready"), nodes_check=check)
        code = supervise.start(launch)
    except BaseException:  # the workers that joined stop too: their agents see the stop, or lose the head
        _release(s, v, role)
        raise
    if launch.foreground:  # the engine has ended (a stop, a signal, a crash): the workers' engines end with it
        _release(s, v, role)
    return code


def _release(s: Settings, v: Serve, role: client.Role) -> None:
    """The head's engine has ended, or never started: the workers stop, then this node's Ray and registry."""
    for line in registry.stop_workers(role, v.stop_timeout):
        say(line)
    client.close(s, role)
