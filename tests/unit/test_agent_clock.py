"""The agent's parts read time from an injected clock: each deadline is driven here by moving
a manual clock, with no sleeps, through the parts' own steps (a constructed agent, fake worker
handles and a fake of the cluster calls it makes). And no part reads the real clock."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import elasticpp.agent
from elasticpp.agent.kernel.clock import ManualClock
from elasticpp.agent.kernel.decide import MOVING_DEADLINE_FLOOR_S, Phase, WorkerState
from elasticpp.agent.kernel.pool import Worker
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.records import GenerationRecord
from tests.agents import SPEC3 as SPEC
from tests.agents import RegisteredCluster as _Cluster
from tests.agents import SlowSpare as _SlowSpare
from tests.agents import StuckProc as _StuckProc
from tests.agents import plan_over as _plan


def _agent(tmp_path: Path) -> tuple[Agent, _Cluster, ManualClock]:
    clock = ManualClock()
    cluster = _Cluster()
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path),
        SPEC,
        clock=clock,
        cluster=cluster,
    )
    agent.supervisor.spawn_warm = lambda: None  # type: ignore[method-assign]
    return agent, cluster, clock


def _new_generation(agent: Agent, generation: int, nodes: tuple[str, ...] = ("n0",)) -> None:
    """What the view's refresh publishes when the leader wrote `generation`."""
    agent.view.state.record = GenerationRecord(
        generation,
        _plan(generation, nodes).to_dict(),
        "n0",
        agent.clock.time(),
        extra={"nodes": {n: f"{n}:1" for n in nodes}},
    )


def _failures(cluster: _Cluster) -> list[dict[str, Any]]:
    return [value for barrier, _, value in cluster.arrived() if barrier.startswith("failed-")]


def test_old_workers_that_outlive_sigkill_fail_the_node_at_stop_timeout_s(tmp_path: Path) -> None:
    agent, cluster, clock = _agent(tmp_path)
    stuck = _StuckProc(100)
    agent.pool.add_worker(
        Worker(proc=stuck, rank=0, generation=1, plan=_plan(1), state=WorkerState.RUNNING)  # type: ignore[arg-type]
    )
    _new_generation(agent, 2)
    agent.follower.step()
    assert stuck.kills == [False]  # killed without waiting
    clock.advance(SPEC.stop_timeout_s - 0.5)
    agent.follower.step()
    assert agent.follower.state.gen is not None and agent.follower.state.gen.phase is Phase.STOPPING
    assert _failures(cluster) == []
    clock.advance(1.0)  # past stop_timeout_s on the agent's clock
    agent.follower.step()
    assert agent.follower.state.gen.phase is Phase.FAILED
    [report] = _failures(cluster)
    assert report["severe"] and report["culprit"] and "still alive" in report["reason"]
    assert report["at"] == clock.time()  # the report's time is the agent's clock too


def test_a_resume_instruction_that_never_comes_fails_the_generation_at_the_moving_deadline(
    tmp_path: Path,
) -> None:
    agent, cluster, clock = _agent(tmp_path)
    _new_generation(agent, 2)
    agent.follower.step()  # nothing old to stop: holdings reported
    assert agent.follower.state.gen is not None and agent.follower.state.gen.phase is Phase.MOVING
    deadline_s = max(MOVING_DEADLINE_FLOOR_S, SPEC.hang_timeout_s)
    clock.advance(deadline_s - 1.0)
    agent.follower.step()
    assert agent.follower.state.gen.phase is Phase.MOVING and _failures(cluster) == []
    clock.advance(2.0)
    agent.follower.step()
    assert agent.follower.state.gen.phase is Phase.FAILED
    [report] = _failures(cluster)
    assert f"waited {deadline_s:.0f} s" in report["reason"]


