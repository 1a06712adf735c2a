"""``./start.sh``, the act: the build if needed, the plan (rig/plan/serve.py), the free-GPU gate, the engine, the nodes.

The plan says what would run; this module does it, in order: an earlier engine's leftovers are ended (or a
running engine is reported), the build is brought up to date, the demo model is made, the box check stops a
box that fails it (exit 2), the caches are emptied on request, the free-GPU gate waits for the cards
(rig/running/gpugate.py), and the engine starts under supervision (rig/running/supervise.py). Across nodes it plays this
node's part (rig/nodes/): the head opens the registry and waits for every worker before its engine starts; a worker
joins, waits for the head's go, and starts headless beside its agent. ``--dry-run`` prints the plan, starts
nothing, and exits 2 after it when the box check or ``LOG`` would stop a real start.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from rig.base import limits
from rig.base.console import say, warn
from rig.base.errors import BadInput, Busy
from rig.build import demo
from rig.build.buildlock import BuildLock
from rig.build.steps import pipeline
from rig.build.steps.order import steps
from rig.facts import config, profiles, record, slots
from rig.facts.config import Serve, Settings
from rig.nodes import part
from rig.plan import box, engine, fit, serve
from rig.running import enginerec, gpugate, logs, metrics, sdnotify, supervise
from rig.running.health import connect_host


def run(s: Settings, env: Mapping[str, str], *, foreground: bool, dry_run: bool, build: bool, box_check: bool,
        clear_cache: bool) -> int:
    """``./start.sh`` of the build ``s`` names (the front door resolved which is current); the exit status."""
    v, p = serve.inputs(s, env)
    say(f"profile: {p.name} ({p.path}); the {s.device} build"
        + (f" (DEVICE={s.device}; the profile is for the {p.device} build: the box check names what this build "
           "cannot run of it)" if p.device != s.device else ""))
    for line in config.unread(env):
        warn(line)
    if foreground and env.get(sdnotify.VAR):  # under the unit: the limits it asks for, as this process got them
        for line in limits.shortfalls(limits.asked()):
            warn(line)
    if not dry_run and _earlier_engine(s, v, attached=foreground or not s.log):
        return 0
    if build:
        _build_if_needed(s, dry_run)
    if kind := made_kind(p):
        _demo_model(s, env, kind, dry_run)
    report = serve.check_box(s, v, p, box_check)
    serve.show_box(report, dry_run)
    if report.refusal and not dry_run:
        raise (Busy if report.busy else BadInput)(report.refusal)
    plan = serve.plan(s, v, p, report, foreground=foreground)
    serve.show(plan)
    _fit(plan, env, refuse=box_check and not dry_run)
    if dry_run:
        return _dry_run(plan)
    if clear_cache:
        removed = engine.clear_cache(v.cache_root)
        say(f"cache: emptied {v.cache_root} ({', '.join(removed) or 'nothing there yet'})")
    _build_info(s)
    if plan.gate:  # last, so that nothing between the wait and the engine's own memory reading takes long
        waited = gpugate.wait_free(box.read_nvml, plan.gate, v.gpu_wait)
        if waited:
            metrics.add(s.state_dir, "rig_gpu_gate_waits_total")
            metrics.add(s.state_dir, "rig_gpu_gate_wait_seconds_total", round(waited, 3))
    if v.nodes > 1:
        return part.run(plan, env)
    code = supervise.start(supervise.Launch.of(plan))
    if code == 0 and not plan.foreground:
        key = ' -H "Authorization: Bearer $VLLM_API_KEY"' if v.api_key else ""
        say(f"try it: curl -s http://{connect_host(s.host)}:{s.port}/v1/chat/completions{key} "
            f"-H 'Content-Type: application/json' -d '{{\"model\": \"{v.names[0]}\", \"messages\": "
            f"[{{\"role\": \"user\", \"content\": \"hi\"}}], \"max_tokens\": 16}}'")
        say("stop it: scripts/nox.sh -s stop")
    return code


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
    part of this head's engine (rig/nodes/part.py's :func:`worker_engine`)."""
    rec = enginerec.load(s)
    if rec and not enginerec.server_alive(rec):
        warn(f"an earlier engine's server (pid {rec.pid}) is gone, but processes of its group are left: "
             f"{enginerec.leftovers(rec)}; ending them before the start (they hold memory the new engine needs)")
        enginerec.terminate(rec.pgid, v.stop_timeout)
        enginerec.pid_path(s).unlink(missing_ok=True)
        return False
    if rec is None:
        return False
    if v.nodes > 1 and v.node_rank:
        return part.worker_engine(s, v, rec)
    enginerec.already_running(rec, attached)
    return True


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


def profile_device(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with DEVICE set to the build the profile names (its ``device``) when DEVICE is unset: a profile for
    the CPU (``demo-ple``) serves with the CPU build without DEVICE=cpu. A DEVICE that is set wins (the CPU
    build's box check names what it cannot run of a CUDA profile); a profile that does not load is left to the
    start, which names it."""
    env = dict(env)
    if env.get("DEVICE", "").strip():
        return env
    try:
        p = profiles.load(env.get("PROFILE", "").strip() or profiles.DEFAULT)
    except BadInput:
        return env
    if p.device != config.settings({}).device:
        say(f"DEVICE: {p.device}, the build profile {p.name} is for ({p.path})")
    env["DEVICE"] = p.device
    return env


def demo_env(env: Mapping[str, str]) -> dict[str, str]:
    """``--demo``: the demo model on the CUDA build (``demo-gpu``: FP8 KV, CUDA graphs) when that build is current on
    a box with a driver, else on the CPU's (``demo``)."""
    env = {**env, "PROFILE": "demo"}
    if not env.get("DEVICE", "").strip():
        cuda = slots.settings({**env, "DEVICE": "cuda"})
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


def _build_info(s: Settings) -> None:
    """rig_build_info: the build this start serves from, as its record has it (rig/running/metrics.py)."""
    metrics.put(s.state_dir, "rig_build_info", 1, only=True, **record.labels(record.load(s.record_dir, s.device)),
                device=s.device)


def made_kind(p: profiles.Profile) -> str:
    """The kind of checkpoint the rig makes for ``p`` (rig/build/demo.py), or '': its own profile's, or that of the
    profile it inherits from when it keeps that profile's checkpoint (a variant for a benchmark, say)."""
    seen = p
    while True:
        if seen.name in demo.MADE:
            return demo.MADE[seen.name] if seen.checkpoint == p.checkpoint else ""
        if not seen.base:
            return ""
        seen = profiles.load(seen.base, seen.path.parent)


def _fit(pl: serve.Plan, env: Mapping[str, str], refuse: bool) -> None:
    """rig/plan/fit.py's verdict before the engine starts: a pool that cannot hold one request of max_model_len
    stops the start (exit 2) unless the box check is skipped. A checkpoint it cannot read is left to vLLM."""
    mib = fit.card_mib(pl.report.reading)
    if pl.s.device == "cuda" and not mib:
        say("fit: not estimated here (no card memory read); nox -s fit -- --card-memory 24GiB answers for a card")
        return
    try:
        f = fit.estimate(pl.engine.argv, pl.engine.full_env(env), pl.s.device, pl.s.ckpt, mib)
    except BadInput as exc:
        say(f"fit: not estimated ({exc.message.split('. Fix:')[0]})")
        return
    for line in fit.lines(f):
        say(f"fit: {line}")
    if (why := fit.refusal(f, "start anyway with ./start.sh --skip-box-check")) and refuse:
        raise BadInput(why)


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
