"""The real thing: ./build.sh of patched vLLM v0.30.0 from a fresh copy of this repository.

The starter series is Python-only, so the kernels come from the official wheel (the precompiled
route): no GPU, no compiler. Downloads are cached (uv's cache and ~/.cache/vllm-rig).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow


def test_build_sh_runs_all_eight_steps(fresh):
    dest, r, _ = fresh
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    for n, step in enumerate(("tools", "tree", "venv", "runtime", "toolchain", "ops", "install", "pack"), 1):
        assert f"[{n}/8] {step}" in r.stdout, step
    assert {p.name for p in (dest / "artifacts").iterdir()} == {"manifest.toml", "ops.sha256", "ops.tar.zst"}
    assert "route: precompiled" in r.stdout
    assert "only the link layer was checked" in r.stdout or "import check: vllm, " in r.stdout
    assert list(dest.glob("build-*.log"))
    assert (dest / "vllm" / ".build-products").exists()


def test_vllm_version_answers(fresh):
    dest, _, env = fresh
    # vLLM builds its whole argument parser, device detection included, before it reads --version; on a
    # box with no GPU that detection fails unless the device is named.
    r = subprocess.run([str(dest / ".venv/bin/vllm"), "--version"], capture_output=True, text=True,
                       env={**env, "VLLM_TARGET_DEVICE": "cpu"}, cwd="/", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "0.30.0"


def test_installed_vllm_runs_the_patched_tree(fresh):
    dest, _, env = fresh
    code = "import vllm.entrypoints.serve.exposure as e, vllm; print(e.__file__); print(vllm.__version__)"
    r = subprocess.run([str(dest / ".venv/bin/python"), "-c", code], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[0] == str(dest / "vllm/vllm/entrypoints/serve/exposure.py")


NODES = [("mp", "0"), ("mp", "1"), ("ray", "0")]


@pytest.fixture(scope="module")
def parsed(fresh) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """The rig's engine commands (the reference box's, and a node's of two such boxes for each backend and
    rank), each taken by v0.30.0's own serve parser and validation, in one process (tests/vllm_parse.py)."""
    import json

    from rig.facts import config, profiles
    from rig.plan import engine, topology

    dest, _, env = fresh
    s = config.settings({"VENV_DIR": str(dest / ".venv")}, root=dest)
    ref = profiles.load("reference")
    v = config.serve_settings({"MODEL_NAME": "qwen38-flash-next Hinata"}, root=dest)
    four = topology.choose([0, 1, 2, 3], {(a, b): "not supported" for a in range(4) for b in range(4) if a != b})
    argvs = {"reference": engine.command(s, v, four, Path("/models/scales.json"), ref).argv}
    tiny = profiles.load("reference-tiny")  # the reference's shape in miniature, on 1, 2 and 4 cards
    for cards in (1, 2, 4):
        t = topology.choose(list(range(cards)), {(a, b): "not supported" for a in range(cards) for b in range(cards)
                                                 if a != b})
        argvs[f"tiny-{cards}"] = engine.command(s, v, t, Path("/models/scales.json"), tiny).argv
    two = topology.across([([0, 1, 2, 3], {})] * 2, layers=48)
    for backend, rank in NODES:
        v = config.serve_settings({"NODES": "2", "NODE_RANK": rank, "HEAD_ADDR": "10.0.0.1", "HEAD_PORT": "29601",
                                   "NODES_SECRET": "s" * 64, "DIST_BACKEND": backend}, root=dest)
        argvs[f"{backend}-{rank}"] = engine.command(s, v, two, None, ref).argv
    r = subprocess.run([str(dest / ".venv/bin/python"), str(ROOT / "tests/vllm_parse.py")], capture_output=True,
                       text=True, input=json.dumps({k: a[1:] for k, a in argvs.items()}),
                       env={**env, "VLLM_TARGET_DEVICE": "cpu"}, cwd="/", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return argvs, json.loads(r.stdout.strip().splitlines()[-1])


def test_the_engine_command_parses_under_the_real_vllm_serve_parser(fresh, parsed):
    dest = fresh[0]
    argvs, got = parsed
    assert argvs["reference"][:2] == [str(dest / ".venv/bin/vllm"), "serve"]
    got = got["reference"]
    assert "error" not in got, got
    assert (got["tensor_parallel_size"], got["pipeline_parallel_size"]) == (2, 2)
    assert got["enable_expert_parallel"] and got["disable_custom_all_reduce"]
    assert got["kv_cache_dtype"] == "fp8" and got["max_model_len"] == 262144
    assert (got["max_num_seqs"], got["max_num_batched_tokens"], got["block_size"]) == (4, 2048, 2048)
    assert got["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert "'max_cudagraph_capture_size': 16" in got["compilation_config"]
    assert got["api_key"] is None and (got["host"], got["port"]) == ("127.0.0.1", 8000)


@pytest.mark.parametrize("cards,sizes", [(1, (1, 1, False)), (2, (2, 1, True)), (4, (2, 2, True))])
def test_the_tiny_reference_shapes_commands_parse_under_the_real_vllm_serve_parser(parsed, cards, sizes):
    got = parsed[1][f"tiny-{cards}"]
    assert "error" not in got, got
    assert (got["tensor_parallel_size"], got["pipeline_parallel_size"], got["enable_expert_parallel"]) == sizes
    assert got["kv_cache_dtype"] == "fp8" and got["speculative_config"] == {"method": "mtp",
                                                                           "num_speculative_tokens": 3}
    assert "'max_cudagraph_capture_size': 16" in got["compilation_config"] and got["max_model_len"] == 262144


@pytest.mark.parametrize("backend,rank", NODES)
def test_a_nodes_command_parses_under_the_real_vllm_serve_parser(parsed, backend, rank):
    """Beyond one box: the head's and a headless worker's command (vLLM's multi-node executor), and the Ray
    head's, taken by v0.30.0's own serve parser and validation."""
    got = parsed[1][f"{backend}-{rank}"]
    assert "error" not in got, got
    assert (got["tensor_parallel_size"], got["pipeline_parallel_size"]) == (2, 4)
    if backend == "ray":
        assert got["distributed_executor_backend"] == "ray" and got["nnodes"] == 1
    else:
        assert (got["nnodes"], got["node_rank"], got["master_addr"], got["master_port"]) == (2, int(rank),
                                                                                             "10.0.0.1", 29601)
        assert got["headless"] is (rank == "1")


def test_second_build_does_no_work(fresh):
    dest, _, env = fresh
    r = subprocess.run([str(dest / "build.sh")], cwd=dest, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("current:") == 8, r.stdout
    assert "runs:" not in r.stdout


def test_the_packed_kernels_verify_against_this_box(fresh):
    dest, _, env = fresh
    r = subprocess.run([str(dest / "scripts/nox.sh"), "-s", "verify"], cwd=dest, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    assert "fits this target" in r.stdout and "torch 2.13.0" in r.stdout


def test_verify_rehashes_the_real_kernels(fresh):
    dest, _, env = fresh
    r = subprocess.run([str(dest / "build.sh"), "--no-pack", "--only", "ops", "--verify"], cwd=dest, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "re-hashed" in r.stdout, r.stdout[-2000:]
    sums = subprocess.run(["sha256sum", "--quiet", "-c", ".build-products.sha256"], cwd=dest / "vllm",
                          capture_output=True, text=True)
    assert sums.returncode == 0, sums.stdout[-2000:]
    assert len((dest / "vllm/.build-products.sha256").read_text().splitlines()) > 1000
    _ = Path
