"""When the soak harness takes the job for steady, and so injects its next fault: on what
the harness observed (pure), and on a real process for the liveness it reads from /proc."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
from typing import Any

from bench.soak import JobView, NodeView, is_set_aside, is_steady, running
from elasticpp.waiting import wait_until


def _node(i: int, **changes: Any) -> NodeView:
    node = NodeView(
        node_id=f"node-{i}",
        generation=1,
        phase="running",
        ranks_planned=frozenset({i}),
        ranks_running=frozenset({i}),
        warm_ready=1,
        agent_alive=True,
    )
    return dataclasses.replace(node, **changes)


def _view(*nodes: NodeView, **changes: Any) -> JobView:
    view = JobView(
        generation=1,
        failures=frozenset(),
        nodes=nodes or tuple(_node(i) for i in range(3)),
        newest_step=26,
    )
    return dataclasses.replace(view, **changes)


def test_a_job_whose_every_node_runs_its_ranks_of_the_etcd_generation_is_steady() -> None:
    assert is_steady(_view(), since_step=24, slots=1)
    assert not is_steady(_view(), since_step=25, slots=1)  # not two steps past it yet


def test_a_job_with_a_killed_worker_is_not_steady_though_its_metrics_still_grow() -> None:
    # What the harness saw when the next fault found no worker for 30 s: a worker was just
    # killed, its agent still listed it, and the agents, whose loops had waited on an etcd
    # restart, were still writing steps of the old generation. By the metrics alone (every
    # node in the newest generation, two steps past) this looked steady.
    just_killed = _node(2, ranks_running=frozenset())  # listed running, the process gone
    assert not is_steady(_view(_node(0), _node(1), just_killed), since_step=24, slots=1)
    # Its agent has reported the failure; the leader has not re-planned yet.
    assert not is_steady(_view(failures=frozenset({"node-2"})), since_step=24, slots=1)


def test_a_job_between_generations_is_not_steady() -> None:
    # Generation 2 is written; the steps written so far are generation 1's.
    behind = tuple(_node(i, generation=1) for i in range(3))
    assert not is_steady(_view(*behind, generation=2, newest_step=-1), since_step=24, slots=1)
    moving = tuple(_node(i, generation=2, phase="moving") for i in range(3))
    assert not is_steady(_view(*moving, generation=2, newest_step=30), since_step=24, slots=1)


def test_a_job_with_a_node_unplanned_stopped_or_short_of_spares_is_not_steady() -> None:
    for odd in (
        _node(2, ranks_planned=frozenset(), ranks_running=frozenset()),  # a rejoined spare
        _node(2, agent_alive=False),  # an agent stopped or killed
        _node(2, generation=-1, phase=""),  # an agent that does not answer
        _node(2, warm_ready=0),  # its spare still importing torch
    ):
        assert not is_steady(_view(_node(0), _node(1), odd), since_step=24, slots=1), odd
    assert not is_steady(_view(generation=0), since_step=24, slots=1)  # etcd unreadable


def test_a_quarantined_node_without_ranks_is_steady_while_it_is_sick() -> None:
    # node-2's spares never become ready: its agent is alive in an old generation, its warm
    # pool empty, and it has no ranks in etcd's generation. The others train.
    sick = _node(
        2,
        generation=1,
        phase="idle",
        ranks_planned=frozenset(),
        ranks_running=frozenset(),
        warm_ready=0,
    )
    others = (_node(0, generation=2), _node(1, generation=2))
    view = _view(*others, sick, generation=2, quarantined=frozenset({"node-2"}))
    assert is_steady(view, since_step=24, slots=1)
    # A wedged agent that does not answer, quarantined: steady as well.
    silent = _node(2, generation=-1, phase="", ranks_planned=frozenset(), ranks_running=frozenset())
    assert is_steady(_view(*others, silent, generation=2, quarantined=frozenset({"node-2"})), 24, 1)
    # Not quarantined, the same node is not steady: it is a node to wait for.
    assert not is_steady(dataclasses.replace(view, quarantined=frozenset()), 24, 1)
    # Its old workers outlive SIGKILL: it reports every generation failed, though it has no
    # ranks in it. The others train undisturbed; a failure of theirs is not steady.
    stuck = dataclasses.replace(view, failures=frozenset({"node-2"}))
    assert is_steady(stuck, 24, 1)
    assert not is_steady(dataclasses.replace(stuck, failures=frozenset({"node-0"})), 24, 1)


def test_a_quarantined_node_still_planned_is_not_steady() -> None:
    # The quarantine is written; the leader has not replaced the generation it is in yet.
    view = _view(quarantined=frozenset({"node-2"}))
    assert not is_steady(view, since_step=24, slots=1)


def test_a_sick_node_is_set_aside_once_the_others_train_without_it() -> None:
    others = (_node(0, generation=3), _node(1, generation=3))
    lost = _node(
        2, generation=2, phase="starting", ranks_planned=frozenset(), ranks_running=frozenset()
    )
    view = _view(*others, lost, generation=3, newest_step=40)
    assert is_set_aside(view, "node-2", since_step=30, slots=1, steps=10)
    assert not is_set_aside(view, "node-2", since_step=31, slots=1, steps=10)  # not 10 yet
    # Still planned (the join generation waits for its spares): not set aside.
    planned = _node(2, generation=3, phase="moving", ranks_running=frozenset())
    assert not is_set_aside(_view(*others, planned, generation=3, newest_step=40), "node-2", 30, 1)
    # The others are not steady (a failure reported in the new generation): not yet.
    failing = _view(*others, lost, generation=3, newest_step=40, failures=frozenset({"node-0"}))
    assert not is_set_aside(failing, "node-2", 30, 1)
    # The other nodes gone too: nothing trains, nothing is set aside.
    assert not is_set_aside(_view(lost, generation=3, newest_step=40), "node-2", 30, 1)


def test_a_process_runs_until_it_is_stopped_killed_or_reaped() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert running(proc.pid)
        proc.send_signal(signal.SIGSTOP)
        assert wait_until(lambda: not running(proc.pid), 10)
        proc.send_signal(signal.SIGCONT)
        assert wait_until(lambda: running(proc.pid), 10)
        proc.kill()
        assert wait_until(lambda: not running(proc.pid), 10)  # a zombie until reaped
    finally:
        proc.kill()
        proc.wait()
    assert not running(proc.pid)
