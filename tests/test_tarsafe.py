"""rig.base.tarsafe: tarfile's ``data`` filter where the Python lacks it (Debian 12's python3 is 3.11.2, before 3.11.4).

The fallback is held against tarfile's own filter member by member, then run for real on Debian's python3.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from rig.base import tarsafe

ROOT = Path(__file__).resolve().parent.parent
DEBIAN = Path("/usr/bin/python3")


def member(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.mode, m.linkname, m.uid, m.gid, m.uname, m.gname = kind, mode, link, 1000, 1000, "me", "me"
    return m


CASES = {
    "a file": member("pkg/a.py"),
    "an executable with setuid and group write": member("bin/run", mode=0o6775),
    "a file only the group can run": member("odd", mode=0o614),
    "a leading slash": member("/etc/passwd"),
    "a folder": member("pkg", tarfile.DIRTYPE, 0o777),
    "a link inside": member("pkg/b.py", tarfile.SYMTYPE, link="a.py"),
    "a hard link inside": member("pkg/c.py", tarfile.LNKTYPE, link="pkg/a.py"),
    "a name that climbs out": member("../evil"),
    "a name that climbs out midway": member("pkg/../../evil"),
    "a link to an absolute path": member("pkg/passwd", tarfile.SYMTYPE, link="/etc/passwd"),
    "a link that climbs out": member("pkg/up", tarfile.SYMTYPE, link="../../x"),
    "a hard link out": member("pkg/h", tarfile.LNKTYPE, link="../x"),
    "a character device": member("dev/null", tarfile.CHRTYPE),
    "a fifo": member("pipe", tarfile.FIFOTYPE),
}


@pytest.mark.skipif(not tarsafe.NATIVE, reason="this Python has no tarfile.data_filter to compare with")
@pytest.mark.parametrize("case", list(CASES))
def test_the_fallback_decides_as_tarfiles_own_filter(case, tmp_path):
    m = CASES[case]
    try:
        want = tarfile.data_filter(m, str(tmp_path))
    except tarfile.FilterError:
        want = None
    try:
        got = tarsafe._fallback(m, str(tmp_path))
    except tarsafe.Unsafe as exc:
        assert want is None, f"{case}: the fallback refused ({exc}), tarfile accepts it"
        with pytest.raises(tarsafe.Unsafe):
            tarsafe.data_filter(m, tmp_path)  # the native route raises the same exception type
        return
    assert want is not None, f"{case}: the fallback accepted {got.name!r}, tarfile refuses it"
    assert got.name == want.name
    if m.isreg():
        assert got.mode == want.mode, f"{case}: mode {got.mode:o}, tarfile's {want.mode:o}"
    assert got.mode & 0o7022 == 0


def test_renamed_leaves_the_original_alone():
    m = member("vllm-0.30.0/setup.py")
    new = tarsafe.renamed(m, name="setup.py")
    assert (new.name, m.name, new.size, new.mode) == ("setup.py", "vllm-0.30.0/setup.py", m.size, m.mode)


SCRIPT = r"""
import io, os, sys, tarfile
from rig.base import tarsafe

assert not tarsafe.NATIVE, "this python has tarfile.data_filter"
def tar(*members):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, kind, link, data in members:
            m = tarfile.TarInfo(name)
            m.type, m.linkname, m.mode, m.size = kind, link, 0o4777 if kind == tarfile.REGTYPE else 0o755, len(data)
            m.uid = m.gid = 4242
            tf.addfile(m, io.BytesIO(data))
    buf.seek(0)
    return tarfile.open(fileobj=buf)

dest = sys.argv[1]
good = tar(("top/", tarfile.DIRTYPE, "", b""), ("top/pkg/a.py", tarfile.REGTYPE, "", b"print(1)\n"),
           ("top/pkg/b.py", tarfile.SYMTYPE, "a.py", b""))
members = [tarsafe.renamed(m, name=m.name[4:]) for m in good.getmembers() if m.name != "top"]
tarsafe.extract_all(good, os.path.join(dest, "ok"), members)
st = os.stat(os.path.join(dest, "ok/pkg/a.py"))
print("mode", oct(st.st_mode & 0o7777), "owner", st.st_uid, "link", os.readlink(os.path.join(dest, "ok/pkg/b.py")))
for case, members in {
    "climb": [("../escaped", tarfile.REGTYPE, "", b"x")],
    "absolute link": [("l", tarfile.SYMTYPE, "/etc", b"")],
    "through a link": [("b", tarfile.DIRTYPE, "", b""), ("a", tarfile.SYMTYPE, "b/..", b""),
                       ("a/../escaped", tarfile.REGTYPE, "", b"x")],
}.items():
    os.makedirs(os.path.join(dest, case))
    try:
        tarsafe.extract_all(tar(*members), os.path.join(dest, case), tar(*members).getmembers())
    except tarsafe.Unsafe as exc:
        print("refused", case, "|", exc)
    else:
        print("extracted", case)
"""


@pytest.mark.skipif(not DEBIAN.exists(), reason="no Debian python3 at /usr/bin/python3")
def test_debians_python_extracts_through_the_fallback(tmp_path):
    has = subprocess.run([str(DEBIAN), "-c", "import tarfile; print(hasattr(tarfile, 'data_filter'))"],
                         capture_output=True, text=True).stdout.strip()
    if has != "False":
        pytest.skip(f"{DEBIAN} has tarfile.data_filter: the fallback is not its route")
    r = subprocess.run([str(DEBIAN), "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    owner = os.getuid()
    assert lines[0] == f"mode 0o755 owner {owner} link a.py", lines
    assert (tmp_path / "ok/pkg/a.py").read_text() == "print(1)\n"
    assert [ln.split(" |")[0] for ln in lines[1:]] == ["refused climb", "refused absolute link",
                                                         "refused through a link"], lines
    assert not (tmp_path / "escaped").exists() and not list(tmp_path.parent.glob("escaped"))
    assert "outside the destination" in lines[3]


def test_a_member_read_back_is_the_one_written(tmp_path):
    """extract_all on this Python (native or not) writes the renamed member's data."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        m = tarfile.TarInfo("vllm-0.30.0/x.txt")
        m.size = 3
        tf.addfile(m, io.BytesIO(b"abc"))
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tf:
        tarsafe.extract_all(tf, tmp_path, [tarsafe.renamed(m, name="x.txt") for m in tf.getmembers()])
    assert (tmp_path / "x.txt").read_bytes() == b"abc"
