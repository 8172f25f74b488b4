"""Deadlines that grow with the job: what a wait may take at 4 nodes is too little at 2,048.

Each is a fixed base (what a small job needs: the spec's timeout, or the limit in
`elasticpp.agent.kernel.limits`) plus a per-node term for the work that grows with the cluster:

- the leader's wait for `stopped-G`: every node's arrival is an etcd put, and at a
  transition they all come in one burst (2 ms a node: +4 s at 2,048 nodes);
- the leader's pull of holdings detail: nodes are asked `PULL_PARALLEL` at a time, each
  listing taking milliseconds of the leader's CPU (10 ms a node budgeted: +20 s at 2,048);

The workers' rendezvous timeout grows with the world size in `elasticpp.train.config`
(`rendezvous_timeout_s`), where the workers read it. Pure functions, no I/O.
"""

from __future__ import annotations

from elasticpp.agent.kernel.limits import PULL_DEADLINE_S, STOPPED_WAIT_MARGIN_S

ARRIVAL_S_PER_NODE = 0.002
PULL_S_PER_NODE = 0.01


def stop_wait_s(stop_timeout_s: float, nodes: int) -> float:
    """How long the leader waits for `stopped-G` before setting missing nodes aside."""
    return stop_timeout_s + STOPPED_WAIT_MARGIN_S + ARRIVAL_S_PER_NODE * max(0, nodes)


def pull_deadline_s(nodes: int) -> float:
    """How long the leader's whole pull of holdings from `nodes` nodes may take."""
    return PULL_DEADLINE_S + PULL_S_PER_NODE * max(0, nodes)
