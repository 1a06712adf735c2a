"""rig/facts/config.py: the one list of variables, and the README table that must match it."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, run_rig, variables_table

from rig.base.errors import BadInput
from rig.facts import config, profiles


def test_variables_page_matches_config():
    """docs/variables.md holds every variable, as rig/facts/config.py defines it, in its order."""
    full = variables_table((ROOT / "docs" / "variables.md").read_text())
    assert full == [(v.name, v.default, v.meaning) for v in config.VARS]


def test_readme_table_is_rows_of_the_variables_page_in_its_order():
    full = variables_table((ROOT / "docs" / "variables.md").read_text())
    short = variables_table((ROOT / "README.md").read_text())
    assert len(short) >= 5 and short == [row for row in full if row in short]


def test_defaults_are_what_the_table_says():
    s = config.settings({})
    by = {v.name: v.default for v in config.VARS}
    assert str(s.max_jobs) == by["MAX_JOBS"] and s.arch == by["ARCH"]
    assert s.fetch is False and by["FETCH"] == "0" and s.pack is True and by["PACK"] == "1"
    assert s.source == by["VLLM_SOURCE"] and s.index_url == by["INDEX_URL"]
    assert s.patches_dir == ROOT / by["PATCHES_DIR"] and by["VLLM_DIR"].startswith(f"`{s.vllm_dir.name}`")
    cpu = config.settings({"DEVICE": "cpu"})
    assert s.device == by["DEVICE"] == "cuda" and f"`{cpu.vllm_dir.name}` with `DEVICE=cpu`" in by["VLLM_DIR"]
    assert s.state_dir == ROOT / by["RIG_STATE"]
    assert s.uv is None and s.upstream_url is None


@pytest.mark.parametrize("name,value,want", [
    ("MAX_JOBS", "lots", "a whole number"), ("MAX_JOBS", "0", "a whole number"),
    ("FETCH", "yes", "0 or 1"), ("PACK", "true", "0 or 1"), ("VLLM_SOURCE", "svn", "auto or git or sdist"),
    # other scripts' digits: int() takes some ("\u0663", Arabic-Indic 3) and refuses others ("\u00b2", superscript)
    ("MAX_JOBS", "\u0663", "a whole number"), ("MAX_JOBS", "\u00b2", "a whole number"),
    ("NVCC_THREADS", "\uff12", "a whole number"),
])
def test_bad_values_name_the_variable(name, value, want):
    with pytest.raises(BadInput) as e:
        config.settings({name: value})
    assert e.value.code == 2
    assert name in e.value.message and repr(value) in e.value.message and want in e.value.message
    assert "Fix:" in e.value.message


def test_abliteration_is_the_profiles_set_unless_set_and_a_name_never_a_path(tmp_path):
    assert config.serve_settings({}).abliteration == profiles.load("reference").abliteration == ""
    assert config.serve_settings({"QWEN38_ABLITERATION": " my-set.v2 "}).abliteration == "my-set.v2"
    assert config.serve_settings({"QWEN38_ABLITERATION": ""}).abliteration == ""
    for bad in ("../elsewhere", "/etc/x", "sub/set", "-flag"):
        with pytest.raises(BadInput) as e:
            config.serve_settings({"QWEN38_ABLITERATION": bad})
        assert e.value.code == 2 and repr(bad) in e.value.message and "ABLITERATION_DIR" in e.value.message
    (tmp_path / "m.toml").write_text((ROOT / "models" / "demo.toml").read_text().replace(
        'scales = []', 'scales = []\nabliteration = "its-set"'))
    assert profiles.load("m", tmp_path).abliteration == "its-set"
    (tmp_path / "n.toml").write_text((tmp_path / "m.toml").read_text().replace('"its-set"', "3"))
    with pytest.raises(BadInput, match="abliteration"):
        profiles.load("n", tmp_path)
    (tmp_path / "n.toml").write_text((tmp_path / "m.toml").read_text().replace('"its-set"', '"../its-set"'))
    with pytest.raises(BadInput, match="without its folder"):
        profiles.load("n", tmp_path)


def test_bad_value_exits_2_from_the_command_line():
    import os
    r = run_rig({**os.environ, "MAX_JOBS": "many"}, "build", "--only", "tree")
    assert r.code == 2
    assert re.search(r"MAX_JOBS: expected a whole number >= 1, found 'many'", r.err)


def test_every_variable_the_code_reads_is_in_the_table():
    text = (ROOT / "rig/facts/config.py").read_text() + (ROOT / "rig/facts/varparse.py").read_text()
    read = {v.name for v in config.VARS if v.parse} | set(re.findall(r'env\.get\("([A-Z][A-Z0-9_]+)"', text))
    assert read == config.RIG_VARS


@pytest.mark.parametrize("cls,group", [(config.Settings, "build"), (config.Serve, "serve"), (config.Bench, "bench"),
                                       (config.Image, "image")])
def test_each_setting_is_filled_by_exactly_one_variable(cls, group):
    from dataclasses import fields

    filled = [v.field for v in config.VARS if v.group == group and v.parse]
    derived = {"root", "slot_dir"}  # the checkout, and the build an update switched to (rig/facts/slots.py)
    assert sorted(filled) == sorted(f.name for f in fields(cls) if f.name not in derived)


def test_a_default_is_written_once_and_the_parser_reads_it():
    """Changing a default in the table changes the parsed value: no second copy in the code."""
    import dataclasses

    i = next(n for n, v in enumerate(config.VARS) if v.name == "MAX_JOBS")
    changed = (*config.VARS[:i], dataclasses.replace(config.VARS[i], default="7"), *config.VARS[i + 1:])
    try:
        config.VARS, old = changed, config.VARS
        assert config.settings({}).max_jobs == 7
    finally:
        config.VARS = old


@pytest.mark.parametrize("name,value,want", [
    ("PORT", "\u0668\u0660\u0668\u0660", "a port number"), ("START_TIMEOUT", "inf", "a whole number"),
    ("START_TIMEOUT", "\u0663\u0660", "a whole number"), ("CUDA_VISIBLE_DEVICES", "0,\u0661", "card indices"),
    ("GPU_WAIT", "\u00b2", "a whole number"), ("VLLM_LOG_STATS_INTERVAL", "inf", "seconds > 0"),
    ("VLLM_LOG_STATS_INTERVAL", "nan", "seconds > 0"), ("VLLM_LOG_STATS_INTERVAL", "\u0661", "seconds > 0"),
])
def test_serve_numbers_take_ascii_digits_only(name, value, want):
    with pytest.raises(BadInput) as e:
        config.serve_settings({name: value}) if name not in ("CUDA_VISIBLE_DEVICES", "PORT") else \
            config.settings({name: value})
    assert e.value.code == 2 and name in e.value.message and want in e.value.message, e.value.message
    # the fix: the same number in ASCII digits is taken
    fixed = {"PORT": "8080", "START_TIMEOUT": "30", "CUDA_VISIBLE_DEVICES": "0,1", "GPU_WAIT": "2",
             "VLLM_LOG_STATS_INTERVAL": "1.5"}[name]
    config.serve_settings({name: fixed}) if name not in ("CUDA_VISIBLE_DEVICES", "PORT") else \
        config.settings({name: fixed})


def _refusal(name: str, env: dict[str, str]) -> str:
    """The refusal of ``name`` by the settings of ``env`` (build's, then serve's), or '' when none names it."""
    for read in (config.settings, config.serve_settings):
        try:
            read(env)
        except BadInput as e:
            if e.message.startswith(f"{name}:"):
                return e.message
    return ""


def _fixes(name: str, message: str) -> list[dict[str, str] | None]:
    """Each change the refusal's ``Fix:`` offers, as the environment it makes (None: unset the variable)."""
    fix = message.split("Fix:", 1)[1]
    out: list[dict[str, str] | None] = [{name: v} for v in re.findall(rf"\b{name}=([^\s,()]*)", fix)]
    out += [{name: v} for v in re.findall(rf"set {name} to at most (\d+)", fix)]
    one_of = re.search(rf"set {name} to one of ([\w, -]+?)(?:, or|$)", fix)
    if one_of:
        out += [{name: v.strip()} for v in one_of[1].split(",") if v.strip()]
    if re.search(rf"unset (it|{name})", fix):
        out.append(None)
    return out


@pytest.mark.parametrize("var", [v.name for v in config.VARS])
def test_following_a_variables_fix_clears_its_refusal(var):
    """The class 'a fix that loops', for every variable: a bad value is refused naming a fix, and each change that
    fix offers (a value to set, one of a list, or unsetting it) is then taken."""
    refused = [(bad, m) for bad in ("x", "-1", "\u0663", "99999999999999999999") if (m := _refusal(var, {var: bad}))]
    for bad, message in refused:
        assert "Fix:" in message, message
        fixes = _fixes(var, message)
        assert fixes, f"{var}={bad!r}: the fix offers nothing to follow: {message}"
        for env in fixes:
            assert not _refusal(var, env or {}), f"{var}={bad!r}, followed to {env or 'unset'}: {message}"
