"""The PLE offload (patch 0007) on a real GPU: PROFILE=demo-ple-gpu served by the rig with the table in host RAM
and on the card, through NVML. Skipped without a driver (CI has none); run on the GPU box of docs/gpu.md:

  tests/gpu_box.sh BUNDLE ple

One run of benchmarks/ple_offload.py serves both engines and records what it saw; the tests below hold that
record against what the offload promises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rig.build.cudastub import driver_loadable  # noqa: E402 - standard library only

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not driver_loadable(), reason="no NVIDIA driver here")]


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ple") / "ple.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ple_offload.py"), "--out", str(out)],
                       cwd=ROOT, env=os.environ, capture_output=True, text=True, timeout=2400)
    print("\n" + r.stdout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return json.loads(out.read_text())


def test_the_outputs_are_the_same_with_the_table_in_host_ram_and_on_the_card(seen):
    """Tokens and top-5 sets identical; logprobs within the card's own noise between two starts of the same
    engine (torch.compile times candidate kernels at each cold start, so a logprob may move by 1e-5), where a
    wrong row of the table moves them by whole tenths."""
    on, off = seen["on"]["outputs"], seen["off"]["outputs"]
    assert all(o["tokens"] for o in on)
    assert [o["tokens"] for o in on] == [o["tokens"] for o in off]
    assert seen["difference"] <= max(1e-4, 2 * seen["noise"]), (seen["difference"], seen["noise"])


def test_the_card_holds_less_by_the_tables_size(seen):
    table_mib = seen["table"]["bytes"] / 2**20
    assert table_mib > 1024, seen["table"]  # the GPU demo's table is 2 GiB: far above the card's own noise
    freed = seen["off"]["card_mib"] - seen["on"]["card_mib"]
    assert abs(freed - table_mib) <= 0.05 * table_mib, (freed, table_mib)


def test_the_child_holds_the_table_and_has_no_cuda_context(seen):
    child = seen["on"]["child"]
    assert child is not None, "no VLLM::PLEServer in the engine's group with the offload on"
    assert not child["in_nvml"] and not child["maps_libcuda"], child
    assert child["table_mib"] >= 0.99 * seen["table"]["bytes"] / 2**20, child  # its memfd, resident
    assert seen["off"]["child"] is None
    log = seen["on"]["log"]
    assert f"(PLEServer pid={child['pid']}) INFO PLE offload: table model.embed_tokens_per_layer.weight: " \
           "262144 x 4096 BF16, 2.000 GiB in host RAM" in log, log[-3000:]
    assert "VLLM::PLEServer" not in seen["off"]["log"]


def test_a_ple_home_outside_the_cards_exits_2_before_anything_starts(tmp_path):
    env = {**os.environ, "PROFILE": "demo-ple-gpu", "DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "0", "PLE_HOME": "5",
           "RIG_STATE": str(tmp_path / "state"), "LOG": str(tmp_path / "vllm.log")}
    r = subprocess.run([str(ROOT / "start.sh"), "--no-build", "--skip-box-check"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "PLE_HOME" in r.stderr and "CUDA_VISIBLE_DEVICES=0" in r.stderr and "found 5" in r.stderr, r.stderr
    assert not (tmp_path / "state" / "engine.toml").exists()
