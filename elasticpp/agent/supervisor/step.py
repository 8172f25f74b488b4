"""The supervisor's decisions, pure: the hang rule for running workers, the deadline of a
spare that is not ready, the worker template's pings and replacement, when the warm pool is
refilled, and how long the supervisor may rest. No I/O; `shell.Supervisor` observes for them
and applies the actions they return."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elasticpp.agent.actions import (
    Action,
    Event,
    KillWorker,
    PingTemplate,
    ReplaceSpare,
    ReplaceTemplate,
    ReportFailure,
    SpawnWarm,
)
from elasticpp.agent.kernel.decide import is_hung
from elasticpp.agent.kernel.limits import TEMPLATE_PING_EVERY_S, TEMPLATE_RESTART_MIN_S


@dataclass
class SupervisorState:
    """The supervisor's own state besides its worker pool (`pool.WorkerPool`), plain data:
    written by the `Supervisor` on the loop. The template's process is the shell's."""

    gpus: list[int]  # physical GPUs of the slots, healthy ones only
    gpu_checked_s: float = 0.0  # monotonic
    template_since_s: float = 0.0  # monotonic: when the template was started


@dataclass(frozen=True)
class TemplateObservation:
    """The node's worker template, as the supervisor's step sees it. Seconds, monotonic."""

    pid: int
    usable: bool  # ready, forks
    lost: bool  # it served forks, then died or was given up (`WorkerTemplate.lost`)
    why_not: str  # why it is not used, once it is not
    # On the template's own clock (elasticpp.train.worker.procs.WorkerTemplate times its pings):
    unanswered_s: float | None  # its ping waits for an answer this long (None: none waits)
    since_ping_s: float | None  # since its last ping was sent (None: never pinged)
    age_s: float  # since it was started
    answer_timeout_s: float  # an answer later than this: it is hung


@dataclass(frozen=True)
class SupervisorObservation:
    """What the supervisor's step sees. Times are monotonic seconds."""

    now_s: float
    # (pid, rank, generation, last progress, whether it completed a step of its generation)
    running: tuple[tuple[int, int, int, float, bool], ...]
    overdue_spares: tuple[tuple[int, float], ...]  # (pid, seconds waited) not ready in time
    spares: int
    slots: int
    may_refill: bool  # spares are wanted now (the agent's `spares_wanted`)
    hang_timeout_s: float
    ready_timeout_s: float
    first_step_timeout_s: float = 0.0
    template: TemplateObservation | None = None
    ready_spares: int = 0  # of `spares`, those that reported ready
    gpu_check_at_s: float | None = None  # the next GPU health check (None: no GPUs to check)


def hang_timeout_for(stepped: bool, hang_timeout_s: float, first_step_timeout_s: float) -> float:
    """The hang rule's timeout for a running worker: `hang_timeout_s`, or, until it completed
    its generation's first step (compiling with `compile: true`, cold caches, the first
    collectives), the longer `first_step_timeout_s`. 0 turns the rule off."""
    if hang_timeout_s <= 0:
        return 0.0
    return hang_timeout_s if stepped else max(hang_timeout_s, first_step_timeout_s)


def template_step(t: TemplateObservation) -> list[Action]:
    """The worker template's deadlines: a ping unanswered for `answer_timeout_s` replaces
    it (it is stopped or hung, and reaps nothing: the workers it forked and that exited stay
    zombies), as does a template that served and is gone, once TEMPLATE_RESTART_MIN_S after
    its start (one that dies at every start is not started again at every tick); a usable
    template is pinged every TEMPLATE_PING_EVERY_S."""
    if t.usable and t.unanswered_s is not None and t.unanswered_s > t.answer_timeout_s:
        why = f"no answer to a ping in {t.unanswered_s:.0f} s (stopped or hung)"
        return [
            Event(
                "worker",
                f"worker template {t.pid}: {why}: killing it with the workers it forked, "
                "and starting another",
            ),
            ReplaceTemplate(t.pid, why),
        ]
    if t.lost and t.age_s >= TEMPLATE_RESTART_MIN_S:
        return [
            Event("worker", f"worker template {t.pid} is gone ({t.why_not}): starting another"),
            ReplaceTemplate(t.pid, t.why_not),
        ]
    due = t.since_ping_s is None or t.since_ping_s >= TEMPLATE_PING_EVERY_S
    if t.usable and t.unanswered_s is None and due:
        return [PingTemplate(t.pid)]
    return []


