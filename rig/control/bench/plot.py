"""The sweep plot (``throughput.png``): prompt and generation throughput against the swept value.

matplotlib is imported only when a plot is drawn: it is in the bench venv, not in every Python
that imports ``rig.control.bench`` (``python3 -m rig.control.bench table`` runs without it). The plotted figures
ride in the PNG's metadata, so the picture can be checked without reading pixels.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence

from rig.control.bench.cells import Cell
from rig.control.bench.request import Request


def plot_series(req: Request, rows: Sequence[Cell]) -> dict | None:
    """What the sweep plot shows: prompt and generation t/s against the swept value, one line per other value."""
    axis = req.sweep
    if axis is None:
        return None
    other = "depth" if axis == "concurrency" else "concurrency"
    series = []
    for v in getattr(req, other):
        pts = sorted((getattr(c, axis), c) for c in rows if c.phase == "turn" and getattr(c, other) == v)
        series.append({"label": f"{other} {v}", "x": [x for x, _ in pts],
                       "prompt": [c.prompt[0] if c.prompt else None for _, c in pts],
                       "generation": [c.gen[0] if c.gen else None for _, c in pts]})
    return {"x": axis, "series": series}


def plot(req: Request, data: dict) -> bytes:
    """The PNG: prompt and generation throughput against the swept value; the data rides in its metadata."""
    import matplotlib  # the bench venv's alone: the rest of the rig never plots

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # after the backend is chosen

    fig, axes = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for ax, what, title in ((axes[0], "prompt", "prompt processing"), (axes[1], "generation", "generation")):
        for s in data["series"]:
            ys = [float("nan") if y is None else y for y in s[what]]
            ax.plot(s["x"], ys, marker="o", label=s["label"])
        ax.set_ylabel("tokens/s (total)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[1].set_xlabel(data["x"])
    if data["x"] == "concurrency":
        axes[1].set_xticks(sorted({x for s in data["series"] for x in s["x"]}))
    fig.suptitle(f"PP {req.pp}, TG {req.tg}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Title": f"llama-benchy PP {req.pp} TG {req.tg}",
                                                       "Description": json.dumps(data)})
    plt.close(fig)
    return buf.getvalue()
