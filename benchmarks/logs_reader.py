# /// script
# requires-python = ">=3.11"
# dependencies = ["tomli-w>=1.0", "psutil>=5.9", "nvidia-ml-py>=12", "packaging>=24"]
# ///
"""The log reader: lines parsed per second on a 1,000,000-line log against `wc -l` of the same file,
and follow-mode latency from a write to the printed line (targets >= 300k lines/s, <= 200 ms).

  uv run benchmarks/logs_reader.py [--lines 1000000] [--updates 20] [--quick]

--quick: 30,000 lines and 5 updates (CI runs it so); the dependencies are the rig's (pyproject.toml), as the
follow part runs `python -m rig.cli logs -f`, which imports the rig's whole command table.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import timed  # noqa: E402

from rig.control.logview import Palette, lines_of  # noqa: E402
from rig.running.logs import parse  # noqa: E402

STATS = ("(APIServer pid=41) INFO 12-02 18:{m:02d}:{s:02d} [loggers.py:260] Engine 000: Avg prompt throughput: "
         "2254.6 tokens/s, Avg generation throughput: 131.8 tokens/s, Running: {i} reqs, Waiting: 0 reqs, "
         "GPU KV cache usage: 3.2%, Prefix cache hit rate: 38.5%")
SPEC = ("(APIServer pid=41) INFO 12-02 18:00:00 [metrics.py:90] SpecDecoding metrics: Mean acceptance length: 2.71, "
        "Accepted throughput: 81.40 tokens/s, Drafted throughput: 142.80 tokens/s, Accepted: 814 tokens, Drafted: "
        "1428 tokens, Per-position acceptance rate: 0.871, 0.552, 0.287, Avg Draft acceptance rate: 57.0%")
OTHER = "(APIServer pid=41) INFO 12-02 18:00:00 [logger.py:39] Received request chatcmpl-1234: prompt: 'hi'"


def make_log(path: Path, n: int) -> None:
    with open(path, "w") as fh:
        for i in range(n // 3):
            fh.write(STATS.format(m=(i // 60) % 60, s=i % 60, i=i % 8) + "\n" + SPEC + "\n" + OTHER + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--updates", type=int, default=20, help="follow mode: stats updates timed")
    ap.add_argument("--quick", action="store_true", help="30,000 lines, 5 updates: the same code, in seconds")
    a = ap.parse_args()
    if a.quick:
        a.lines, a.updates = min(a.lines, 30_000), min(a.updates, 5)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "vllm.log"
        make_log(log, a.lines)
        n = sum(1 for _ in open(log, "rb"))
        wc = timed(lambda: subprocess.run(["wc", "-l", str(log)], check=True, capture_output=True))
        counts = {"stats": 0, "unparsed": 0}

        def read_all() -> None:
            with open(log, encoding="utf-8", errors="replace") as fh:
                for _ in lines_of((parse(x) for x in fh), Palette(False), counts):
                    pass

        t = timed(read_all)
        print(f"parse + render of {n:,} lines ({counts['stats']:,} stats updates): {t:.2f} s, {n / t:,.0f} lines/s"
              f"  | wc -l: {wc:.3f} s, {n / wc:,.0f} lines/s  | ratio {t / wc:.0f}x wc's time  | target >= 300,000")

        live = Path(tmp) / "live.log"
        live.write_text("")
        err = Path(tmp) / "follow.err"
        with open(err, "w") as err_fh:
            p = subprocess.Popen([sys.executable, "-m", "rig.cli", "logs", "-f", "-n", "0"], cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=err_fh,
                                 env={**os.environ, "LOG": str(live), "PYTHONUNBUFFERED": "1"})
        printed: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [printed.put(line) for line in p.stdout] + [printed.put("")],
                         daemon=True).start()

        def next_line(what: str, timeout: float = 30) -> str:
            try:
                line = printed.get(timeout=timeout)
            except queue.Empty:
                raise SystemExit(f"python -m rig.cli logs -f printed nothing for {timeout:.0f} s ({what})") from None
            if not line:
                raise SystemExit(f"python -m rig.cli logs -f ended (exit {p.wait()}) before {what}:\n"
                                 f"{err.read_text()[-3000:]}")
            return line

        try:
            with open(live, "a") as fh:
                # ready once it prints one: a line written before it opened the file (-n 0) is never printed
                for _ in range(120):
                    fh.write(STATS.format(m=59, s=59, i=0) + "\n" + SPEC + "\n")
                    fh.flush()
                    if not printed.empty():
                        break
                    time.sleep(1.0)
                next_line("any of the updates written to see it started", 1)
                time.sleep(0.5)
                while not printed.empty():
                    printed.get()
                lat = []
                for i in range(a.updates):
                    t0 = time.perf_counter()
                    fh.write(STATS.format(m=0, s=i, i=i) + "\n" + SPEC + "\n")
                    fh.flush()
                    while f"18:00:{i:02d}" not in next_line(f"update {i + 1}"):  # its own line, not an earlier one
                        pass
                    lat.append(time.perf_counter() - t0)
                    time.sleep(0.1)
        finally:
            p.terminate()
            p.wait()
        print(f"follow latency, write to printed line, {a.updates} updates: median "
              f"{statistics.median(lat) * 1000:.0f} ms, max {max(lat) * 1000:.0f} ms  | target <= 200 ms")


if __name__ == "__main__":
    main()
