"""The health part's decisions, pure: the job's end as every agent carries it out, and the
reading of failure reports and quarantine records for the leader's judgement
(elasticpp.agent.sick decides the quarantines). The exit codes of an ended job."""

from __future__ import annotations

from dataclasses import dataclass, field

from elasticpp.agent.actions import Action, Event, JobEndedGauge, StopWorkers
from elasticpp.agent.kernel.records import JSONValue
from elasticpp.agent.sick import Quarantined, Report
from elasticpp.cluster.records import JobEnd, QuarantineRecord


@dataclass
class HealthState:
    """Quarantines and the job's end as this agent knows them, plain data: written on the
    loop by the `Health` object and `job_end_step` (watches only raise its `changed`
    signal)."""

    quarantines: dict[str, QuarantineRecord] = field(default_factory=dict)  # from etcd
    cordoned: frozenset[str] = frozenset()  # nodes an operator cordoned (`job cordon`)
    job_end: JobEnd | None = None  # the job ended without finishing
    end_handled: bool = False
    halt_pending: tuple[str, int] | None = None  # (message, step) not yet on record
    readmitted_s: float = 0.0  # monotonic: a node was last re-admitted (planned again)
    exit_code: int | None = None  # the job ended and on_job_end is "exit"


EXIT_FINISHED = 0
EXIT_FAILED = 3  # the failure budget was spent
EXIT_HALTED = 4  # a step's loss or gradient norm was not finite
EXIT_STOPPED = 0  # an operator stopped it (`elasticpp job stop`): its step is committed
EXIT_CODES = {"failed": EXIT_FAILED, "halted": EXIT_HALTED, "stopped": EXIT_STOPPED}


def report_of(node: str, value: JSONValue) -> Report:
    """A failure report as etcd holds it (`failed-G`), read defensively."""
    v = value if isinstance(value, dict) else {}
    at = v.get("at")
    return Report(
        node=node,
        reason=str(v.get("reason", "")),
        at=float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else 0.0,
        culprit=v.get("culprit") is True,
        severe=v.get("severe") is True,
        followed_a_peer=v.get("peer") is True,
    )


def job_end_step(
    state: HealthState, end: JobEnd | None, *, any_alive: bool, exit_on_end: bool
) -> list[Action]:
    """A job that ended stays ended: its workers and warm pool are stopped (every step, so
    that nothing started late survives), the end is told once, and the agent exits with the
    end's status once its workers are gone, or idles (`AgentConfig.on_job_end`). Writes only
    `state`; no I/O."""
    if end is None:
        return []
    actions: list[Action] = []
    if not state.end_handled:
        state.end_handled = True
        actions += [
            JobEndedGauge(end.status),
            Event(
                "decision",
                f"job ended ({end.status}, by {end.by}): {end.reason}; "
                + (
                    f"this agent exits with code {EXIT_CODES[end.status]}"
                    if exit_on_end
                    else "this agent idles until it is removed"
                ),
            ),
        ]
    actions.append(StopWorkers())
    if exit_on_end and not any_alive:
        state.exit_code = EXIT_CODES[end.status]
    return actions


def as_quarantined(r: QuarantineRecord) -> Quarantined:
    return Quarantined(r.node_id, r.reason, r.since, r.until, r.count, r.incarnation)


def ended_phase(end: JobEnd | None) -> str | None:
    return None if end is None else f"ended ({end.status})"
