"""Values the cluster layer stores in etcd and hands to its callers. Pure Python, no etcd.

Every JSON value carries `format_version`; a reader refuses a newer major version instead of
guessing, so an old agent never acts on a record it does not understand.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

from elasticpp.cluster.errors import ClusterDataError
from elasticpp.interned import Interned

FORMAT_VERSION = 1
_TOKEN_RE = re.compile(r"[0-9a-f]{32}")
# The largest value a reader parses: etcd's default request limit (1.5 MiB) is the largest a
# writer could store with it; the job's largest record is ~40 KB at 2,048 nodes.
MAX_VALUE_BYTES = 1536 * 1024
SHARED_RECORDS = 8  # generation records `GenerationRecord.shared` keeps
_SHARED: Interned[str | bytes, GenerationRecord] = Interned(SHARED_RECORDS)
# Anchor steps a commit record lists per origin (newest first): etcd values stay small.
ANCHORS_REPORTED = 16


def dumps(obj: dict[str, Any], *, tight: bool = False) -> str:
    """Versioned, compact, key-sorted JSON (sorted so equal records are equal bytes);
    `tight` leaves out the blanks after separators (for the values that grow with the
    cluster)."""
    separators = (",", ":") if tight else None
    return json.dumps(
        {"format_version": FORMAT_VERSION, **obj}, sort_keys=True, separators=separators
    )


def loads(text: str | bytes, what: str) -> dict[str, Any]:
    """Parse a stored JSON object; refuse values over MAX_VALUE_BYTES, nesting deeper than
    the parser's stack (a value made to exhaust it), non-objects and unknown format
    versions, each as `ClusterDataError` (a value skipped and counted, never a lost read)."""
    if len(text) > MAX_VALUE_BYTES:
        raise ClusterDataError(f"{what}: {len(text)} bytes, over {MAX_VALUE_BYTES}")
    try:
        data = json.loads(text)
    except RecursionError:
        raise ClusterDataError(f"{what}: nested too deeply") from None
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
    """One change of one key. `value` is None for DELETE and RESYNC; `create_revision` and
    `lease_id` are those of a PUT (0 otherwise)."""

    type: EventType
    key: str
    value: str | None
    mod_revision: int
    create_revision: int = 0
    lease_id: int = 0


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


@lru_cache(maxsize=1 << 16)
def incarnation_tag(incarnation: str) -> str:
    """What a generation record keeps of a planned node's agent incarnation: 24 bits of its
    hash, 4 characters. A restarted agent draws a new random incarnation, whose tag equals
    the old one with probability 2**-24; a restart missed so is still seen, later, as its
    workers' failure. Remembered (the leader compares every planned node's on every tick:
    a hash each was most of a 2,048-node leader's steady work)."""
    digest = hashlib.blake2b(incarnation.encode("utf-8"), digest_size=3).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii")


TAG_CHARS = len(incarnation_tag(""))


def node_fields(
    plan: Mapping[str, Any], nodes: Sequence[str], incarnations: Mapping[str, str]
) -> dict[str, Any]:
    """The `extra` fields naming the nodes a generation is planned for (`nodes`, in order):
    `spares`, those of `nodes` without a rank in `plan`, and `incarnations`, the tags of
    every planned node's incarnation in `GenerationRecord.planned_nodes` order, one string.
    The plan already lists the nodes with ranks, and their addresses are in their member
    keys: at 2,048 nodes, per-node maps made the record ~300 KiB (see `planned_nodes`)."""
    placed = _placed_nodes(plan, "node_fields")
    ranked = set(placed)
    spares = [n for n in dict.fromkeys(nodes) if n not in ranked]
    tags = "".join(incarnation_tag(incarnations[n]) for n in (*placed, *spares))
    return {"spares": spares, "incarnations": tags}


def _placed_nodes(plan: Mapping[str, Any], what: str) -> tuple[str, ...]:
    """The nodes with ranks in a plan's JSON object, in the order of their first rank (plan
    format 2: runs of ranks per node; format 1: one object per rank)."""
    placement = plan.get("placement")
    try:
        if isinstance(placement, dict):
            ids = [run[0] for run in placement["node_runs"]]
        elif isinstance(placement, list):
            ids = [entry["node_id"] for entry in placement]
        else:
            ids = []
    except (KeyError, TypeError, IndexError) as exc:
        raise ClusterDataError(f"{what}: plan placement unreadable ({exc!r})") from None
    if not all(isinstance(i, str) for i in ids):
        raise ClusterDataError(f"{what}: plan placement names a node that is not a string")
    return tuple(dict.fromkeys(ids))


