"""The demo maker's lock (rig.build.demo.ensure): two makers of one folder at once, as two rigs sharing RIG_CACHE
or the suite's two lanes do. A stand-in for the venv's python writes the checkpoint slowly and counts its runs."""

from __future__ import annotations

import threading
from pathlib import Path

from rig.build import demo

SLOW_MAKER = """#!/bin/sh
# python -m rig.build.demo FOLDER KIND, slowly: long enough for a second maker to find this one at work
echo run >> "{runs}"
sleep 1
echo '{{}}' > "$3/config.json"
echo '{{}}' > "$3/{sidecar}"
"""


def test_two_makers_at_once_make_it_once_and_neither_removes_the_others_folder(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    python = tmp_path / "python"
    python.write_text(SLOW_MAKER.format(runs=runs, sidecar=demo.SIDECAR))
    python.chmod(0o755)
    folder = tmp_path / "models" / "demo"
    got: list[tuple[bool, float]] = []
    makers = [threading.Thread(target=lambda: got.append(demo.ensure(python, folder, tmp_path))) for _ in range(2)]
    for t in makers:
        t.start()
    for t in makers:
        t.join(30)
    assert sorted(made for made, _ in got) == [False, True]  # one made it, the other waited and took it
    assert runs.read_text().count("run") == 1
    assert demo.ready(folder) and (folder / "config.json").exists()
    assert not list(folder.parent.glob(".demo.making-*"))
