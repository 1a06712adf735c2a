"""Topology from the cards and their P2P links: 1, 2, 4 (the reference box) and 8 cards."""

from __future__ import annotations

import pytest

from rig.plan import topology


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


# -- the node dimension: TP inside a node, PP across nodes -------------------------------------------------------


def all_p2p(n: int) -> dict:
    return {(a, b): "ok" for a in range(n) for b in range(n) if a != b}


@pytest.mark.parametrize("nodes", [2, 4])
@pytest.mark.parametrize("cards,links,tp,pp_per_node", [
    (1, {}, 1, 1),                 # one card a node: the demo's case, pipeline only
    (2, no_p2p(2), 2, 1),          # two GeForce cards: a TP2 pair per node
    (4, no_p2p(4), 2, 2),          # the reference box per node: TP2 x PP2
    (8, all_p2p(8), 8, 1),         # eight NVLinked cards: TP8 per node
    (8, no_p2p(8), 2, 4),          # eight without P2P: TP2 pairs x PP4 per node
])
def test_tensor_parallel_stays_inside_a_node_and_the_pipeline_goes_across(nodes, cards, links, tp, pp_per_node):
    t = topology.across([(list(range(cards)), links)] * nodes, layers=48)
    assert (t.tp, t.pp, t.nodes) == (tp, pp_per_node * nodes, nodes)
    assert t.tp * t.pp == cards * nodes  # every card of every node holds one rank
    assert len(t.order) == cards and sorted(t.order) == list(range(cards))  # each node's own cards
    assert f"{nodes} nodes of {cards} card(s): TP{tp} inside each node" in t.why
    assert topology.engine_args(t)[:4] == ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size",
                                           str(pp_per_node * nodes)]


def test_one_node_is_the_one_box_choice():
    assert topology.across([([0, 1, 2, 3], no_p2p(4))], layers=48) == topology.choose([0, 1, 2, 3], no_p2p(4))


def test_the_weakest_node_sets_the_tensor_parallel_size_of_all():
    t = topology.across([(list(range(8)), all_p2p(8)), (list(range(8)), no_p2p(8))], layers=48)
    assert (t.tp, t.pp) == (2, 8) and "--disable-custom-all-reduce" in t.flags


@pytest.mark.parametrize("nodes,cards,layers,want", [
    (4, 1, 2, "found 4 nodes: NODES=1 or 2 would do"),            # the demo's 2 layers over 4 nodes
    (3, 1, 8, "found 3 nodes: NODES=1 or 2 or 4 or 8 would do"),
    (2, 4, 3, r"\(2 pipeline stage\(s\) each\), found 2 nodes: NODES=1 would do"),
])
def test_a_node_count_that_does_not_divide_the_layers_is_refused_with_counts_that_would(nodes, cards, layers, want):
    with pytest.raises(ValueError, match=want):
        topology.across([(list(range(cards)), no_p2p(cards))] * nodes, layers=layers)
    assert topology.across([([0], {})] * 3, layers=48).pp == 3  # three nodes do where they divide the layers


def test_nodes_with_different_card_counts_are_refused_naming_each():
    with pytest.raises(ValueError, match="found node 0: 4, node 1: 2"):
        topology.across([([0, 1, 2, 3], no_p2p(4)), ([0, 1], no_p2p(2))], layers=48)
