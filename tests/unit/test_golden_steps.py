"""The agent's pure steps decide today as they decided when the golden traces were recorded
(tests/golden: every distinct call of every step on the failure walks loss, join, drain,
sick node and leader loss, recorded from real agents, and a loss with real workers that
train and snapshot). A part that moves keeps these
decisions: a replayed case whose state after the call or whose actions differ fails here.

A case whose arguments held a value with no plain form (a future, the leadership handle, the
probes' lock) cannot be replayed: its step is listed in `NOT_PLAIN_YET`, the parts whose
states still hold such handles. Their cases replay once the part's state is plain data (the
trace then gains a converter from the recorded shape)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.golden.steps import STEPS
from tests.golden.trace import Classes, expected, has_opaque, read_cases, replay, untouched

GOLDEN = Path(__file__).parent.parent / "data" / "golden"
WALKS = ("loss", "join", "drain", "sick", "leader", "trained")
# Steps whose recorded states hold handles (futures, the leadership) that have not moved
# out of them yet.
NOT_PLAIN_YET = frozenset(
    {
        "durability_committed",
        "follower_step",
        "follower_arrived",
        "follower_assigned",
        "follower_fetch_started",
    }
)
# Fields of a recorded state that moved out of it into a part's shell since the recording
# (the step neither read nor wrote them: `untouched` checks the second).
MOVED_OUT = {
    "ControlState": frozenset({"errors_seen"}),  # the kernel's ErrorPolicy keeps them
    # The durability shell holds the replication round's future and the persister.
    "DurabilityState": frozenset({"replication", "persister"}),
    # The liveness shell holds the probes out and what counts them.
    "LivenessState": frozenset({"probing", "wakes"}),
    # The follower shell holds the fetch's future and byte count.
    "GenerationProgress": frozenset({"fetch", "fetch_progress"}),
    # The leader shell holds the term, the rendezvous store and the memos of its view.
    "LeaderState": frozenset(
        {
            "leadership",
            "tcpstore",
            "tcpstore_socket",
            "store_address",
            "restarted_memo",
            "incarnations_memo",
            "lists_memo",
        }
    ),
}
# Fields of a recorded state that became another field since: the leader's step read its
# pull's future only for whether there was one, which is what `pull_asked` says (the future
# is its shell's).
CONVERTED = {"LeaderState": {"pull": ("pull_asked", lambda recorded: recorded is not None)}}
# Arguments a step no longer takes, by step and position: `leader_pull_started` was given the
# pull's future (now its shell's; it only marks the pull asked).
DROPPED_ARGS = {"leader_pull_started": 2}


def _today_args(name: str, case: dict[str, Any]) -> dict[str, Any]:
    """A case with the arguments its step no longer takes left out (before and after)."""
    drop = DROPPED_ARGS.get(name)
    if drop is None:
        return case
    out = dict(case)
    for when in ("before", "after"):  # encoded {"__dict": [["args", [...]], ["kwargs", ...]]}
        pairs = []
        for key, value in case[when]["__dict"]:
            if key == "args":
                value = value[:drop] + value[drop + 1 :]
            pairs.append([key, value])
        out[when] = {"__dict": pairs}
    return out


# Moved-out fields a recorded step read: its replacement takes the value as an argument
# (`durability_committed`'s `replicating`, False by default: what a recorded None means), so
# a case whose field holds a handle cannot be replayed.
READ_MOVED = {"durability_committed": frozenset({"replication"})}
# The field that tells one state object from another: a step that enters a generation makes
# a new `GenerationProgress` (its moved-out fields start empty).
IDENTITY = {"GenerationProgress": "record"}
# Every walk goes through these steps: a walk that recorded none of them recorded nothing.
EVERY_WALK = ("control_step", "view_step", "supervisor_step", "follower_step", "leader_step")


@pytest.fixture(scope="module")
def classes() -> Classes:
    return Classes(MOVED_OUT, CONVERTED)


@pytest.mark.parametrize("walk", WALKS)
def test_every_recorded_decision_is_made_again(walk: str, classes: Classes) -> None:
    cases = read_cases(GOLDEN / f"{walk}.json.gz")
    assert set(EVERY_WALK) <= set(cases), f"{walk}: steps missing from the trace"
    assert set(cases) <= set(STEPS), f"{walk}: steps no longer known: {set(cases) - set(STEPS)}"
    replayed = 0
    opaque_steps = set()
    for name, step_cases in sorted(cases.items()):
        for i, recorded in enumerate(step_cases):
            case = _today_args(name, recorded)
            if has_opaque(case["before"], classes, READ_MOVED.get(name, frozenset())):
                opaque_steps.add(name)
                continue
            moved = untouched(case, classes, IDENTITY)
            assert not moved, f"{walk}: {name} case {i} wrote moved fields: {moved}"
            after, result = replay(case, STEPS[name], classes)
            want_after, want_result = expected(case, classes)
            assert result == want_result, f"{walk}: {name} case {i}: other actions"
            assert after == want_after, f"{walk}: {name} case {i}: other state after"
            replayed += 1
    assert opaque_steps <= NOT_PLAIN_YET, f"{walk}: not replayable: {opaque_steps - NOT_PLAIN_YET}"
    assert replayed >= 100, f"{walk}: only {replayed} cases replayed"


def test_a_changed_decision_is_caught(classes: Classes) -> None:
    """The replay fails when a step decides otherwise: the same cases against a step that
    drops its last action, or writes one field more."""
    cases = read_cases(GOLDEN / "drain.json.gz")["control_step"]
    acting = [c for c in cases if c["result"]]
    assert acting, "the drain walk recorded no control decision"

    def fewer(*args: object) -> object:
        return STEPS["control_step"](*args)[:-1]

    def more(state: object, obs: object) -> object:
        actions = STEPS["control_step"](state, obs)
        state.draining = not state.draining  # type: ignore[attr-defined]
        return actions

    for wrong in (fewer, more):
        assert any(replay(c, wrong, classes) != expected(c, classes) for c in acting)


def test_the_trace_round_trips_what_states_hold(classes: Classes) -> None:
    """Encoding a decoded case gives the recorded text back: nothing is lost in between."""
    from tests.golden.trace import decode, encode, today

    for walk in WALKS:
        for step_cases in read_cases(GOLDEN / f"{walk}.json.gz").values():
            for case in step_cases[:20]:
                if has_opaque(case["before"]) is None:
                    decoded = decode(case["before"], classes)
                    assert encode(decoded) == today(case["before"], classes)
