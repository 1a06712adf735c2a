"""Topology from the cards and their P2P links: 1, 2, 4 (the reference box) and 8 cards."""

from __future__ import annotations

import pytest

from rig import topology


def no_p2p(n: int) -> dict:
    return {(a, b): "not supported" for a in range(n) for b in range(n) if a != b}


def test_one_card():
    t = topology.choose([0], {})
    assert (t.tp, t.pp, t.ep) == (1, 1, False) and topology.engine_args(t) == ["--tensor-parallel-size", "1",
                                                                               "--pipeline-parallel-size", "1"]


def test_two_geforce_cards():
    t = topology.choose([0, 1], no_p2p(2))
    assert (t.tp, t.pp, t.ep) == (2, 1, True)
    assert "--disable-custom-all-reduce" in t.flags and t.env == {"NCCL_P2P_DISABLE": "1"}


def test_reference_box_four_3090s_tp2_pp2_ep():
    t = topology.choose([0, 1, 2, 3], no_p2p(4))
    assert (t.tp, t.pp, t.ep) == (2, 2, True)
    assert topology.engine_args(t) == ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
                                       "--enable-expert-parallel", "--disable-custom-all-reduce"]


def test_tp_pairs_go_on_the_cards_that_talk_best():
    p2p = no_p2p(4)
    p2p[(0, 2)] = p2p[(2, 0)] = "ok"  # an NVLink bridge between 0 and 2, another between 1 and 3
    p2p[(1, 3)] = p2p[(3, 1)] = "ok"
    t = topology.choose([0, 1, 2, 3], p2p)
    assert t.order == (0, 2, 1, 3) and (t.tp, t.pp) == (2, 2)
    assert t.flags == () and t.env == {}  # the pairs have P2P: custom all-reduce can stay on


@pytest.mark.parametrize("links,want", [("not supported", (2, 4)), ("ok", (8, 1))])
def test_eight_cards(links, want):
    p2p = {(a, b): links for a in range(8) for b in range(8) if a != b}
    t = topology.choose(list(range(8)), p2p)
    assert (t.tp, t.pp) == want and t.ep
    assert sorted(t.order) == list(range(8))


def test_no_gpus_is_an_error():
    with pytest.raises(ValueError):
        topology.choose([], {})
