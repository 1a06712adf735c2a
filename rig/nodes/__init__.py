"""Serving one model across nodes: the head's node registry, the client each node talks to it with, a worker's agent.

vLLM's own multi-node engine does the serving (``--nnodes``/``--node-rank``/``--headless``, or Ray); the rig
adds what users trip over around it:

* *One build everywhere.* Each node reports its tree id, OPS_OBJ, device, card count and the checkpoint's
  ``config.json`` hash; the head compares every report with its own values and refuses a node that differs,
  naming the node and the value, before anything starts (:mod:`rig.nodes.client` says what a node is,
  :mod:`rig.nodes.registry` compares).
* *Start order.* The head's registry (a small HTTP service on ``HEAD_ADDR:NODES_PORT``, in its own session:
  :mod:`rig.nodes.registry`) comes up first; workers wait for it and retry; the head starts its engine once
  every worker has joined, and only then tells the workers to start theirs (the order is :mod:`rig.nodes.part`'s).
* *One stop.* Each worker runs an agent beside its engine (:mod:`rig.nodes.agent`): it beats to the registry
  every second with its engine's state, stops the engine when the head says so (or when the head is gone), and
  leaves. ``status`` on the head lists every node from those beats.

``RIG_STATE/nodes.toml`` says which role this node plays and the pid of its registry or agent. The Ray cluster
(``DIST_BACKEND=ray``) is rig/nodes/raycluster.py, in this package: the nodes layer's folder.
"""
