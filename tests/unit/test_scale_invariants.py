"""The invariant checker of bench/scale.py on seeded fault sequences: histories built as the
control plane writes them (terms, generations, arrivals, commits, safe steps, resumes) hold
every invariant, and each kind of break put into one is found and named."""

from __future__ import annotations

import json
import random

import pytest

from bench.scaleinvariants import HistoryEvent, check_history
from elasticpp.cluster.keys import JobKeys

JOB = "j"
K = JobKeys(JOB)


class History:
    """A job's etcd history, written the way the agents write it."""

    def __init__(self) -> None:
        self.events: list[HistoryEvent] = []
        self.leader: str | None = None
        self.generation = 0
        self.safe = 0

    def put(self, key: str, value: object) -> None:
        text = value if isinstance(value, str) else json.dumps(value)
        self.events.append(HistoryEvent(len(self.events) + 1, key, text))

    def delete(self, key: str) -> None:
        self.events.append(HistoryEvent(len(self.events) + 1, key, None))

    def join(self, node: str) -> None:
        self.put(K.node(node), {"address": "x"})

    def lapse(self, node: str) -> None:
        self.delete(K.node(node))
        if self.leader == node:
            self.delete(K.leader)
            self.leader = None

    def elect(self, node: str) -> None:
        self.leader = node
        self.put(K.leader, node)

    def transition(self, nodes: list[str], step: int) -> None:
        """The leader writes G, every node arrives, the leader resumes at `step`."""
        assert self.leader is not None
        self.generation += 1
        g = self.generation
        self.put(K.generation, {"generation": g, "leader": self.leader, "plan": {}})
        for n in nodes:
            self.put(K.barrier(f"stopped-{g}", n), {"digest": {}})
        self.put(
            K.barrier(f"resume-{g}", "resume"), {"node_id": self.leader, "value": {"step": step}}
        )
        for n in nodes:
            self.put(K.barrier(f"started-{g}", n), {"at": 0})
            self.put(K.commit(g, n), {"step": step + 4})
        self.safe = step + 4
        self.put(K.safe, {"generation": g, "step": self.safe})


def seeded(seed: int) -> tuple[History, list[str]]:
    """A fault sequence from `seed`: node losses, leader losses and joins, each followed by
    the transition the control plane makes (resuming at the safe step or later)."""
    rng = random.Random(seed)
    h = History()
    nodes = [f"n{i}" for i in range(6)]
    for n in nodes:
        h.join(n)
    h.elect(nodes[0])
    h.transition(nodes, 0)
    spare = 6
    for _ in range(8):
        fault = rng.choice(["loss", "leader", "join"])
        if fault == "join" or len(nodes) < 3:
            nodes.append(f"n{spare}")
            spare += 1
            h.join(nodes[-1])
        else:
            victim = nodes[0] if fault == "leader" else rng.choice(nodes[1:])
            nodes.remove(victim)
            h.lapse(victim)
        if h.leader is None:
            h.elect(nodes[0])
        h.transition(nodes, h.safe + rng.randint(0, 2))
    return h, nodes


@pytest.mark.parametrize("seed", range(5))
def test_seeded_fault_sequences_hold_every_invariant(seed: int) -> None:
    h, _ = seeded(seed)
    assert check_history(JOB, h.events) == []


@pytest.mark.parametrize("seed", range(5))
def test_a_generation_written_again_by_a_later_term_is_found(seed: int) -> None:
    h, nodes = seeded(seed)
    g = h.generation
    h.lapse(nodes[0])  # the leader's lease lapses; another wins and writes G again
    h.elect(nodes[1])
    h.put(K.generation, {"generation": g, "leader": nodes[1], "plan": {}})
    (found,) = check_history(JOB, h.events)
    assert f"generation {g} written by two leader terms" in found


@pytest.mark.parametrize("seed", range(5))
def test_a_write_after_the_lease_lapsed_is_found(seed: int) -> None:
    h, nodes = seeded(seed)
    h.lapse(nodes[-1])
    h.put(K.commit(h.generation, nodes[-1]), {"step": 99})
    h.lapse(nodes[0])  # the leader too: a generation written with no term held
    h.put(K.generation, {"generation": h.generation + 1, "leader": nodes[0], "plan": {}})
    found = check_history(JOB, h.events)
    assert len(found) == 2
    assert f"node {nodes[-1]} wrote a commit record after its lease lapsed" in found[0]
    assert "while no leader term held the key" in found[1]


def test_the_parts_of_a_large_resume_instruction_are_leader_writes_without_a_step() -> None:
    h, nodes = seeded(0)
    g = h.generation
    h.put(K.barrier(f"resume-{g}", "resume-part-0001"), {"node_id": h.leader, "pieces": []})
    assert check_history(JOB, h.events) == []
    h.lapse(nodes[0])
    h.put(K.barrier(f"resume-{g}", "resume-part-0002"), {"node_id": nodes[0], "pieces": []})
    (found,) = check_history(JOB, h.events)
    assert "resume-part-0002: written while no leader term held the key" in found


@pytest.mark.parametrize("seed", range(5))
def test_a_resume_below_the_published_safe_step_is_found(seed: int) -> None:
    h, nodes = seeded(seed)
    h.lapse(nodes[-1])
    safe = h.safe
    h.transition(nodes[:-1], safe - 1)
    (found,) = check_history(JOB, h.events)
    assert f"resumes at step {safe - 1}, below the published safe step {safe}" in found
