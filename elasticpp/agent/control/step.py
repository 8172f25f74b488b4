"""The control part's decisions: the end of the job and of a drain (pure: no I/O, no clock;
`control_step` writes only the state it is given)."""

from __future__ import annotations

from dataclasses import dataclass

from elasticpp.agent.actions import (
    Action,
    Event,
    JobEndedGauge,
    PublishMemberInfo,
    ReleaseSpares,
    StepDown,
)


@dataclass
class ControlState:
    """The control part's state, plain data: written by `control_step` and the control
    part's shell on the loop (gRPC threads only queue drain requests), but `loop_serving`,
    the loop watchdog's own."""

    draining: bool = False
    drain_announced: bool = False  # the member key says draining; leadership resigned
    drain_deadline_s: float | None = None  # monotonic
    drain_requested_gen: int = 0  # the generation the drain was asked in
    job_done: bool = False  # the job trained every step (this node's, or a done barrier)
    exit_code: int | None = None  # drained, or finished with on_job_end "exit"
    loop_serving: bool = True  # what the watchdog last said of the loop (`check_loop`)
    # The values the gauges were last set to (None: set them all at the next update); a
    # gauge is set only when its value changed.
    gauges: tuple[object, ...] | None = None


@dataclass(frozen=True)
class ControlObservation:
    """What the control part's step sees: other parts' published state, read by the
    loop at one moment, and this tick's drain request. Times are monotonic seconds."""

    now_s: float
    node_id: str
    generation: int  # the generation this node follows, 0 before any
    plan_nodes: frozenset[str] | None  # the nodes of its plan; None before any
    started_everywhere: bool  # the leader's timeline of this generation is written
    finished_here: bool  # this node's ranks trained every step (the follower's phase)
    done_reported: bool  # a node reported the job's last step trained
    job_ended: bool  # the job ended without finishing (elasticpp.agent.health)
    workers_alive: bool
    has_spares: bool
    drain_timeout_s: float | None  # a drain asked for now (over gRPC), with its timeout
    exit_on_end: bool  # on_job_end "exit": leave once finished; else idle until removed
    # The exit status of a drain that leaves a job that has not finished (0 but under a
    # Kubernetes Job, where a pod that exits 0 counts its index complete).
    unfinished_exit_code: int = 0


def control_step(state: ControlState, obs: ControlObservation) -> list[Action]:
    """The end of the job and of a drain, decided: writes only `state`, does no I/O.
    A finished job exits 0 (or idles, its spares released) once its workers are gone; a
    drain announces itself, hands the leadership on, and exits once a later plan without
    this node has started everywhere, the job is over, or the drain's time is up: with 0
    once the job finished, else with `unfinished_exit_code`."""
    actions: list[Action] = []
    if (obs.done_reported or obs.finished_here) and not state.job_done:
        state.job_done = True
        actions.append(JobEndedGauge("finished"))  # the alerts stay quiet from here on
    if state.job_done and not obs.workers_alive:
        if obs.exit_on_end:
            state.exit_code = 0
        elif obs.has_spares:
            # Idle until removed: the warm pool is of no use to a finished job.
            actions += [
                ReleaseSpares(),
                Event("decision", "job finished: this agent idles until it is removed"),
            ]
    if obs.drain_timeout_s is not None and not state.draining:
        state.draining = True
        state.drain_deadline_s = obs.now_s + max(obs.drain_timeout_s, 1.0)
        state.drain_requested_gen = obs.generation
    if not state.draining:
        return actions
    if not state.drain_announced:
        state.drain_announced = True
        actions += [
            PublishMemberInfo(),
            StepDown("draining"),
            Event("decision", "draining: announced; waiting for the hand-off"),
        ]
    handed_off = (
        obs.plan_nodes is not None
        and obs.node_id not in obs.plan_nodes
        and obs.generation > state.drain_requested_gen
        and obs.started_everywhere
    )
    no_job = obs.plan_nodes is None or state.job_done or obs.job_ended
    expired = state.drain_deadline_s is not None and obs.now_s > state.drain_deadline_s
    if state.exit_code is None and (handed_off or no_job or expired):
        actions.append(Event("decision", "drained" if handed_off or no_job else "drain timed out"))
        state.exit_code = 0 if state.job_done else obs.unfinished_exit_code
    return actions
