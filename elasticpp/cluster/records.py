"""Values the cluster layer stores in etcd and hands to its callers. Pure Python, no etcd.

Every JSON value carries `format_version`; a reader refuses a newer major version instead of
guessing, so an old agent never acts on a record it does not understand.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elasticpp.cluster.errors import ClusterDataError

FORMAT_VERSION = 1
# Anchor steps a commit record lists per origin (newest first): etcd values stay small.
ANCHORS_REPORTED = 16


def dumps(obj: dict[str, Any]) -> str:
    """Versioned, compact, key-sorted JSON (sorted so equal records are equal bytes)."""
    return json.dumps({"format_version": FORMAT_VERSION, **obj}, sort_keys=True)


def loads(text: str | bytes, what: str) -> dict[str, Any]:
    """Parse a stored JSON object; refuse non-objects and unknown format versions."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ClusterDataError(f"{what}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ClusterDataError(f"{what}: expected a JSON object")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise ClusterDataError(
            f"{what}: format_version {version!r} not supported (this build reads {FORMAT_VERSION})"
        )
    return data


class EventType(enum.Enum):
    PUT = "put"
    DELETE = "delete"
    # Events were lost (the start revision was compacted away): re-read what you watch.
    RESYNC = "resync"


@dataclass(frozen=True)
class WatchEvent:
    """One change of one key. `value` is None for DELETE and RESYNC."""

    type: EventType
    key: str
    value: str | None
    mod_revision: int


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: str
    mod_revision: int
    create_revision: int
    lease_id: int


@dataclass(frozen=True)
class Members:
    """Registered nodes at one etcd revision (start a watch at `revision + 1`)."""

    nodes: dict[str, dict[str, Any]]
    revision: int


