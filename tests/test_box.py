"""The box check on recorded NVML readings (the reference file's shape), and on this machine's host facts."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from conftest import ROOT

from rig.facts import config, profiles
from rig.plan import box

REF = profiles.load("reference")

REFERENCE = ROOT.parent / "shared" / "reference" / "nvml-h200.json"
RTX3090 = {"index": 0, "name": "NVIDIA GeForce RTX 3090", "uuid": "GPU-x", "pci_bus_id": "00000000:01:00.0",
           "memory_total": 25769803776, "memory_used": 300 << 20, "memory_free": 0, "compute_capability": [8, 6],
           "pcie_gen_cur": 4, "pcie_gen_max": 4, "pcie_width_cur": 16, "pcie_width_max": 16,
           "power_limit_mw": 350000, "enforced_power_limit_mw": 285000, "compute_processes": []}


def three090s(n: int = 4, changes: dict | None = None) -> dict:
    devs = []
    for i in range(n):
        d = {**RTX3090, "index": i, "pci_bus_id": f"00000000:{i + 1:02x}:00.0"}
        d.update((changes or {}).get(i, {}))
        devs.append(d)
    p2p = {f"{a}-{b}": "not supported" for a in range(n) for b in range(n) if a != b}
    return {"driver": "580.159.04", "cuda_driver": 13000, "devices": devs, "p2p": p2p}


def settings(**env) -> config.Settings:
    return config.settings({"CUDA_VISIBLE_DEVICES": "0,1,2,3", **env})


def by_name(checks):
    return {c.name: c for c in checks}


def test_reference_box_passes_the_gpu_checks():
    checks = box.gpu_checks(box.reading_from_json(three090s()), settings(), REF.box)
    assert all(c.status == "pass" for c in checks), [c.line() for c in checks if c.status != "pass"]


def test_the_recorded_h200_reading_parses_and_is_one_card_short_of_four():
    if not REFERENCE.exists():
        pytest.skip("no shared/reference here")
    r = box.reading_from_json(json.loads(REFERENCE.read_text()))
    assert r.gpus[0].name == "NVIDIA H200" and r.cuda_driver == 13000
    c = by_name(box.gpu_checks(r, settings(), REF.box))
    assert c["GPUs"].status == "fail" and c["GPUs"].found.startswith("1 ")
    assert c["driver"].status == "pass" and "CUDA 13.0" in c["driver"].found
    assert "PCIe gen 5/5 x16/16" in box.report(r)[1] and "power limit 700 W" in box.report(r)[1]


@pytest.mark.parametrize("case,reading,check,want", [
    ("too few GPUs", three090s(2), "GPUs", "expected 4 cards"),
    ("mixed models", three090s(4, {3: {"name": "NVIDIA GeForce RTX 3080"}}), "card models", "RTX 3080"),
    ("a card busy", three090s(4, {1: {"compute_processes": [4242]}}), "GPU 1 free", "pids 4242"),
    ("old driver", {**three090s(), "cuda_driver": 12080}, "driver", "CUDA 12.8"),
    ("small card", three090s(4, {2: {"memory_total": 12 << 30}}), "GPU 2 memory", "12.9 GB"),
])
def test_bad_boxes_fail_one_check_each_with_a_fix(case, reading, check, want):
    checks = box.gpu_checks(box.reading_from_json(reading), settings(), REF.box)
    failed = [c for c in checks if c.status == "fail"]
    assert [c.name for c in failed] == [check], case
    line = failed[0].line()
    assert want in line and "expected" in line and "Fix:" in line


def test_no_driver_is_one_line():
    c = box.gpu_checks(None, settings(), REF.box, why="NVMLError_LibraryNotFound")
    assert len(c) == 1 and "NVMLError_LibraryNotFound" in c[0].line() and "Fix:" in c[0].line()


def test_visible_devices_pick_cards_in_bus_order():
    r = box.reading_from_json(three090s())
    assert [g.index for g in box.visible(r, "2,0")] == [2, 0]


def test_checkpoint_and_scales(tmp_path):
    ck = tmp_path / "ckpt"
    assert by_name(box.model_checks(settings(CKPT=str(ck)), REF))["checkpoint"].status == "fail"
    ck.mkdir()
    assert "no config.json" in box.model_checks(settings(CKPT=str(ck)), REF)[0].found
    (ck / "config.json").write_text("{}")
    c = by_name(box.model_checks(settings(CKPT=str(ck)), REF))
    assert c["KV scales"].status == "fail" and "another checkpoint's will not do" in c["KV scales"].fix
    (ck / "qsa_kv_scales_swift.json").write_text("{}")
    c = by_name(box.model_checks(settings(CKPT=str(ck)), REF))
    assert c["KV scales"].status == "warn" and "older name" in c["KV scales"].found
    (ck / "qsa_kv_scales.json").write_text("{}")
    assert by_name(box.model_checks(settings(CKPT=str(ck)), REF))["KV scales"].status == "pass"
    c = by_name(box.model_checks(settings(CKPT=str(ck), SCALES=str(tmp_path / "none.json")), REF))
    assert c["KV scales"].status == "fail" and "none.json" in c["KV scales"].expected


@pytest.mark.parametrize("config,ok", [
    ({"max_position_embeddings": 4096}, False),
    ({"max_position_embeddings": 262144}, True),
    ({"text_config": {"max_position_embeddings": 32768}}, False),  # Gemma 3n keeps it in text_config
    ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 64.0}}, True),
    ({"n_positions": 1024, "max_position_embeddings": True}, False),  # a bool is no length
    ({}, True),  # nothing said: vLLM's own default decides
])
def test_a_context_longer_than_the_checkpoint_was_made_for_fails_the_box_check(tmp_path, config, ok):
    """vLLM refuses max_model_len above the checkpoint's max_position_embeddings only 20-40 s into its start, with
    a pydantic traceback: the box check names both values first (a failed check: exit 2)."""
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps(config))
    got = by_name(box.model_checks(settings(CKPT=str(ck)), REF)).get("context")
    assert (got is None) == ok, got
    if not ok:
        assert got.status == "fail" and "262,144" in got.found and "max_model_len = " in got.fix, got
        limit = int(got.fix.split("max_model_len = ")[1].split(")")[0])
        fixed = profiles.Profile(**{**REF.__dict__, "max_model_len": limit})  # the fix: the profile it names
        assert "context" not in by_name(box.model_checks(settings(CKPT=str(ck)), fixed))


def test_port_in_use_and_bad_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        c = box.port_check(settings(PORT=str(port)))
    assert c.status == "fail" and str(port) in c.expected and "set PORT" in c.fix
    with pytest.raises(config.BadInput) as e:
        settings(PORT="http")
    assert "PORT" in e.value.message and "'http'" in e.value.message and e.value.code == 2


def test_doctor_here_reports_the_missing_driver_in_one_line_and_the_rest():
    lines = box.doctor(settings(CKPT=str(Path("/nonexistent"))), REF)
    if lines[0].startswith("no NVIDIA driver here"):
        assert "NVML" in lines[0]
    assert any(ln.startswith(("pass  RAM", "fail  RAM")) for ln in lines)
    assert lines[-1].endswith("warned")


def test_an_abliteration_set_must_be_there_before_the_engine_loads(tmp_path):
    """Patch 0005 checks the set's contents at load; the box check only that the file QWEN38_ABLITERATION names is
    there, so a typo fails in a second with the path and the way to turn it off, not after the engine's start."""
    def checks(**env: str) -> dict:
        return by_name(box.series_checks(config.serve_settings({"ABLITERATION_DIR": str(tmp_path), **env}),
                                         tmp_path))

    assert checks() == {} and checks(QWEN38_ABLITERATION="") == {}  # neither profile names a set: off
    c = checks(QWEN38_ABLITERATION="my-set")["abliteration"]
    assert c.status == "fail" and c.found == "no such file" and str(tmp_path / "my-set.safetensors") in c.expected
    assert "QWEN38_ABLITERATION= (empty)" in c.fix
    (tmp_path / "my-set.safetensors").write_bytes(b"x")
    assert checks(QWEN38_ABLITERATION="my-set")["abliteration"].status == "pass"
    assert checks(QWEN38_ABLITERATION="my-set.safetensors")["abliteration"].status == "pass"
    _, start = box.start_checks(settings(DEVICE="cpu"), profiles.load("demo"),
                                v=config.serve_settings({"QWEN38_ABLITERATION": "absent"}))
    assert by_name(start)["abliteration"].status == "fail"


