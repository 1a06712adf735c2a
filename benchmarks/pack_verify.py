# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""Pack and verify on the real kernels of the last ./build.sh, each against a baseline of the same run.

  uv run benchmarks/pack_verify.py [--rig DIR] [--mb N] [--quick]
                                            (after ./build.sh: it reads vllm/.build-products.sha256)

Pack time and size with zstd (multithreaded) and with gzip, against `tar czf` of the same files
(target: >= 5x faster than tar czf at no larger size). Verify (rig/build/verify.py) throughput against
`sha256sum` of the same files (target >= 0.8x); verify also writes every file it installs, which
sha256sum does not, so the write speed of the same files (`cp -r` of the folder) is printed too.
The manifest's facts are the build's own (artifacts/manifest.toml), so verify checks the tarball
against the target this build was made for.

--rig DIR: the built copy of the rig to read (default: this checkout). --mb N: only the first kernel files
in the build's list that fit in N MB (linked into a scratch tree beside them). --quick: --mb 16 (CI runs it so).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from timing import timed  # noqa: E402 - benchmarks/timing.py

from rig.build.artifacts import MANIFEST, pack, read_manifest  # noqa: E402
from rig.build.verify import verify  # noqa: E402

#: The manifest's fields that say what the kernels are and were built for (the rest pack writes itself).
FACTS = ("device", "ops_obj", "tree", "route", "arch", "python", "cuda", "torch")
TARGET = ("device", "arch", "python", "cuda", "torch")  # what verify is asked to install them for
SUMS = ".build-products.sha256"


def subset(vllm: Path, lines: list[str], limit: int, dest: Path) -> Path:
    """A scratch tree holding the listed files that fit in ``limit`` bytes, in the list's order (hard links where
    the file system allows, else copies), with its own sha256 list: what pack reads."""
    kept, total = [], 0
    for line in lines:
        name = line.split("  ", 1)[1]
        size = (vllm / name).stat().st_size
        if total + size > limit:
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(vllm / name, dest / name)
        except OSError:
            shutil.copy2(vllm / name, dest / name)
        kept.append(line)
        total += size
    if not kept:
        raise SystemExit(f"--mb: no kernel file of {vllm} fits in {limit / 1e6:.0f} MB")
    (dest / SUMS).write_text("\n".join(kept) + "\n")
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rig", type=Path, default=ROOT, help="the built copy of the rig (default: this one)")
    ap.add_argument("--mb", type=float, help="only the kernel files that fit in this many MB (default: all)")
    ap.add_argument("--quick", action="store_true", help="--mb 16: the same code, in seconds")
    a = ap.parse_args()
    if a.quick and a.mb is None:
        a.mb = 16
    rig = a.rig.resolve()
    vllm = rig / "vllm"
    sums = vllm / SUMS
    if not sums.exists():
        raise SystemExit(f"no {sums}: run ./build.sh in {rig} first")
    manifest = read_manifest(rig / "artifacts" / MANIFEST)  # the build's pack: its facts
    facts = {k: manifest[k] for k in FACTS}
    tmp = Path(tempfile.mkdtemp(prefix="rig-bench-pack-"))
    try:
        lines = sums.read_text().splitlines()
        if a.mb is not None:
            vllm = subset(vllm, lines, int(a.mb * 1e6), tmp / "subset")
            lines = (vllm / SUMS).read_text().splitlines()
        names = [line.split("  ", 1)[1] for line in lines]
        total = sum((vllm / n).stat().st_size for n in names)
        lst = tmp / "list"
        lst.write_text("\n".join(names) + "\n")
        subprocess.run(["cat", *[str(vllm / n) for n in names]], stdout=subprocess.DEVNULL)  # warm the cache
        t_czf = timed(lambda: subprocess.run(["tar", "czf", str(tmp / "b.tar.gz"), "-C", str(vllm), "-T", str(lst)],
                                             check=True))
        s_czf = (tmp / "b.tar.gz").stat().st_size
        what = f"those of the last build's products that fit in {a.mb:g} MB, --mb" if a.mb else "the products of " \
            "the last build"
        print(f"{len(names)} files, {total / 1e6:.0f} MB ({what})")
        print(f"tar czf (baseline): {t_czf:.1f} s, {s_czf / 1e6:.0f} MB")
        for comp in ("zstd", "gzip"):
            out = tmp / comp
            t = timed(lambda out=out, comp=comp: pack(vllm, out, facts, progress=False, compression=comp))
            size = next(out.glob("ops.tar.*")).stat().st_size
            print(f"pack with {comp}: {t:.1f} s, {size / 1e6:.0f} MB  | {t_czf / t:.1f}x faster than tar czf, "
                  f"size {size / s_czf:.2f}x  | target >= 5x at <= 1.00x")
        t_sum = timed(lambda: subprocess.run(["sha256sum", *[str(vllm / n) for n in names]],
                                             stdout=subprocess.DEVNULL, check=True))
        target = {k: facts[k] for k in TARGET}
        target["python"] = str(facts["python"]).split()[-1]  # a target is one Python: one the kernels load under
        t_ver = timed(lambda: verify(tmp / "zstd", tmp / "dest", target))
        installed = sum(1 for p in (tmp / "dest").rglob("*") if p.is_file())
        if installed != len(names):
            raise SystemExit(f"verify installed {installed} files, expected {len(names)}")
        t_cp = timed(lambda: shutil.copytree(vllm / "vllm", tmp / "copy", copy_function=shutil.copyfile,
                                             ignore=shutil.ignore_patterns("__pycache__")))
        mb = total / 1e6
        print(f"sha256sum (baseline): {t_sum:.2f} s, {mb / t_sum:.0f} MB/s")
        print(f"verify (inspect, extract with the data filter, re-hash, install): {t_ver:.2f} s, {mb / t_ver:.0f} MB/s"
              f"  | {t_sum / t_ver:.2f}x sha256sum's throughput  | target >= 0.8x")
        print(f"for scale, copying the package folder (writes the same bytes): {t_cp:.2f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
