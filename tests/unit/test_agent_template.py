"""The supervisor's use of the node's worker template (elasticpp.train.worker.forkserver): spares
wait for a template that is still importing, as they would for their own imports, and it is
held to their deadline (`ready_timeout_s`): past it, it is given up, counts as a never-ready
spare (the follower reports the node for it) and spares are exec'd. The `Supervisor` is
driven through its ports, on a manual clock, with a template that answers what the test
says; the real template is test_worker_template.py's, and the whole path end to end
test_agent_sick.py's frozen-spares test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.actions import ReplaceTemplate, ReportFailure
from elasticpp.agent.kernel.clock import ManualClock
from elasticpp.agent.kernel.decide import WorkerState
from elasticpp.agent.kernel.executor import Executor
from elasticpp.agent.kernel.journal import ErrorPolicy, Journal
from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.agent.kernel.pool import Worker, WorkerPool
from elasticpp.agent.kernel.worklogs import WorkerLogs
from elasticpp.agent.supervisor.shell import Supervisor, SupervisorConfig, WorkerEvents
from tests.agents import plan_over as _plan

READY_TIMEOUT_S = 60.0


class _Template:
    """Importing until the test says otherwise; records being given up."""

    pid = 4242

    def __init__(self) -> None:
        self.ready = False
        self.given_up: str | None = None

    def loading(self) -> bool:
        return not self.ready and self.given_up is None

    def usable(self) -> bool:
        return self.ready and self.given_up is None

    def give_up(self, why: str) -> None:
        self.given_up = why

    def close(self) -> None:
        pass


@dataclass
class _Node:
    """A supervisor on its ports: the pool it fills, the failures it reports, the templates
    it started (the test's fakes, in order)."""

    supervisor: Supervisor
    pool: WorkerPool
    journal: Journal
    templates: list[Any]
    failed: list[tuple[int, str]] = field(default_factory=list)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Callable[..., _Node]]:
    made: list[_Node] = []

    def make(clock: ManualClock, *templates: Any) -> _Node:
        pool = WorkerPool(clock=clock.monotonic)
        journal = Journal(clock, lambda: 0)
        metrics = AgentMetrics.create("n0", "job")
        started: list[Any] = []
        fakes = list(templates)

        def template(*_: object) -> Any:
            started.append(fakes.pop(0))
            return started[-1]

        ignore = lambda *_: None  # noqa: E731
        supervisor = Supervisor(
            # `python` that exits at once: an exec'd spare here is a process that is gone.
            SupervisorConfig(
                "n0",
                2,
                "cpu",
                tmp_path / "logs",
                ready_timeout_s=READY_TIMEOUT_S,
                hang_timeout_s=30.0,
                first_step_timeout_s=30.0,
                python="/bin/true",
            ),
            clock=clock,
            pool=pool,
            journal=journal,
            metrics=metrics,
            errors=ErrorPolicy(metrics),
            logs=WorkerLogs(tmp_path / "logs"),
            events=WorkerEvents(ignore, ignore, ignore, ignore),
            report_failed=lambda g, why, _peer: n.failed.append((g, why)),
            spares_wanted=lambda: True,
            wake=lambda: None,
            template_factory=template,
        )
        n = _Node(supervisor, pool, journal, started)
        made.append(n)
        return n

    yield make
    for n in made:
        n.pool.kill_all()


def test_spares_wait_for_a_template_that_is_importing(node: Callable[..., _Node]) -> None:
    clock, template = ManualClock(), _Template()
    n = node(clock, template)
    n.supervisor.spawn_warm()  # starts the template
    clock.advance(READY_TIMEOUT_S - 1)
    n.supervisor.spawn_warm()
    assert n.templates == [template] and n.pool.spares() == ()
    assert template.given_up is None
    assert n.pool.replaced_since(0) == 0


def test_a_template_not_ready_in_time_counts_as_a_never_ready_spare(
    node: Callable[..., _Node],
) -> None:
    clock, template = ManualClock(), _Template()
    n = node(clock, template)
    n.supervisor.spawn_warm()
    clock.advance(READY_TIMEOUT_S + 1)
    n.supervisor.spawn_warm()
    assert template.given_up == f"not ready within {READY_TIMEOUT_S:.0f} s"
    # The follower's way to report the node sick: a never-ready spare was replaced.
    assert n.pool.replaced_since(clock.monotonic()) == 1
    # ... and the node's spares are exec'd from now on.
    spares = n.pool.spares()
    assert len(spares) == 2 and not any(p.forked for p in spares)  # type: ignore[attr-defined]
    text = "\n".join(str(e) for e in n.journal.log.items())
    assert "worker template 4242 not ready" in text, text


class _Forked:
    """A worker forked from the template: records its kills."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.kills: list[bool] = []

    def kill(self, *, wait: bool = True, timeout_s: float = 10.0) -> None:
        self.kills.append(wait)

    def alive(self) -> bool:
        return not self.kills


class _HungTemplate(_Template):
    """A template that served forks and stopped answering."""

    def __init__(self, forked: frozenset[int]) -> None:
        super().__init__()
        self.ready = True
        self._forked = forked

    def forked_pids(self) -> frozenset[int]:
        return self._forked

    def give_up(self, why: str, *, quiet: bool = False) -> None:
        self.given_up = why


def test_a_hung_template_is_replaced_and_the_ranks_it_took_fail_with_no_blame_on_the_node(
    node: Callable[..., _Node],
) -> None:
    hung, successor = _HungTemplate(frozenset({11, 12})), _Template()
    successor.pid = 4343
    n = node(ManualClock(), hung, successor)
    hung.ready = False
    n.supervisor.spawn_warm()  # starts it; it serves once it is ready
    hung.ready = True
    running, spare, exec_d = _Forked(11), _Forked(12), _Forked(13)
    n.pool.add_worker(
        Worker(proc=running, rank=1, generation=3, plan=_plan(3), state=WorkerState.RUNNING)  # type: ignore[arg-type]
    )
    n.pool.add_spare(spare)  # type: ignore[arg-type]
    n.pool.add_spare(exec_d)  # type: ignore[arg-type]
    reported: list[object] = []
    executor = Executor()
    n.supervisor.register(executor)
    executor.register(ReportFailure, reported.append)  # the follower's, in the agent
    executor.run([ReplaceTemplate(4242, "no answer to a ping in 11 s (stopped or hung)")])
    assert hung.given_up == "no answer to a ping in 11 s (stopped or hung)"
    # What it forked dies with it (killed first, without waiting); the rest stays.
    assert running.kills == [False] and spare.kills == [False] and exec_d.kills == []
    assert n.pool.spares() == (exec_d,)
    # Its ranks' generation fails, with this node as no culprit.
    assert len(reported) == 1 and isinstance(reported[0], ReportFailure), reported
    report = reported[0]
    assert report.generation == 3 and not report.culprit and not report.severe
    assert "killed with their worker template 4242" in report.reason
    # Another template serves the node's next spares.
    assert n.templates == [hung, successor] and n.supervisor.template_pid == 4343
    assert successor.given_up is None
    # A second report of the same template finds it replaced already.
    executor.run([ReplaceTemplate(4242, "late")])
    assert successor.given_up is None and len(reported) == 1
