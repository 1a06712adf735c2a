"""Model profiles: the shipped ones load, a bad file is refused naming the file, the key, expected and found."""

from __future__ import annotations

from pathlib import Path

import pytest

from rig.base.errors import BadInput
from rig.facts import config, profiles
from rig.plan import engine, topology

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


@pytest.mark.parametrize("key,bad,good", [
    ("memory_utilization", "1.5", "0.9"), ("memory_utilization", "-0.1", "0"), ("memory_utilization", "nan", "0.5"),
    ("max_model_len", "-5", "4096"), ("max_model_len", "0", "1"), ("cudagraph_tokens_per_seq", "-1", "4"),
    ("box.gpus", "-1", "1"), ("box.gpu_memory_gb", "inf", "24"), ("box.ram_gib", "-4", "4"),
    ("box.cores", "-2", "2"),
])
def test_a_number_outside_its_range_is_refused_and_one_inside_passes(tmp_path, key, bad, good):
    """Profile values reached the engine's command unchecked (memory_utilization 1.5, max_model_len -5 dry-ran with
    exit 0): each numeric key has its range in profiles.RANGES; outside it, exit 2 naming the file and the key."""
    table, _, sub = key.rpartition(".")

    def write(value: str) -> None:
        text = GOOD.replace(f"{sub} = " + {"max_model_len": "4096\n", "gpus": "1\n"}.get(sub, "?"), "")
        line = f"{sub} = {value}\n"
        (tmp_path / "p.toml").write_text(text + line if table else line + text)

    write(bad)
    with pytest.raises(BadInput) as e:
        profiles.load("p", tmp_path)
    lo, hi = profiles.RANGES[key]
    assert e.value.code == 2 and f"{tmp_path / 'p.toml'}: {key}" in e.value.message, e.value.message
    assert f"a number from {lo:g} to {hi:g}" in e.value.message and "Fix:" in e.value.message
    write(good)
    assert profiles.load("p", tmp_path)


def test_every_numeric_key_has_a_range():
    numeric = {k for k, (t, *_) in profiles.TOP.items() if t in (int, float, (int, float))}
    numeric |= {f"box.{k}" for k, (t, _) in profiles.BOX.items() if t in (int, float, (int, float))}
    assert numeric == set(profiles.RANGES)


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


@pytest.mark.parametrize("extra,kept", [
    (["--enable-expert-parallel"], []),  # the topology sets it: merged, once in the command
    (["--max-model-len=262144", "--trust-remote-code"], ["--trust-remote-code"]),
    (["--max_model_len", "262144", "--seed", "7"], ["--seed", "7"]),
])
def test_extra_args_that_repeat_the_rigs_flags_are_merged(tmp_path, extra, kept):
    (tmp_path / "p.toml").write_text(f'base = "reference"\nextra_args = {extra!r}\n'.replace("'", '"'))
    (tmp_path / "reference.toml").write_text(profiles.load("reference").path.read_text())
    p = profiles.load("p", tmp_path)
    four = topology.choose([0, 1, 2, 3], {})
    argv = engine.command(config.settings({}), config.serve_settings({}), four, None, p).argv
    assert argv.count("--enable-expert-parallel") == 1 and argv.count("--max-model-len") == 1
    tail = argv[len(argv) - len(kept):] if kept else []
    assert tail == kept and not [a for a in argv if a.startswith("--max_model_len")]


@pytest.mark.parametrize("extra,owner", [
    (["--max-model-len", "999"], "the profile's max_model_len"),
    (["--kv-cache-dtype=auto"], "the profile's kv_cache_dtype"),
    (["-tp", "1"], "the topology"),
    (["--port", "9"], "PORT"),
])
def test_extra_args_that_contradict_the_rig_are_refused_naming_what_to_use(tmp_path, extra, owner):
    (tmp_path / "p.toml").write_text(f'base = "reference"\nextra_args = {extra!r}\n'.replace("'", '"'))
    (tmp_path / "reference.toml").write_text(profiles.load("reference").path.read_text())
    p = profiles.load("p", tmp_path)
    four = topology.choose([0, 1, 2, 3], {})
    with pytest.raises(BadInput) as e:
        engine.command(config.settings({}), config.serve_settings({}), four, None, p)
    assert e.value.code == 2 and f"{tmp_path / 'p.toml'}: extra_args" in e.value.message
    assert owner in e.value.message and "remove" in e.value.message, e.value.message


# -- inheritance ------------------------------------------------------------------------------------------------

#: What the tiny reference-shaped profile may name itself: the checkpoint, what describes it, and the box it needs.
TINY_MAY_SET = {"base", "description", "checkpoint", "box.gpus", "box.gpu_memory_gb", "box.ram_gib"}


def _keys(data: dict) -> dict[str, object]:
    return {f"{k}.{sub}" if isinstance(v, dict) else k: (v[sub] if isinstance(v, dict) else v)
            for k, v in data.items() for sub in (v if isinstance(v, dict) else [None])}


