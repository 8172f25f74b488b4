"""The control plane's invariants, checked on a job's etcd history (every change of every key
under the job's root, in revision order, as one watch from revision 1 delivers it):

1. One term per generation: every write of generation G (the `generation` key) happens while
   one leader term holds the leader key (a term is the key's creation: its value, the leader's
   node id, and the revision that created it), the record names that leader, and no other
   term writes G; generation numbers written only grow.
2. No write after a lease lapsed: a node whose member key is gone (its lease lapsed, or it
   left) writes no commit record and arrives at no barrier until it registers again; the
   leader's writes (generation, resume, safe) happen only while a leader key exists.
3. The safe step holds: once a safe step S is published, every resume instruction written
   after it resumes at S or later (a single-node loss must never lose a published safe step;
   a generation whose resume is below S breaks the guarantee, whatever its cause).

`check_history` is pure: it reads a list of `HistoryEvent` and returns the violations found,
each a sentence naming the revision, the key and the rule; an empty list means all held.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from elasticpp.cluster.barriers import RESUME_MEMBER  # the resume member with the step
from elasticpp.cluster.keys import JobKeys

# Keys under barriers/ that the leader writes (every other member is a node's arrival).
LEADER_BARRIERS = frozenset({"timelines"})


@dataclass(frozen=True)
class HistoryEvent:
    """One change of one key: `value` is None for a deletion (or a lease's lapse)."""

    revision: int
    key: str
    value: str | None


@dataclass
class _Replay:
    leader: tuple[str, int] | None = None  # (node id, creating revision) of the current term
    members: set[str] = field(default_factory=set)
    writers: dict[int, tuple[str, int]] = field(default_factory=dict)  # generation -> term
    newest_generation: int = 0
    safe_step: int | None = None


def _json(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return None


def check_history(job: str, events: list[HistoryEvent]) -> list[str]:
    """The violations of the three invariants in `events` (see the module docstring)."""
    keys = JobKeys(job)
    state = _Replay()
    found: list[str] = []
    for ev in sorted(events, key=lambda e: e.revision):
        at = f"revision {ev.revision}, {ev.key}"
        if ev.key == keys.leader:
            if ev.value is None:
                state.leader = None
            elif state.leader is None or state.leader[0] != ev.value:
                state.leader = (ev.value, ev.revision)  # a new term
        elif ev.key.startswith(keys.nodes_prefix):
            node = ev.key[len(keys.nodes_prefix) :]
            if ev.value is None:
                state.members.discard(node)
            else:
                state.members.add(node)
        elif ev.key == keys.generation and ev.value is not None:
            found.extend(_generation_written(state, ev, at))
        elif ev.key == keys.safe and ev.value is not None:
            if state.leader is None:
                found.append(f"{at}: a safe step written while no leader term held the key")
            data = _json(ev.value)
            if isinstance(data, dict) and isinstance(data.get("step"), int):
                state.safe_step = max(state.safe_step or 0, data["step"])
        elif ev.key.startswith(keys.barriers_prefix) and ev.value is not None:
            barrier, _, member = ev.key[len(keys.barriers_prefix) :].partition("/")
            if barrier.startswith("resume-") and member == RESUME_MEMBER:
                found.extend(_resume_written(state, ev, at))
            elif barrier.startswith("resume-") or barrier in LEADER_BARRIERS:
                # the parts of a large resume pieces table, the timelines: the leader's
                if state.leader is None:
                    found.append(f"{at}: written while no leader term held the key")
            elif member not in state.members:
                found.append(f"{at}: node {member} arrived with no live member key (lapsed)")
        elif ev.key.startswith(keys.commits_prefix) and ev.value is not None:
            node = ev.key.rsplit("/", 1)[-1]
            if node not in state.members:
                found.append(f"{at}: node {node} wrote a commit record after its lease lapsed")
    return found


def _generation_written(state: _Replay, ev: HistoryEvent, at: str) -> list[str]:
    assert ev.value is not None
    data = _json(ev.value)
    if not isinstance(data, dict) or not isinstance(data.get("generation"), int):
        return [f"{at}: an unreadable generation record"]
    generation, named = int(data["generation"]), str(data.get("leader"))
    if state.leader is None:
        return [f"{at}: generation {generation} written while no leader term held the key"]
    found = []
    if named != state.leader[0]:
        found.append(
            f"{at}: generation {generation} names leader {named}, the term is {state.leader[0]}'s"
        )
    term = state.writers.setdefault(generation, state.leader)
    if term != state.leader:
        found.append(
            f"{at}: generation {generation} written by two leader terms: {term[0]} (created at "
            f"revision {term[1]}) and {state.leader[0]} (revision {state.leader[1]})"
        )
    if generation < state.newest_generation:
        found.append(
            f"{at}: generation {generation} written after generation {state.newest_generation}"
        )
    state.newest_generation = max(state.newest_generation, generation)
    return found


def _resume_written(state: _Replay, ev: HistoryEvent, at: str) -> list[str]:
    assert ev.value is not None
    found = []
    if state.leader is None:
        found.append(f"{at}: a resume instruction written while no leader term held the key")
    data = _json(ev.value)
    value = data.get("value") if isinstance(data, dict) else None
    step = value.get("step") if isinstance(value, dict) else None
    if not isinstance(step, int):
        return [*found, f"{at}: a resume instruction without a step"]
    if state.safe_step is not None and step < state.safe_step:
        found.append(
            f"{at}: resumes at step {step}, below the published safe step {state.safe_step}"
        )
    return found