def safetensors_header(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    """A safetensors file's header (name -> dtype, shape, bytes) and no data: the checks read only headers."""
    header, at = {}, 0
    for name, (dtype, shape, size) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + size]}
        at += size
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)


def test_the_ple_offload_needs_the_table_and_its_size_in_ram(tmp_path):
    """PLE_OFFLOAD=1: the checkpoint's table (read from the safetensors header) must fit the RAM available now."""
    import psutil

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")

    def check(**env: str) -> box.Check | None:
        return by_name(box.series_checks(config.serve_settings({"PROFILE": "demo", **env}), ckpt)).get("PLE offload")

    safetensors_header(ckpt / "model.safetensors", {"model.embed_tokens.weight": ("BF16", [8, 4], 64)})
    assert check() is None and check(PLE_OFFLOAD="0") is None  # off: nothing to check
    c = check(PLE_OFFLOAD="1")
    assert c.status == "fail" and c.found == "none" and "PLE_OFFLOAD=0" in c.fix  # not a Gemma 3n checkpoint
    small = 2048 * 4096 * 2
    safetensors_header(ckpt / "model.safetensors", {"model.embed_tokens_per_layer.weight": ("BF16", [2048, 4096],
                                                                                             small)})
    c = check(PLE_OFFLOAD="1")
    assert c.status == "pass" and "0.02 GiB of RAM available for model.embed_tokens_per_layer.weight" in c.expected
    huge = int(psutil.virtual_memory().total * 4)
    safetensors_header(ckpt / "model.safetensors", {"model.language_model.embed_tokens_per_layer.weight":
                                                    ("BF16", [262144, huge // 262144 // 2], huge)})
    c = check(PLE_OFFLOAD="1")
    assert c.status == "fail" and f"{huge / 2**30:.2f} GiB" in c.expected and "GiB" in c.found, c
    assert by_name(box.series_checks(config.serve_settings({"PROFILE": "demo-ple"}), ckpt))["PLE offload"].status \
        == "fail"  # the profile turns it on


def test_ple_home_must_be_a_card_the_engine_gets():
    from rig.base.errors import BadInput
    from rig.plan import ple

    ple.check_home(2, (2, 3), "cuda")
    ple.check_home(0, (), "cpu")
    with pytest.raises(BadInput) as e:
        ple.check_home(5, (2, 3), "cuda")
    assert "PLE_HOME: expected one of the cards the engine gets, CUDA_VISIBLE_DEVICES=2,3, found 5" in str(e.value)
    with pytest.raises(BadInput) as e:
        ple.check_home(1, (), "cpu")
    assert "PLE_HOME: expected 0 on the CPU build" in str(e.value)


def test_a_cards_memory_by_process_keeps_every_compute_process_and_counts_unknown_as_0():
    """NVML gives no memory for a process on some drivers (MIG, containers): it is still a process on the card."""
    g = box.Gpu(0, "card", "0000:01:00.0", 80 << 30, 4 << 30, (9, 0), 5, 5, 16, 16, 700_000,
                compute_processes=[11, 12], process_memory={11: 3 << 30})
    assert g.mib_by_process() == {11: 3072, 12: 0}
