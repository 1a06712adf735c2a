# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0"]
# ///
"""Pack and verify on the real kernels of the last ./build.sh, each against a baseline of the same run.

  uv run benchmarks/pack_verify.py          (after ./build.sh: it reads vllm/.build-products.sha256)

Pack time and size with zstd (multithreaded) and with gzip, against `tar czf` of the same files
(target: >= 5x faster than tar czf at no larger size). Verify throughput against `sha256sum` of
the same files (target >= 0.8x); verify also writes every file it installs, which sha256sum does
not, so the write speed of the same files (`cp -r` of the folder) is printed too.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from timing import median_time, timed  # noqa: E402,F401 - benchmarks/timing.py

from rig import artifacts  # noqa: E402

FACTS = {"ops_obj": "benchmark", "tree": "benchmark", "route": "benchmark", "arch": "8.6", "python": "3.13",
         "cuda": "13", "torch": "2.13.0"}



def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    vllm = ROOT / "vllm"
    sums = vllm / ".build-products.sha256"
    if not sums.exists():
        raise SystemExit("no vllm/.build-products.sha256: run ./build.sh first")
    names = [line.split("  ", 1)[1] for line in sums.read_text().splitlines()]
    total = sum((vllm / n).stat().st_size for n in names)
    tmp = Path(tempfile.mkdtemp(prefix="rig-bench-pack-"))
    try:
        lst = tmp / "list"
        lst.write_text("\n".join(names) + "\n")
        subprocess.run(["cat", *[str(vllm / n) for n in names]], stdout=subprocess.DEVNULL)  # warm the cache
        t_czf = timed(lambda: subprocess.run(["tar", "czf", str(tmp / "b.tar.gz"), "-C", str(vllm), "-T", str(lst)],
                                             check=True))
        s_czf = (tmp / "b.tar.gz").stat().st_size
        print(f"{len(names)} files, {total / 1e6:.0f} MB (the products of the last build)")
        print(f"tar czf (baseline): {t_czf:.1f} s, {s_czf / 1e6:.0f} MB")
        for comp in ("zstd", "gzip"):
            out = tmp / comp
            t = timed(lambda out=out, comp=comp: artifacts.pack(vllm, out, FACTS, progress=False, compression=comp))
            size = next(out.glob("ops.tar.*")).stat().st_size
            print(f"pack with {comp}: {t:.1f} s, {size / 1e6:.0f} MB  | {t_czf / t:.1f}x faster than tar czf, "
                  f"size {size / s_czf:.2f}x  | target >= 5x at <= 1.00x")
        t_sum = timed(lambda: subprocess.run(["sha256sum", *[str(vllm / n) for n in names]],
                                             stdout=subprocess.DEVNULL, check=True))
        target = {k: FACTS[k] for k in ("arch", "python", "cuda", "torch")}
        t_ver = timed(lambda: artifacts.verify(tmp / "zstd", tmp / "dest", target))
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
