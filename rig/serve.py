"""The serve path in order: build if needed, box check, topology, engine command, supervised start.

Each stage lives in its own module (``rig.box``, ``rig.topology``, ``rig.engine``,
``rig.supervise``); this one only strings them together the way ``./start.sh`` runs them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from rig import box, config, demo, engine, gpugate, netif, nodes, profiles, raycluster, supervise, topology
from rig.console import INDENT, say, warn
from rig.errors import BadInput, problem
from rig.health import connect_host
from rig.steps import pipeline
from rig.steps.order import steps


def _layers(ckpt: Path) -> int:
    """The checkpoint's decoder layers (``num_hidden_layers``, of the text model for a multimodal one)."""
    try:
        cfg = json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(problem(f"{ckpt}/config.json", "the checkpoint's config, for the layers each node holds",
                               str(exc), "set CKPT to the checkpoint folder")) from None
    layers = cfg.get("num_hidden_layers") or (cfg.get("text_config") or {}).get("num_hidden_layers")
    if not isinstance(layers, int):
        raise BadInput(problem(f"{ckpt}/config.json: num_hidden_layers", "a whole number", repr(layers),
                               "use a checkpoint whose config.json names its layers"))
    return layers


def _topology(s: config.Settings, v: config.Serve, cards: list[int], p2p: dict) -> topology.Topology:
    """This box's topology; with NODES > 1, every node is taken to hold cards like this one (the head checks
    each node's card count when it joins)."""
    if v.nodes == 1:
        return topology.choose(cards, p2p)
    try:
        return topology.across([(cards, p2p)] * v.nodes, _layers(s.ckpt))
    except ValueError as exc:
        raise BadInput(f"NODES={v.nodes}: expected {exc}") from None


def _interface(v: config.Serve) -> netif.Interface | None:
    if v.nodes == 1:
        return None
    iface = netif.choose(v.net_iface, v.head_addr, v.head_port)
    role = "the head" if v.node_rank == 0 else f"worker {v.node_rank}"
    say(f"nodes: {role} of {v.nodes} ({v.dist_backend}), head {v.head_addr}:{v.head_port}; interface "
        f"{iface.name} {iface.address} ({iface.how}): VLLM_HOST_IP, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME")
    nodes.warn_if_public(iface.address, "the node-to-node address")
    return iface


def _start_node(s: config.Settings, v: config.Serve, launch: supervise.Launch, env: Mapping[str, str],
                iface: netif.Interface | None, cards: int) -> int:
    """One node of a multi-node engine: the head opens the registry, waits for every worker with its own build,
    then starts; a worker joins, waits for the head's engine, then starts headless beside its agent."""
    ray = v.dist_backend == "ray"
    address = iface.address if iface else v.head_addr
    if ray:
        raycluster.ensure(s)
    ident = nodes.identity(s, cards, ray=ray)
    if v.node_rank:
        nodes.join(v, ident, address)
        nodes.wait_go(v)
        if ray:  # Ray places this node's ranks from the head's engine: no vllm serve here
            raycluster.join(s, v, address)
            nodes.start_agent(s, v, dict(env))
            say("ray: this node serves through the head's engine; nox -s stop on the head stops it")
            return 0
        launch.on_spawn = lambda: nodes.start_agent(s, v, dict(env))
        launch.probe = lambda: nodes.head_ready(v)
        return supervise.start(launch)
    role = nodes.open_registry(s, v, ident, v.head_addr)
    try:
        nodes.wait_for_workers(v, role)
        if ray:  # the Ray head first, then the workers join it, then the engine places its ranks
            raycluster.start_head(s, v, address)
            nodes.tell(role, "go")
            raycluster.wait_for_nodes(s, v)
        else:
            launch.on_spawn = lambda: nodes.tell(role, "go")
        launch.on_ready = lambda: nodes.tell(role, "ready")
        code = supervise.start(launch)
    except BaseException:  # the workers that joined stop too: their agents see the stop, or lose the head
        _release(s, v, role)
        raise
    if launch.foreground:  # the engine has ended (a stop, a signal, a crash): the workers' engines end with it
        _release(s, v, role)
    return code


