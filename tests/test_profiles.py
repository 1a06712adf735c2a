"""Model profiles: the shipped ones load, a bad file is refused naming the file, the key, expected and found."""

from __future__ import annotations

from pathlib import Path

import pytest

from rig import config, engine, profiles, topology
from rig.errors import BadInput

GOOD = '''description = "d"
device = "cuda"
checkpoint = "/ckpt"
served_name = "m"
service_name = "m"
max_model_len = 4096

[box]
gpus = 1
'''


def test_the_shipped_profiles_load():
    assert {"reference", "demo"} <= set(profiles.names())
    ref, demo = profiles.load("reference"), profiles.load("demo")
    assert ref.speculative == {"method": "mtp", "num_speculative_tokens": 3} and ref.box.gpus == 4
    assert demo.device == "cpu" and demo.box.cpu_flags == ("avx2",) and demo.scales == ()


@pytest.mark.parametrize("edit,key,want", [
    (lambda t: t.replace("[box]", 'colour = "red"\n[box]'), "colour", "one of the keys"),
    (lambda t: t.replace("max_model_len = 4096", 'max_model_len = "long"'), "max_model_len", "a int"),
    (lambda t: t.replace('served_name = "m"\n', ""), "served_name", "a value"),
    (lambda t: t.replace('device = "cuda"', 'device = "tpu"'), "device", "cuda or cpu"),
    (lambda t: t + "ram = 4\n", "box.ram", "one of the keys"),
    (lambda t: t + 'cuda = "thirteen"\n', "box.cuda", "a CUDA version"),
    (lambda t: t.replace("[box]", 'extra_args = [1]\n[box]'), "extra_args", "a list of strings"),
])
def test_a_bad_profile_names_the_file_the_key_and_what_is_wrong(tmp_path, edit, key, want):
    (tmp_path / "bad.toml").write_text(edit(GOOD))
    with pytest.raises(BadInput) as e:
        profiles.load("bad", tmp_path)
    assert e.value.code == 2
    assert f"{tmp_path / 'bad.toml'}: {key}" in e.value.message and want in e.value.message
    assert "Fix:" in e.value.message


def test_an_unknown_profile_lists_the_ones_there_are():
    with pytest.raises(BadInput) as e:
        config.settings({"PROFILE": "nosuch"})
    assert "PROFILE=nosuch" in e.value.message and "demo" in e.value.message and "reference" in e.value.message


def test_the_profile_gives_the_checkpoint_and_names_unless_the_variables_do(tmp_path):
    s = config.settings({"PROFILE": "demo", "RIG_CACHE": str(tmp_path)})
    assert s.ckpt == tmp_path / "models" / "demo"
    assert config.serve_settings({"PROFILE": "demo"}).names == ("demo",)
    assert config.serve_settings({"PROFILE": "demo", "MODEL_NAME": "a b"}).names == ("a", "b")
    assert config.settings({"PROFILE": "demo", "CKPT": "/x"}).ckpt == Path("/x")


def test_the_engine_command_is_the_profiles():
    one = topology.choose([0], {})
    ref = engine.command(config.settings({}), config.serve_settings({}), one, None, profiles.load("reference"))
    assert "--speculative-config" in ref.argv and "--enforce-eager" not in ref.argv
    assert ref.argv[ref.argv.index("--max-model-len") + 1] == "262144" and "CUDA_VISIBLE_DEVICES" in ref.env
    env = {"PROFILE": "demo", "DEVICE": "cpu"}
    dm = engine.command(config.settings(env), config.serve_settings(env), one, None, profiles.load("demo"))
    assert "--speculative-config" not in dm.argv and "--enforce-eager" in dm.argv
    assert dm.env["VLLM_TARGET_DEVICE"] == "cpu" and dm.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in dm.env and dm.argv[0].endswith(".venv-cpu/bin/vllm")
