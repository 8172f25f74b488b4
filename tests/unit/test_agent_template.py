"""The supervisor's use of the node's worker template (elasticpp.train.forkserver): spares
wait for a template that is still importing, as they would for their own imports, and it is
held to their deadline (`ready_timeout_s`): past it, it is given up, counts as a never-ready
spare (the follower reports the node for it) and spares are exec'd. On a manual clock, with
a template that answers what the test says; the real template is test_worker_template.py's,
and the whole path end to end test_agent_sick.py's frozen-spares test."""

from __future__ import annotations

from pathlib import Path

from elasticpp.agent.clock import ManualClock
from elasticpp.agent.decide import WorkerState
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.agent.pool import _Worker
from tests.unit.test_agent_deadlines import _plan
from tests.unit.test_agent_done import SPEC


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


def _agent(tmp_path: Path, clock: ManualClock) -> tuple[Agent, _Template]:
    # `python` that exits at once: an exec'd spare here is a process that is gone.
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path),
        SPEC,
        clock=clock,
        python="/bin/true",
    )
    template = _Template()
    agent._ss.template = template  # type: ignore[assignment]
    agent._ss.template_since_s = clock.monotonic()
    return agent, template


def test_spares_wait_for_a_template_that_is_importing(tmp_path: Path) -> None:
    clock = ManualClock()
    agent, template = _agent(tmp_path, clock)
    try:
        clock.advance(SPEC.ready_timeout_s - 1)
        agent._spawn_warm()
        assert agent.pool.spares() == ()
        assert template.given_up is None
        assert agent.pool.replaced_since(0) == 0
    finally:
        agent.pool.kill_all()
        agent._probe_pool.shutdown()


def test_a_template_not_ready_in_time_counts_as_a_never_ready_spare(tmp_path: Path) -> None:
    clock = ManualClock()
    agent, template = _agent(tmp_path, clock)
    try:
        clock.advance(SPEC.ready_timeout_s + 1)
        agent._spawn_warm()
        assert template.given_up == f"not ready within {SPEC.ready_timeout_s:.0f} s"
        # The follower's way to report the node sick: a never-ready spare was replaced.
        assert agent.pool.replaced_since(clock.monotonic()) == 1
        # ... and the node's spares are exec'd from now on.
        spares = agent.pool.spares()
        assert len(spares) == 2 and not any(p.forked for p in spares)  # type: ignore[attr-defined]
        text = "\n".join(str(e) for e in agent.journal.log.items())
        assert "worker template 4242 not ready" in text, text
    finally:
        agent.pool.kill_all()
        agent._probe_pool.shutdown()


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
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    agent, _ = _agent(tmp_path, clock)
    hung = _HungTemplate(frozenset({11, 12}))
    agent._ss.template = hung  # type: ignore[assignment]
    running, spare, exec_d = _Forked(11), _Forked(12), _Forked(13)
    agent.pool.add_worker(
        _Worker(proc=running, rank=1, generation=3, plan=_plan(3), state=WorkerState.RUNNING)  # type: ignore[arg-type]
    )
    agent.pool.add_spare(spare)  # type: ignore[arg-type]
    agent.pool.add_spare(exec_d)  # type: ignore[arg-type]
    try:
        agent._replace_template(4242, "no answer to a ping in 11 s (stopped or hung)")
        assert hung.given_up == "no answer to a ping in 11 s (stopped or hung)"
        # What it forked dies with it (killed first, without waiting); the rest stays.
        assert running.kills == [False] and spare.kills == [False] and exec_d.kills == []
        assert agent.pool.spares() == (exec_d,)
        report = agent._fs.pending_failures[3]
        assert not report["culprit"] and not report["severe"]
        assert "killed with their worker template 4242" in report["reason"]
        # Another template serves the node's next spares (here one that exits at once).
        assert agent._ss.template is not None and agent._ss.template is not hung
    finally:
        if agent._ss.template is not None and agent._ss.template is not hung:
            agent._ss.template.close()
        agent._probe_pool.shutdown()
