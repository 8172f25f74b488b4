"""Values the cluster layer stores in etcd and hands to its callers. Pure Python, no etcd.

Every JSON value carries `format_version`; a reader refuses a newer major version instead of
guessing, so an old agent never acts on a record it does not understand.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from elasticpp.cluster.errors import ClusterDataError

FORMAT_VERSION = 1


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

    `plan` is the plan's JSON object (`Plan.to_dict()`); this layer does not interpret it.
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
