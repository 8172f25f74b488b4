"""What happened to a job, from its records in etcd (`elasticpp job events`): every
generation the leaders wrote and why, each transition's recovery (its resume step, the steps
recomputed, how long), quarantines, cordons, a stop request, the job's end and its epoch.

These outlive the agents that wrote them, unlike an agent's journal (`ctl events`, one agent
deep and gone with it). Each event has a time (wall-clock seconds, the writer's clock), a
kind, the node it is about if any, and a sentence; `identity` tells one event from another
across reads, so that `--follow` prints each once. A value that cannot be read is skipped by
the readers of `ClusterClient` (counted), never misread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from elasticpp.cluster.records import (
    CordonRecord,
    GenerationSummary,
    JobEnd,
    JobEpoch,
    QuarantineRecord,
    StopRequest,
)

KINDS = ("epoch", "generation", "recovery", "quarantine", "cordon", "stop", "ended")


@dataclass(frozen=True)
class JobEvent:
    at: float  # wall-clock seconds
    kind: str  # one of KINDS, or "lifted" / "uncordoned" (`gone`)
    message: str
    node: str | None = None
    generation: int | None = None
    key: str = ""  # with `kind`, what tells this event from another (`identity`)

    @property
    def identity(self) -> tuple[str, str]:
        return self.kind, self.key

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at, "kind": self.kind, "node": self.node,
                "generation": self.generation, "message": self.message}  # fmt: skip


class _Health(Protocol):
    def quarantined(self) -> dict[str, QuarantineRecord]: ...
    def job_end(self) -> JobEnd | None: ...


class _Requests(Protocol):
    def cordoned(self) -> dict[str, CordonRecord]: ...
    def stop_request(self) -> StopRequest | None: ...


class _Arrivals(Protocol):
    def barrier_state(self, barrier: str) -> tuple[dict[str, Any], int]: ...


class JobRecords(Protocol):
    """What the events are read from (a `ClusterClient`)."""

    @property
    def health(self) -> _Health: ...
    @property
    def requests(self) -> _Requests: ...
    @property
    def arrivals(self) -> _Arrivals: ...
    def epoch(self) -> JobEpoch | None: ...
    def generation_history(self) -> list[GenerationSummary]: ...


def job_events(client: JobRecords) -> list[JobEvent]:
    """Every event the job's records hold now, oldest first."""
    events: list[JobEvent] = []
    epoch = client.epoch()
    if epoch is not None:
        events.append(
            JobEvent(epoch.created_at, "epoch", f"epoch {epoch.epoch} created by node "
                     f"{epoch.created_by}", node=epoch.created_by, key=str(epoch.epoch))
        )  # fmt: skip
    for g in client.generation_history():
        before = f", from {g.previous_layout}" if g.previous_layout else ""
        events.append(
            JobEvent(
                g.created_at,
                "generation",
                f"generation {g.generation}: {g.layout or 'no layout'} on {g.nodes} node(s)"
                f"{before} ({g.reason or 'no reason given'}), written by leader {g.leader}",
                node=g.leader,
                generation=g.generation,
                key=str(g.generation),
            )
        )
    timelines, _ = client.arrivals.barrier_state("timelines")
    for t in timelines.values():
        event = _recovery(t)
        if event is not None:
            events.append(event)
    health = client.health
    for node, q in health.quarantined().items():
        events.append(
            JobEvent(q.since, "quarantine", f"node {node} quarantined for "
                     f"{q.until - q.since:.0f} s (the {q.count}. time): {q.reason}",
                     node=node, key=f"{node}@{q.since}")
        )  # fmt: skip
    for node, c in client.requests.cordoned().items():
        events.append(
            JobEvent(c.at, "cordon", f"node {node} cordoned by {c.by}: {c.reason}", node=node,
                     key=f"{node}@{c.at}")
        )  # fmt: skip
    stop = client.requests.stop_request()
    if stop is not None:
        events.append(
            JobEvent(stop.at, "stop", f"stop asked by {stop.by}: {stop.reason}", key=str(stop.at))
        )
    end = health.job_end()
    if end is not None:
        at_step = f" at step {end.step}" if end.step >= 0 else ""
        events.append(
            JobEvent(end.at, "ended", f"job {end.status}{at_step}: {end.reason} (by {end.by})",
                     node=end.by, key=str(end.at))
        )  # fmt: skip
    return sorted(events, key=lambda e: (e.at, KINDS.index(e.kind), e.key))


def _recovery(timeline: Mapping[str, Any]) -> JobEvent | None:
    """A transition's timeline as an event at its end; None for one without its numbers."""
    try:
        generation = int(timeline["generation"])
        detected = float(timeline["detected_at"])
        resumed = float(timeline["resumed_s"])
        step, recomputed = int(timeline["resume_step"]), int(timeline["steps_recomputed"])
        phases = ", ".join(
            f"{name} {float(timeline[f'{name}_s']):.2f} s"
            for name in ("planned", "stopped", "moved")
        )
    except (KeyError, TypeError, ValueError):
        return None
    return JobEvent(
        detected + resumed,
        "recovery",
        f"generation {generation} resumed at step {step} {resumed:.2f} s after the "
        f"detection ({phases}), {recomputed} step(s) recomputed: "
        f"{timeline.get('reason') or 'no reason given'}",
        generation=generation,
        key=str(generation),
    )


def gone(
    before: Mapping[tuple[str, str], JobEvent], now: list[JobEvent], at: float
) -> list[JobEvent]:
    """What `--follow` saw end between two reads: a quarantine lifted, a cordon removed."""
    seen = {e.identity for e in now}
    ended = {"quarantine": ("lifted", "no longer quarantined"), "cordon": ("uncordoned",
             "uncordoned")}  # fmt: skip
    out = []
    for identity, e in before.items():
        if identity not in seen and e.kind in ended:
            kind, what = ended[e.kind]
            out.append(JobEvent(at, kind, f"node {e.node} {what}", node=e.node, key=e.key))
    return sorted(out, key=lambda e: e.key)
