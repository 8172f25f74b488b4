"""The supervisor's use of the node's worker template (elasticpp.train.forkserver): spares
wait for a template that is still importing, as they would for their own imports, and it is
held to their deadline (`ready_timeout_s`): past it, it is given up, counts as a never-ready
spare (the follower reports the node for it) and spares are exec'd. On a manual clock, with
a template that answers what the test says; the real template is test_worker_template.py's,
and the whole path end to end test_agent_sick.py's frozen-spares test."""

from __future__ import annotations

from pathlib import Path

from elasticpp.agent.clock import ManualClock
from elasticpp.agent.node import Agent, AgentConfig
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
        text = "\n".join(str(e) for e in agent._events.items())
        assert "worker template 4242 not ready" in text, text
    finally:
        agent.pool.kill_all()
        agent._probe_pool.shutdown()