def test_a_leader_that_cannot_resume_holds_the_moving_deadline_while_it_says_so(
    tmp_path: Path,
) -> None:
    # The leader found no state (both copies of a step lost) and said so in etcd: failing
    # the generation at the moving deadline would get this node blamed and quarantined.
    agent, cluster, clock = _agent(tmp_path)
    _new_generation(agent, 2)
    agent.follower.step()
    assert agent.follower.state.gen is not None and agent.follower.state.gen.phase is Phase.MOVING
    why = "no committed state on any live node"
    agent.view.state.barriers = {"resume-2": {"wait": {"why": why, "at": clock.time()}}}
    deadline_s = max(MOVING_DEADLINE_FLOOR_S, SPEC.hang_timeout_s)
    for _ in range(5):
        clock.advance(deadline_s)
        agent.follower.step()
    assert agent.follower.state.gen.phase is Phase.MOVING and _failures(cluster) == []
    said = [e for e in agent.journal.log if "waiting for state" in e[2]]
    assert len(said) == 1 and why in said[0][2]  # said once, not every step
    assert agent.status().waiting == why  # `elasticpp ctl status` shows it
    # The wait is withdrawn (a new leader, say, whose resolve is still under way): the
    # deadline runs again from the last step that saw the wait.
    agent.view.state.barriers = {}
    clock.advance(deadline_s - 1.0)
    agent.follower.step()
    assert agent.follower.state.gen.phase is Phase.MOVING and agent.status().waiting == ""
    clock.advance(2.0)
    agent.follower.step()
    assert agent.follower.state.gen.phase is Phase.FAILED and len(_failures(cluster)) == 1


def test_a_spare_that_never_reports_ready_is_replaced_at_ready_timeout_s(tmp_path: Path) -> None:
    agent, _, clock = _agent(tmp_path)
    spare = _SlowSpare(200)
    agent.pool.add_spare(spare)  # type: ignore[arg-type]  # spawned now, on the agent's clock
    clock.advance(SPEC.ready_timeout_s - 0.5)
    agent.executor.run(agent.supervisor.step())
    assert not spare.killed and agent.pool.spares() == (spare,)
    clock.advance(1.0)
    agent.executor.run(agent.supervisor.step())
    assert spare.killed and agent.pool.spares() == ()
    assert agent.pool.replaced_since(clock.monotonic() - 1.0) == 1


def test_a_drain_that_is_never_handed_off_ends_at_its_deadline(tmp_path: Path) -> None:
    agent, cluster, clock = _agent(tmp_path)
    agent.membership.take_lease()
    _new_generation(agent, 2)
    agent.follower.step()  # this node is in the plan: no hand-off yet
    assert agent.control.request_drain(5.0)[0]
    agent.control_turn()
    assert agent.control.state.draining and cluster.registration.updates[-1]["draining"]
    clock.advance(4.5)
    agent.control_turn()
    assert agent.exit_requested() is None
    clock.advance(1.0)
    agent.control_turn()
    assert agent.exit_requested() == 0
    assert any("drain timed out" in e[2] for e in agent.journal.log)


def test_a_drain_announces_itself_when_etcd_does_not_take_the_member_info_now(
    tmp_path: Path,
) -> None:
    """The member info is the registration's to re-put; the drain's step-down and its
    event do not wait on the write (once an unanswered write cut them off for good: the
    drain was marked announced)."""
    agent, cluster, _ = _agent(tmp_path)
    # A registration whose write etcd does not take now (the keeper re-puts the info).
    cluster.registration.unreachable = True
    agent.membership.take_lease()
    _new_generation(agent, 2)
    agent.follower.step()
    assert agent.control.request_drain(5.0)[0]
    agent.control_turn()
    assert cluster.registration.updates[-1]["draining"]
    assert any("draining: announced" in e[2] for e in agent.journal.log)


# On purpose on the real clock: the loop watchdog (the executor's own liveness, see
# elasticpp.agent.kernel.clock), a fetch's byte progress, which its thread times, and the loop's
# pace against what is stamped on the real clock: the status snapshot (by the loop's turn)
# and the last step reported (by the worker pool's reader threads).
# Joining waits for etcd on the real clock, and the heartbeat it sets is the real loop's.
REAL_CLOCK_ALLOWED = {
    ("shell", "_fetch_status"),  # the follower's
    ("shell", "join"),  # the membership's
}


def test_no_part_reads_the_real_clock() -> None:
    found = []
    for path in sorted(Path(elasticpp.agent.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            if not cls.name.endswith("Part") and path.stem != "shell":  # a part's object
                continue
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                if (path.stem, fn.name) in REAL_CLOCK_ALLOWED:
                    continue
                for node in ast.walk(fn):
                    if (
                        isinstance(node, ast.Attribute)
                        and isinstance(node.value, ast.Name)
                        and node.value.id == "time"
                        and node.attr in ("monotonic", "time", "sleep")
                    ):
                        found.append(f"{path.stem}.{fn.name}: time.{node.attr}")
    assert found == []
