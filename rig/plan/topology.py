"""Tensor, pipeline and expert parallel sizes from the GPUs and how they are linked.

A pure function of "the cards I can see, and which pairs can talk peer to peer". The reference
box: four RTX 3090 cards, no P2P between them (GeForce), so TP2 x PP2 + EP with the TP pairs on
the cards that talk best, and vLLM's custom all-reduce (which needs P2P) switched off.

Across nodes (:func:`across`), tensor parallel stays inside a node, where the links are fast,
and pipeline parallel goes across them: a pipeline stage hands on one activation per step,
a tensor-parallel layer all-reduces twice per layer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

#: NVML P2P status -> how good the link is (higher is better).
LINK_SCORE = {"ok": 2}


class Unfit(ValueError):
    """Nodes a model cannot be spread over: what would do, what was found, and the fix (``str``: all three)."""

    def __init__(self, expected: str, found: str, fix: str) -> None:
        super().__init__(f"{expected}, found {found}: {fix}")
        self.expected, self.found, self.fix = expected, found, fix


@dataclass(frozen=True)
class Topology:
    tp: int
    pp: int
    ep: bool
    order: tuple[int, ...]  # GPU indices in the order CUDA_VISIBLE_DEVICES lists them: TP groups adjacent
    flags: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    why: str = ""
    nodes: int = 1


def _score(p2p: dict[tuple[int, int], str], a: int, b: int) -> int:
    return LINK_SCORE.get(p2p.get((a, b)) or p2p.get((b, a)) or "", 0)


def _group_score(p2p: dict[tuple[int, int], str], group: tuple[int, ...]) -> int:
    return min((_score(p2p, a, b) for a, b in itertools.combinations(group, 2)), default=2)


def best_pairs(gpus: list[int], p2p: dict[tuple[int, int], str]) -> list[tuple[int, int]]:
    """Split the cards into pairs so the weakest pair link is as good as it can be (ties: bus order)."""
    if len(gpus) <= 2:
        return [tuple(gpus)] if len(gpus) == 2 else []
    first, rest = gpus[0], gpus[1:]
    best, best_key = None, None
    for mate in rest:
        others = [g for g in rest if g != mate]
        pairs = [(first, mate), *best_pairs(others, p2p)]
        key = (min(_score(p2p, a, b) for a, b in pairs), sum(_score(p2p, a, b) for a, b in pairs))
        if best_key is None or key > best_key:
            best, best_key = pairs, key
    return best or []


def choose(gpus: list[int], p2p: dict[tuple[int, int], str]) -> Topology:
    """The parallel sizes for these cards (their indices in bus order) and their P2P status."""
    n = len(gpus)
    if n == 0:
        raise ValueError("no GPUs")
    if n == 1:
        return Topology(1, 1, False, tuple(gpus), why="one card: no parallelism")
    if n % 2:
        return Topology(1, n, True, tuple(gpus), why=f"{n} cards (odd): pipeline only, experts spread")
    all_p2p = _group_score(p2p, tuple(gpus)) >= LINK_SCORE["ok"]
    if all_p2p and n <= 8:
        return Topology(n, 1, True, tuple(gpus), why=f"{n} cards, all peer to peer: tensor parallel across all")
    pairs = best_pairs(gpus, p2p)
    order = tuple(g for pair in pairs for g in pair)
    pair_p2p = all(_score(p2p, a, b) >= LINK_SCORE["ok"] for a, b in pairs)
    flags: tuple[str, ...] = ()
    env: dict = {}
    if not pair_p2p:
        # GeForce cards have no P2P by default: vLLM's custom all-reduce needs it, and NCCL must not try.
        flags, env = ("--disable-custom-all-reduce",), {"NCCL_P2P_DISABLE": "1"}
    why = (f"{n} cards without P2P across all of them: TP2 pairs {', '.join(f'{a}+{b}' for a, b in pairs)}"
           f" x PP{n // 2}, experts spread over each pair")
    return Topology(2, n // 2, True, order, flags, env, why)


def across(nodes: list[tuple[list[int], dict[tuple[int, int], str]]], layers: int) -> Topology:
    """The parallel sizes for several nodes, each given as (its cards, their P2P status), for a model of
    ``layers`` decoder layers: each node's own choice, with its pipeline stages times the nodes.

    Every node must hold as many cards (vLLM gives each node the same share of the ranks), and the node
    count must divide the layers (each node one even share of the pipeline). Else :class:`Unfit` (a
    ValueError), whose fix says which node counts would do.
    """
    n = len(nodes)
    if n == 1:
        return choose(*nodes[0])
    counts = [len(cards) for cards, _ in nodes]
    if len(set(counts)) > 1:
        raise Unfit("nodes with the same number of cards (vLLM gives each node the same share of the ranks)",
                    ", ".join(f"node {i}: {c}" for i, c in enumerate(counts)),
                    "give every node as many cards (CUDA_VISIBLE_DEVICES)")
    per = [choose(cards, p2p) for cards, p2p in nodes]
    tp = min(t.tp for t in per)  # the weakest node decides: the same TP on every node
    if any(t.tp != tp for t in per):
        per = [choose_tp(cards, p2p, tp) for cards, p2p in nodes]
    first = per[0]
    pp = n * first.pp
    if layers % n or pp > layers:
        fits = [k for k in range(1, layers + 1) if layers % k == 0 and k * first.pp <= layers]
        raise Unfit(f"a node count that divides the model's {layers} layers into one even share per node "
                    f"({first.pp} pipeline stage(s) each)", f"{n} nodes",
                    f"NODES={' or '.join(map(str, fits[-4:]))} would do")
    flags = tuple(dict.fromkeys(f for t in per for f in t.flags))
    env = {k: v for t in per for k, v in t.env.items()}
    why = (f"{n} nodes of {counts[0]} card(s): TP{tp} inside each node ({first.why}), "
           f"PP{pp} across them ({first.pp} stage(s) per node)")
    return Topology(tp, pp, first.ep, first.order, flags, env, why, nodes=n)


def choose_tp(gpus: list[int], p2p: dict[tuple[int, int], str], tp: int) -> Topology:
    """This node's cards at a given TP size (the one every node can do), the rest pipeline stages."""
    t = choose(gpus, p2p)
    if t.tp == tp:
        return t
    n = len(gpus)
    if tp == 1:
        return Topology(1, n, n > 1, tuple(gpus), why=f"{n} card(s): pipeline only, to match the other nodes")
    pairs = best_pairs(gpus, p2p)
    order = tuple(g for pair in pairs for g in pair)
    pair_p2p = all(_score(p2p, a, b) >= LINK_SCORE["ok"] for a, b in pairs)
    flags, env = ((), {}) if pair_p2p else (("--disable-custom-all-reduce",), {"NCCL_P2P_DISABLE": "1"})
    return Topology(2, n // 2, True, order, flags, env, why=f"{n} cards: TP2 pairs, to match the other nodes")


def engine_args(t: Topology) -> list[str]:
    """The ``vllm serve`` switches for a topology."""
    args = ["--tensor-parallel-size", str(t.tp), "--pipeline-parallel-size", str(t.pp)]
    if t.ep:
        args.append("--enable-expert-parallel")
    return args + list(t.flags)