def _release(s: config.Settings, v: config.Serve, role: nodes.Role) -> None:
    """The head's engine has ended, or never started: the workers stop, then this node's Ray and registry."""
    for line in nodes.stop_workers(role, v.stop_timeout):
        say(line)
    nodes.close(s, role)


def _build_if_needed(s: config.Settings, dry_run: bool) -> None:
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
    with pipeline.BuildLock(s, "start"):
        pipeline.run(steps(), s, opts)


def _cards(s: config.Settings, reading: box.Reading | None) -> tuple[list[int], dict]:
    if reading is not None:
        return [g.index for g in box.visible(reading, s.visible)], reading.p2p
    want = [int(x) for x in s.visible.split(",") if x.strip().isdigit()]
    return want or [0], {}  # no reading: assume no P2P, the safe switches


def _gate(s: config.Settings, v: config.Serve, reading: box.Reading | None) -> list[int]:
    """The cards the free-GPU gate waits for (rig/gpugate.py); none for the CPU build, GPU_WAIT=0 or no driver."""
    if s.device != "cuda":
        return []
    if not v.gpu_wait:
        say("GPU gate: off (GPU_WAIT=0): the engine sizes its KV cache from whatever memory is free")
        return []
    if reading is None:
        say("GPU gate: skipped, no NVML reading (no NVIDIA driver here)")
        return []
    return gpugate.positions(reading, s.visible)


def _demo_env(env: Mapping[str, str]) -> dict[str, str]:
    """``--demo``: the demo profile, on the CUDA build when it is current on a box with a driver, else the CPU's."""
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
    return env


def _demo_model(s: config.Settings, env: Mapping[str, str], dry_run: bool) -> None:
    """The demo checkpoint, made on the box when it is missing (only the profile's own folder: never a CKPT)."""
    if env.get("CKPT", "").strip():
        return
    if demo.ready(s.ckpt):
        say(f"demo model: {s.ckpt}")
    elif dry_run:
        say(f"demo model: {s.ckpt} is not made yet; a real start makes it (about 15 s)")
    else:
        _, took = demo.ensure(s.venv_dir / "bin" / "python", s.ckpt, s.root)
        say(f"demo model: made {s.ckpt} in {took:.1f} s (random weights, seeded: the same files every time)")