@dataclass(frozen=True)
class GenerationRecord:
    """One plan generation, as the leader writes it by compare-and-swap.

    `plan` is the plan's JSON object (`Plan.to_dict()`); this layer does not interpret it
    (beyond the three numbers of its layout, for `GenerationSummary`).
    `resume_step` is the step training resumes at (after a loss), `switch_step` the step
    boundary at which a planned change (a join) takes effect; either may be None.
    """

    generation: int
    plan: dict[str, Any]
    leader: str
    created_at: float
    resume_step: int | None = None
    switch_step: int | None = None
    store_address: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return dumps(
            {
                "generation": self.generation,
                "plan": self.plan,
                "leader": self.leader,
                "created_at": self.created_at,
                "resume_step": self.resume_step,
                "switch_step": self.switch_step,
                "store_address": self.store_address,
                "extra": self.extra,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> GenerationRecord:
        data = loads(text, "generation record")
        try:
            generation = data["generation"]
            if not isinstance(generation, int) or generation < 1:
                raise ClusterDataError(
                    f"generation record: generation must be an integer >= 1, got {generation!r}"
                )
            return cls(
                generation=generation,
                plan=dict(data["plan"]),
                leader=str(data["leader"]),
                created_at=float(data["created_at"]),
                resume_step=data.get("resume_step"),
                switch_step=data.get("switch_step"),
                store_address=data.get("store_address"),
                extra=dict(data.get("extra") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ClusterDataError(f"generation record: bad field ({exc!r})") from None


@dataclass(frozen=True)
class GenerationSummary:
    """What `generations/<G>` keeps of generation G: who wrote it when, its layout, how many
    nodes, why, and the layout before. Not the plan or the per-node maps: the history is
    written in the same transaction as the record, and a second full copy would double the
    bytes of a transaction that must stay under etcd's request limit.

    `of` reads the record's plan only for its `pp`, `tp` and `dp` and its `extra` only for
    `nodes`, `reason` and `previous_layout`; a field the record lacks reads as empty.
    History written by earlier releases (full records) still reads, as their summary.
    """

    generation: int
    leader: str
    created_at: float
    layout: str
    nodes: int
    reason: str = ""
    previous_layout: str = ""

    @classmethod
    def of(cls, record: GenerationRecord) -> GenerationSummary:
        plan, extra = record.plan, record.extra
        dims = [plan.get(axis) for axis in ("pp", "tp", "dp")]
        layout = "pp={},tp={},dp={}".format(*dims) if all(_whole(d, 1) for d in dims) else ""
        nodes = extra.get("nodes")
        return cls(
            generation=record.generation,
            leader=record.leader,
            created_at=record.created_at,
            layout=layout,
            nodes=len(nodes) if isinstance(nodes, dict) else 0,
            reason=str(extra.get("reason") or ""),
            previous_layout=str(extra.get("previous_layout") or ""),
        )

    def to_json(self) -> str:
        return dumps(
            {
                "generation": self.generation,
                "leader": self.leader,
                "created_at": self.created_at,
                "layout": self.layout,
                "nodes": self.nodes,
                "reason": self.reason,
                "previous_layout": self.previous_layout,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> GenerationSummary:
        data = loads(text, "generation history")
        if "plan" in data:  # a full copy, as releases before the summary wrote it
            return cls.of(GenerationRecord.from_json(text))
        try:
            generation, nodes = data["generation"], data["nodes"]
            if not _whole(generation, 1) or not _whole(nodes, 0):
                raise ClusterDataError(
                    f"generation history: generation {generation!r} and nodes {nodes!r} must "
                    "be whole numbers (generation >= 1)"
                )
            return cls(
                generation=generation,
                leader=str(data["leader"]),
                created_at=float(data["created_at"]),
                layout=str(data["layout"]),
                nodes=nodes,
                reason=str(data.get("reason") or ""),
                previous_layout=str(data.get("previous_layout") or ""),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ClusterDataError(f"generation history: bad field ({exc!r})") from None


def _whole(value: Any, least: int) -> bool:
    """A whole number >= `least` (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _steps(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value
    ):
        raise ClusterDataError(f"{what}: expected a list of steps, got {value!r}")
    return tuple(sorted(set(value), reverse=True))


@dataclass(frozen=True)
class CommitRecord:
    """What one node reports after a commit or a replication round in one generation: its
    newest committed step (-1: none) and the anchor steps of that generation it holds, its own
    and the replicas per origin, newest first (at most `ANCHORS_REPORTED` each)."""

    node_id: str
    generation: int
    step: int
    anchors: tuple[int, ...] = ()
    replicas: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "generation": self.generation,
            "step": self.step,
            "anchors": list(self.anchors[:ANCHORS_REPORTED]),
            "replicas": {o: list(s[:ANCHORS_REPORTED]) for o, s in sorted(self.replicas.items())},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CommitRecord:
        """Parse a record (as `loads` returned it); `ClusterDataError` naming the bad field.
        A record of an older release (no anchors) reads as holding none."""
        try:
            node_id, generation, step = data["node_id"], data["generation"], data["step"]
        except KeyError as exc:
            raise ClusterDataError(f"commit record: missing field {exc}") from None
        if not isinstance(node_id, str):
            raise ClusterDataError(f"commit record: node_id must be a string, got {node_id!r}")
        for name, value in (("generation", generation), ("step", step)):
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise ClusterDataError(f"commit record: {name} must be an integer, got {value!r}")
        replicas = data.get("replicas", {})
        if not isinstance(replicas, dict):
            raise ClusterDataError(f"commit record: replicas must be an object, got {replicas!r}")
        return cls(
            node_id,
            generation,
            step,
            _steps(data.get("anchors", []), "commit record: anchors"),
            {str(o): _steps(s, f"commit record: replicas of {o}") for o, s in replicas.items()},
        )


@dataclass(frozen=True, order=True)
class SafeStep:
    """The newest step every node holds so that it survives any single node loss, as the
    leader published it. Ordered like commits: by generation, then step."""

    generation: int
    step: int

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SafeStep:
        values = []
        for name in ("generation", "step"):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ClusterDataError(f"safe step: {name} must be an integer >= 0, got {value!r}")
            values.append(value)
        return cls(*values)


@dataclass(frozen=True)
class JobEpoch:
    """The job's epoch: generation numbers restart at 1 whenever the job's etcd state starts
    afresh (an etcd wiped, the job's prefix deleted), so state kept outside etcd (the nodes'
    stores, checkpoints) orders its commits by (epoch, generation, step). Created once, by
    the first agent to join a job whose etcd state has none; every agent reads it at join.
    An epoch is larger than every epoch before it (see `docs/cluster.md`)."""

    epoch: int
    created_by: str
    created_at: float

    def __post_init__(self) -> None:
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 1:
            raise ClusterDataError(f"job epoch: epoch must be an integer >= 1, got {self.epoch!r}")

    def to_json(self) -> str:
        return dumps(
            {"epoch": self.epoch, "created_by": self.created_by, "created_at": self.created_at}
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> JobEpoch:
        data = loads(text, "job epoch")
        try:
            return cls(int(data["epoch"]), str(data["created_by"]), float(data["created_at"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ClusterDataError(f"job epoch: bad field ({exc!r})") from None


def propose_epoch(newest_known: int, now_ns: int | None = None) -> int:
    """The epoch an agent proposes for a job whose etcd state has none: the wall clock in
    nanoseconds, or one more than the newest epoch the agent knows of (its store's), whichever
    is larger. Pure given `now_ns`."""
    now = time.time_ns() if now_ns is None else now_ns
    return max(now, newest_known + 1, 1)