def test_the_tiny_reference_profile_is_the_references_own_but_for_what_must_shrink():
    import tomllib

    tiny, ref = profiles.load("reference-tiny"), profiles.load("reference")
    own = _keys(tomllib.loads(tiny.path.read_text()))
    assert set(own) <= TINY_MAY_SET, f"set without need: {sorted(set(own) - TINY_MAY_SET)}"
    base = _keys(tomllib.loads(ref.path.read_text()))
    assert [k for k in own if k in base and own[k] == base[k]] == [], "set to the reference's own value"
    assert tiny.base == "reference" and tiny.box.gpus == 1 and tiny.box.cuda == ref.box.cuda
    for field in ("device", "kv_cache_dtype", "scales", "speculative", "block_size", "cudagraph_tokens_per_seq",
                  "health", "max_model_len", "served_name", "service_name", "extra_args", "env", "abliteration"):
        assert getattr(tiny, field) == getattr(ref, field), field


def _files(tmp_path: Path, **texts: str) -> Path:
    for name, text in texts.items():
        (tmp_path / f"{name}.toml").write_text(text)
    return tmp_path


def test_a_profile_takes_every_key_of_its_base_and_merges_its_tables(tmp_path):
    folder = _files(tmp_path, top=GOOD + 'cuda = "13.0"\n[env]\nA = "1"\n',
                    mid='base = "top"\nmax_model_len = 1024\n[box]\ngpus = 2\n',
                    low='base = "mid"\ndescription = "low"\n[env]\nB = "2"\n')
    low = profiles.load("low", folder)
    assert (low.description, low.max_model_len, low.box.gpus, low.box.cuda) == ("low", 1024, 2, (13, 0))
    assert low.env == {"A": "1", "B": "2"} and low.served_name == "m" and low.base == "mid"
    gone = profiles.load("x", _files(tmp_path, x='base = "top"\nenv = {}\n'))
    assert gone.env == {}  # an empty table removes the base's


@pytest.mark.parametrize("texts,file,key,want", [
    ({"a": 'base = "nosuch"\n'}, "a", "base", "one of the profiles in"),
    ({"a": 'base = "b"\n', "b": 'base = "a"\n'}, "b", "base", "the cycle a -> b -> a"),
    ({"a": 'base = "a"\n'}, "a", "base", "the cycle a -> a"),
    ({"a": 'base = "top"\ndevice = "cpu"\n'}, "a", "device", "'cuda', the device of its base"),
    ({"a": 'base = "top"\nmax_model_len = "long"\n'}, "a", "max_model_len", "a int"),
    ({"a": 'base = "broken"\n', "broken": GOOD.replace("max_model_len = 4096", "max_model_len = []")}, "broken",
     "max_model_len", "a int"),
    ({"a": 'base = "top"\n[box]\ngpus = "two"\n'}, "a", "box.gpus", "a int"),
    ({"a": 'base = 3\n'}, "a", "base", "a str"),
])
def test_bad_inheritance_names_the_file_and_the_key(tmp_path, texts, file, key, want):
    folder = _files(tmp_path, top=GOOD, **texts)
    with pytest.raises(BadInput) as e:
        profiles.load("a", folder)
    assert e.value.code == 2 and f"{folder / (file + '.toml')}: {key}" in e.value.message, e.value.message
    assert want in e.value.message and "Fix:" in e.value.message, e.value.message


def test_following_the_fix_of_a_bad_base_clears_it(tmp_path):
    folder = _files(tmp_path, top=GOOD, a='base = "nosuch"\n')
    with pytest.raises(BadInput):
        profiles.load("a", folder)
    (folder / "a.toml").write_text('base = "top"\n')  # "set base to one of them"
    assert profiles.load("a", folder).served_name == "m"


def test_a_variant_that_keeps_its_bases_made_checkpoint_is_made_too(tmp_path):
    """./start.sh makes the checkpoint of the profiles rig/build/demo.py knows, and of a variant of one that keeps
    its checkpoint (benchmarks/gpu_figures.py serves such variants); a variant that names its own is not made."""
    from rig.control.start import made_kind

    for f in profiles.MODELS_DIR.glob("*.toml"):
        (tmp_path / f.name).write_text(f.read_text())
    (tmp_path / "share.toml").write_text('base = "reference-tiny"\nmemory_utilization = 0.28\n')
    (tmp_path / "share-of-share.toml").write_text('base = "share"\nspeculative = {}\n')
    (tmp_path / "own.toml").write_text('base = "reference-tiny"\ncheckpoint = "/models/own"\n')
    kinds = {n: made_kind(profiles.load(n, tmp_path)) for n in ("reference-tiny", "share", "share-of-share", "own",
                                                                  "reference", "demo")}
    assert kinds == {"reference-tiny": "qwen3next", "share": "qwen3next", "share-of-share": "qwen3next", "own": "",
                     "reference": "", "demo": "qwen3"}