def start(env: Mapping[str, str], *, foreground: bool, dry_run: bool, build: bool, box_check: bool,
          clear_cache: bool, demo_model: bool = False) -> int:
    """``./start.sh``; returns the exit status."""
    if demo_model:
        env = _demo_env(env)
    s = config.settings(env)
    v = config.serve_settings(env)
    p = profiles.load(s.profile)
    if v.nodes > 1 and v.dist_backend == "ray" and s.device == "cpu":
        raise BadInput(problem("DIST_BACKEND=ray", "mp with the CPU build: vLLM's CPU platform has no Ray executor "
                               "(its own check: 'current platform cpu does not support ray')", "ray",
                               "set DIST_BACKEND=mp; nox -s ray -- up brings a Ray cluster up on its own"))
    say(f"profile: {p.name} ({p.path}); the {s.device} build")
    rec = None if dry_run else supervise.load(s)
    if rec and not supervise.server_alive(rec):
        warn(f"an earlier engine's server (pid {rec.pid}) is gone, but processes of its group are left: "
             f"{supervise.leftovers(rec)}; ending them before the start (they hold memory the new engine needs)")
        supervise.terminate(rec.pgid, v.stop_timeout)
        supervise.pid_path(s).unlink(missing_ok=True)
        rec = None
    if rec:
        if foreground or not s.log:
            raise BadInput(problem("the engine", "not running", f"pid {rec.pid} on {rec.host}:{rec.port}",
                                   "nox -s stop, then start again"))
        say(supervise.running_message(rec))
        return 0
    if build:
        _build_if_needed(s, dry_run)
    if p.name == "demo":
        _demo_model(s, env, dry_run)
    refusals: list[BadInput] = []
    if box_check:
        reading, checks = box.start_checks(s, p, gpu_wait=v.gpu_wait, v=v)  # a busy card: the gate below waits
        failed = [c for c in checks if c.status == "fail"]
        for c in checks:
            if dry_run or c.status != "pass":
                print(f"{INDENT}{c.line()}", file=sys.stderr if c.status != "pass" else sys.stdout, flush=True)
        if failed:
            refused = BadInput(f"the box check: {len(failed)} of {len(checks)} checks failed (each is above, with "
                               "its fix); nox -s doctor lists them all, ./start.sh --skip-box-check starts anyway")
            if not dry_run:
                raise refused
            refusals.append(refused)  # a dry run still shows what would run (a build box has no GPU)
        else:
            say(f"box: {len(checks)} checks passed" + (f", {sum(c.status == 'warn' for c in checks)} warned"
                                                        if any(c.status == "warn" for c in checks) else ""))
    else:
        try:
            reading = box.read_nvml() if s.device == "cuda" else None
        except box.NoDriver:
            reading = None
        say("box: check skipped (--skip-box-check)")
    cards, p2p = _cards(s, reading) if s.device == "cuda" else ([0], {})  # the CPU: one engine, no cards
    gate = _gate(s, v, reading)
    topo = _topology(s, v, cards, p2p)
    say(f"topology: TP{topo.tp} x PP{topo.pp}{' + EP' if topo.ep else ''} on cards "
        f"{','.join(map(str, topo.order))}: {topo.why}")
    iface = _interface(v)
    eng = engine.command(s, v, topo, box.scales_path(s, p), p, iface.env() if iface else None)
    if engine.open_to_network(s.host) and v.api_key:
        warn(f"HOST={s.host}: VLLM_API_KEY guards only vLLM's /v1 routes; /metrics, /tokenize, /invocations and "
             f"others stay open to whoever reaches port {s.port} (vLLM issues 58144, 18892). Keep the port on a "
             "private network, or behind a proxy that checks the key")
    if engine.open_to_network(s.host) and not v.api_key:
        warn(f"HOST={s.host} with an empty VLLM_API_KEY: the API is OPEN to the network, anyone who reaches "
             f"port {s.port} can use it. Set VLLM_API_KEY, or HOST=127.0.0.1")
    if dry_run:
        if gate:
            say(gpugate.summary(reading, gate, v.gpu_wait))
        for line in eng.shown():
            print(f"{INDENT}{line}")
        if s.log:
            try:
                supervise.check_log(s.log)
            except BadInput as exc:
                refusals.append(exc)
        say(f"log: {s.log or 'the terminal (LOG is empty)'}; mode: "
            f"{'foreground' if foreground or not s.log else 'detached'}; dry run: nothing started")
        if refusals:
            raise BadInput("; ".join(r.message for r in refusals))
        return 0
    if clear_cache:
        removed = engine.clear_cache(v.cache_root)
        say(f"cache: emptied {v.cache_root} ({', '.join(removed) or 'nothing there yet'})")
    if gate:  # last, so that nothing between the wait and the engine's own memory reading takes long
        gpugate.wait_free(box.read_nvml, gate, v.gpu_wait)
    launch = supervise.Launch(s, v, eng, foreground=foreground or not s.log, health=p.health)
    if v.nodes > 1:
        return _start_node(s, v, launch, env, iface, len(cards))
    code = supervise.start(launch)
    if code == 0 and not (foreground or not s.log):
        key = ' -H "Authorization: Bearer $VLLM_API_KEY"' if v.api_key else ""
        say(f"try it: curl -s http://{connect_host(s.host)}:{s.port}/v1/chat/completions{key} "
            f"-H 'Content-Type: application/json' -d '{{\"model\": \"{v.names[0]}\", \"messages\": "
            f"[{{\"role\": \"user\", \"content\": \"hi\"}}], \"max_tokens\": 16}}'")
        say("stop it: scripts/nox.sh -s stop")
    return code
