"""The PLE offload's facts the rig checks before a start (patch 0007, ``PLE_OFFLOAD``, holds the table).

The size of Gemma 3n's per-layer-embedding table is read from the checkpoint's safetensors headers (a few KiB
read, never the table): the box check needs that much RAM available, and the card it would have taken is
freed. ``PLE_HOME`` must be a card the engine gets, checked against the topology's cards before anything
starts.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path

from rig.base.errors import BadInput, problem

#: The table's name in a Gemma 3n checkpoint ends so (the patch looks for the same).
TABLE = "embed_tokens_per_layer.weight"


def _files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        return [ckpt / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(ckpt.glob("*.safetensors"))


def table_bytes(ckpt: Path) -> tuple[str, int] | None:
    """(tensor name, bytes) of the checkpoint's per-layer-embedding table, or None when it has none."""
    for f in _files(ckpt):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for key, meta in header.items():
            if key.endswith(TABLE):
                start, end = meta["data_offsets"]
                return key, end - start
    return None


def check_home(home: int, cards: Sequence[int], device: str) -> None:
    """PLE_HOME names a card the engine gets (CUDA_VISIBLE_DEVICES as the topology orders it); exit 2 if not."""
    if device == "cpu":
        if home != 0:
            raise BadInput(problem("PLE_HOME", "0 on the CPU build (it has no cards: the rows stay in host memory)",
                                   str(home), "unset PLE_HOME, or set PLE_HOME=0"))
        return
    if home not in cards:
        raise BadInput(problem("PLE_HOME", f"one of the cards the engine gets, CUDA_VISIBLE_DEVICES="
                               f"{','.join(map(str, cards))}", str(home),
                               f"set PLE_HOME to one of {', '.join(map(str, cards))}, or add card {home} to "
                               "CUDA_VISIBLE_DEVICES"))