def supervisor_step(obs: SupervisorObservation) -> list[Action]:
    """The supervisor's deadlines, decided; no I/O. A running worker that made no progress
    for `hang_timeout_s` is killed (without waiting) and its generation reported failed; a
    spare not ready `ready_timeout_s` after its start (stuck importing torch, initialising a
    GPU) is replaced, and a generation waiting for it fails in the follower, blaming this
    node; the warm pool is refilled one spare per step, when spares are wanted."""
    actions: list[Action] = []
    for pid, rank, generation, last_progress_s, stepped in obs.running:
        timeout_s = hang_timeout_for(stepped, obs.hang_timeout_s, obs.first_step_timeout_s)
        if is_hung(last_progress_s, obs.now_s, timeout_s):
            what = "no progress" if stepped else "no first step"
            actions += [
                Event(
                    "worker", f"worker rank {rank} made {what} for {timeout_s:.0f} s: killing it"
                ),
                KillWorker(pid),
                ReportFailure(generation, f"worker rank {rank} hung"),
            ]
    for pid, waited_s in obs.overdue_spares:
        actions += [
            Event(
                "worker",
                f"warm worker {pid} not ready {waited_s:.0f} s after its start "
                f"(ready_timeout_s is {obs.ready_timeout_s:.0f}): replacing it",
            ),
            ReplaceSpare(pid),
        ]
    if obs.template is not None:
        actions += template_step(obs.template)
    if obs.may_refill and obs.spares - len(obs.overdue_spares) < obs.slots:
        actions.append(SpawnWarm())
    return actions


# What a worker (where the user's model code runs) does not inherit of the agent's
# environment: where systemd keeps this service's credentials (its TLS key, the etcd
# password), and the agent's own configuration, every `ELASTICPP_*` variable (its flags'
# fallbacks name etcd, the token file, the key files), but those a worker reads itself. The
# agent takes every secret of its own from files, never from the environment; the user's
# own variables (a hub token their code needs, say) are theirs and pass. What a worker is
# told (its node id, its device, its descriptors) the agent sets for it.
_AGENT_ONLY = ("CREDENTIALS_DIRECTORY",)
AGENT_PREFIX = "ELASTICPP_"
WORKER_READS = ("ELASTICPP_PROFILE_DIR",)  # elasticpp.train.engine.profiler


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment, less what points at the agent's own secrets and its own
    configuration."""
    return {
        k: v
        for k, v in environ.items()
        if k not in _AGENT_ONLY and (not k.startswith(AGENT_PREFIX) or k in WORKER_READS)
    }


def supervisor_rest_s(obs: SupervisorObservation) -> float | None:
    """How long the supervisor's step may wait: until its next deadline (a running worker's
    hang deadline, the next GPU check, the template's next ping, the deadline of the ping
    sent, its replacement), or None while it polls (a spare not ready yet, or one to start)."""
    if obs.ready_spares < obs.spares:
        return None
    if obs.may_refill and obs.spares < obs.slots:
        return None
    rest_s = float("inf")
    for _, _, _, last_progress_s, stepped in obs.running:
        timeout_s = hang_timeout_for(stepped, obs.hang_timeout_s, obs.first_step_timeout_s)
        if timeout_s > 0:
            rest_s = min(rest_s, last_progress_s + timeout_s - obs.now_s)
    if obs.gpu_check_at_s is not None:
        rest_s = min(rest_s, obs.gpu_check_at_s - obs.now_s)
    t = obs.template
    if t is not None:
        if t.usable and t.unanswered_s is not None:
            rest_s = min(rest_s, t.answer_timeout_s - t.unanswered_s)
        elif t.usable and t.since_ping_s is not None:
            rest_s = min(rest_s, TEMPLATE_PING_EVERY_S - t.since_ping_s)
        elif t.usable:
            rest_s = 0.0
        elif t.lost:
            rest_s = min(rest_s, TEMPLATE_RESTART_MIN_S - t.age_s)
    return rest_s