@dataclass(frozen=True)
class GenerationRecord:
    """One plan generation, as the leader writes it by compare-and-swap.

    `plan` is the plan's JSON object (`Plan.to_dict()`); this layer reads of it only the
    three numbers of its layout (for `GenerationSummary`) and which nodes have ranks.
    `resume_step` is the step training resumes at (after a loss), `switch_step` the step
    boundary at which a planned change (a join) takes effect; either may be None.
    `extra` holds what the leader adds: `reason`, `graceful`, `previous_layout`, times, and
    the planned nodes (`node_fields`); records of earlier releases mapped them instead,
    `nodes` (node -> address), `sources` and `incarnations` (node -> incarnation), and
    still read (`planned_nodes`, `incarnation_tags`).
    """

    generation: int
    plan: dict[str, Any]
    leader: str
    created_at: float
    resume_step: int | None = None
    switch_step: int | None = None
    store_address: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def planned_nodes(self) -> tuple[str, ...]:
        """The nodes this generation was planned for: the plan's, in the order of their
        first rank, then the spares (planned for, no rank). `ClusterDataError` if unreadable."""
        old = self.extra.get("nodes")
        if isinstance(old, dict):  # written before node_fields: node -> address
            return tuple(str(n) for n in old)
        spares = self.extra.get("spares", [])
        if not isinstance(spares, list) or not all(isinstance(n, str) for n in spares):
            raise ClusterDataError(f"generation record: spares must be node ids, got {spares!r}")
        placed = _placed_nodes(self.plan, "generation record")
        ranked = set(placed)
        return (*placed, *(n for n in dict.fromkeys(spares) if n not in ranked))

    @cached_property
    def planned_set(self) -> frozenset[str]:
        """`planned_nodes` as a set, made once per record (the agents of a process share
        one record: `shared`)."""
        return frozenset(self.planned_nodes)

    @cached_property
    def planned_sorted(self) -> tuple[str, ...]:
        """`planned_nodes` sorted, made once per record (the leader's view asks at every
        turn)."""
        return tuple(sorted(self.planned_nodes))

    @cached_property
    def rendezvous_prefix(self) -> str:
        """The key prefix the generation's workers meet under in the rendezvous store:
        `gen<G>-<token>`, the leader's secret for this generation (`gen<G>` in records of
        earlier releases). `ClusterDataError` if the token is not 32 hex digits."""
        token = self.extra.get("rendezvous")
        if token is None:
            return f"gen{self.generation}"
        if not isinstance(token, str) or not _TOKEN_RE.fullmatch(token):
            raise ClusterDataError(f"generation record: rendezvous {token!r:.40} is not a token")
        return f"gen{self.generation}-{token}"

    @cached_property
    def incarnation_tags(self) -> dict[str, str]:
        """Planned node -> the tag of its agent's incarnation when planned (`incarnation_tag`);
        empty if the record has none. `ClusterDataError` if unreadable."""
        value = self.extra.get("incarnations")
        if value is None:
            return {}
        if isinstance(value, dict):  # written before node_fields: node -> incarnation
            return {str(n): incarnation_tag(str(i)) for n, i in value.items()}
        nodes = self.planned_nodes
        if not isinstance(value, str) or len(value) != TAG_CHARS * len(nodes):
            raise ClusterDataError(
                f"generation record: incarnations must be {TAG_CHARS} characters for each of "
                f"the {len(nodes)} planned nodes, got {value!r:.80}"
            )
        return {n: value[i * TAG_CHARS : (i + 1) * TAG_CHARS] for i, n in enumerate(nodes)}

    def reregistered(self, members: Mapping[str, Mapping[str, Any]]) -> set[str]:
        """The planned nodes registered in `members` under another incarnation than when
        planned: their agents restarted (their workers are gone, and so may be the state
        this generation counted on)."""
        return {
            n
            for n, tag in self.incarnation_tags.items()
            if n in members and incarnation_tag(str(members[n].get("incarnation"))) != tag
        }

    def to_json(self) -> str:
        # Tight: the plan's placement runs grow with the cluster, and the record is one value.
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
            },
            tight=True,
        )

    @classmethod
    def shared(cls, text: str | bytes) -> GenerationRecord:
        """`from_json(text)`, one object for equal text in this process. Every node reads the
        record, whose node list grows with the cluster: the agents of one process (the
        simulation's hundreds) parse and check it once, not once each (O(N) per agent, O(N^2)
        per process). Callers must not change the record's `plan` or `extra`. The last
        SHARED_RECORDS are kept; text that does not parse is refused every time."""
        return _SHARED.get(text, lambda: cls.from_json(text))

    @classmethod
    def from_json(cls, text: str | bytes) -> GenerationRecord:
        data = loads(text, "generation record")
        try:
            generation = data["generation"]
            if not isinstance(generation, int) or generation < 1:
                raise ClusterDataError(
                    f"generation record: generation must be an integer >= 1, got {generation!r}"
                )
            record = cls(
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
        record.incarnation_tags  # noqa: B018 -- read once here: refused now, not mid-decision
        record.rendezvous_prefix  # noqa: B018
        return record


@dataclass(frozen=True)
class GenerationSummary:
    """What `generations/<G>` keeps of generation G: who wrote it when, its layout, how many
    nodes, why, and the layout before. Not the plan or the per-node maps: the history is
    written in the same transaction as the record, and a second full copy would double the
    bytes of a transaction that must stay under etcd's request limit.

    `of` reads the record's plan only for its `pp`, `tp` and `dp`, its planned nodes, and
    its `extra` for `reason` and `previous_layout`; a field the record lacks reads as empty.
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
        return cls(
            generation=record.generation,
            leader=record.leader,
            created_at=record.created_at,
            layout=layout,
            nodes=len(record.planned_nodes),
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


# The health records, a node's quarantine and the job's end (elasticpp.cluster.health), and
# an operator's requests: stop, checkpoint now, cordon (elasticpp.cluster.requests).
END_STATUSES = ("failed", "halted", "stopped")


def _text(data: Mapping[str, Any], name: str, what: str) -> str:
    value = data.get(name)
    if not isinstance(value, str):
        raise ClusterDataError(f"{what}: {name} must be a string, got {value!r}")
    return value


def _number(data: Mapping[str, Any], name: str, what: str) -> float:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterDataError(f"{what}: {name} must be a number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class QuarantineRecord:
    node_id: str
    reason: str
    since: float  # wall-clock seconds
    until: float
    count: int
    incarnation: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "reason": self.reason,
            "since": self.since,
            "until": self.until,
            "count": self.count,
            "incarnation": self.incarnation,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuarantineRecord:
        what = "quarantine record"
        count = data.get("count")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ClusterDataError(f"{what}: count must be an integer >= 1, got {count!r}")
        return cls(
            node_id=_text(data, "node_id", what),
            reason=_text(data, "reason", what),
            since=_number(data, "since", what),
            until=_number(data, "until", what),
            count=count,
            incarnation=_text(data, "incarnation", what),
        )


@dataclass(frozen=True)
class JobEnd:
    status: str  # one of END_STATUSES
    reason: str
    by: str  # the node that ended it
    at: float
    step: int = -1  # the newest committed step known to the writer; -1 if none

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "reason": self.reason,
            "by": self.by,
            "at": self.at,
            "step": self.step,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobEnd:
        what = "job end record"
        status = _text(data, "status", what)
        if status not in END_STATUSES:
            raise ClusterDataError(f"{what}: status {status!r} is not one of {END_STATUSES}")
        step = data.get("step", -1)
        if isinstance(step, bool) or not isinstance(step, int):
            raise ClusterDataError(f"{what}: step must be an integer, got {step!r}")
        return cls(
            status=status,
            reason=_text(data, "reason", what),
            by=_text(data, "by", what),
            at=_number(data, "at", what),
            step=step,
        )


@dataclass(frozen=True)
class StopRequest:
    """An operator asked the job to stop (`elasticpp job stop`): every agent stops its
    workers at a step boundary, commits and persists that step, and the leader then ends
    the job as `stopped` (elasticpp.agent.stop)."""

    by: str  # who asked (free text: a user, a host)
    reason: str
    at: float  # wall-clock seconds

    def to_dict(self) -> dict[str, Any]:
        return {"v": 1, "by": self.by, "reason": self.reason, "at": self.at}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StopRequest:
        what = "job stop request"
        if data.get("v") != 1:
            raise ClusterDataError(f"{what}: version {data.get('v')!r} is not 1")
        return cls(
            by=_text(data, "by", what),
            reason=_text(data, "reason", what),
            at=_number(data, "at", what),
        )


@dataclass(frozen=True)
class CordonRecord:
    """An operator set a node aside (`elasticpp job cordon`): it is planned into no new
    generation, and the job moves off it at a step boundary as off a draining node; its
    agent stays up (a spare) until `job uncordon` deletes the record."""

    node_id: str
    by: str  # who asked (free text: a user, a host)
    reason: str
    at: float  # wall-clock seconds

    def to_dict(self) -> dict[str, Any]:
        return {"v": 1, "node_id": self.node_id, "by": self.by, "reason": self.reason,
                "at": self.at}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CordonRecord:
        what = "cordon record"
        if data.get("v") != 1:
            raise ClusterDataError(f"{what}: version {data.get('v')!r} is not 1")
        return cls(
            node_id=_text(data, "node_id", what),
            by=_text(data, "by", what),
            reason=_text(data, "reason", what),
            at=_number(data, "at", what),
        )


@dataclass(frozen=True)
class CheckpointRequest:
    """An operator asked for a persistent checkpoint now (`elasticpp job checkpoint`): every
    agent reports the committed steps it holds (barrier `checkpoint`, keeping them), the
    command picks the newest one every planned node holds (`step`, written into the same
    request) and every agent persists its pieces of that step into the job's persist_dir."""

    id: str  # one request from another (a new one replaces the old)
    by: str  # who asked (free text: a user, a host)
    reason: str
    at: float  # wall-clock seconds
    step: int | None = None  # the step to persist, once chosen

    def to_dict(self) -> dict[str, Any]:
        return {"v": 1, "id": self.id, "by": self.by, "reason": self.reason, "at": self.at,
                "step": self.step}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckpointRequest:
        what = "checkpoint request"
        if data.get("v") != 1:
            raise ClusterDataError(f"{what}: version {data.get('v')!r} is not 1")
        step = data.get("step")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ClusterDataError(
                f"{what}: step must be a whole number >= 0 or null, got {step!r}"
            )
        return cls(
            id=_text(data, "id", what),
            by=_text(data, "by", what),
            reason=_text(data, "reason", what),
            at=_number(data, "at", what),
            step=step,
        )
