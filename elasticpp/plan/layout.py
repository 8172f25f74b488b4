"""Layouts, placement and the `Plan` every worker runs. Pure Python.

Rank order (documented for operators and kept by every layout):

    group = dp_index * pp + pp_index        # one tensor-parallel group per (dp, pp)
    rank  = group * tp + tp_index           # tp fastest: a TP group is consecutive ranks

TP groups are packed onto nodes in group order, node by node, each node holding
`gpus // tp` groups, so a TP group never crosses a node and the stages of one replica sit
next to each other (stage-to-stage p2p stays inside a node where it can). A node's GPUs
beyond its groups stay idle.

A `Plan` is serialised as versioned JSON (`format_version`); it crosses process and network
boundaries, so it never holds anything that would need pickling. Version 2 writes the
placement compactly, one `[node_id, count]` run per stretch of consecutive ranks on one node:
a rank's coordinates follow from the rank and the layout (`coord_of`, which `validate`
enforces), and its GPU index on the node is, by default, the number of lower ranks on that
node (what `place` assigns). A rank placed otherwise is listed in `local_ranks` as
`[rank, local_rank]`, so any valid placement reads back exactly. Version 1 (one object per
rank) is still read.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from elasticpp.errors import ConfigError, PlanError
from elasticpp.interned import Interned
from elasticpp.plan.specs import ClusterSpec, ModelSpec

PLAN_FORMAT_VERSION = 2
# Version 1 spelled out every rank's slot; plans of that form may still be in etcd or files.
PLAN_FORMAT_VERSIONS_READ = (1, 2)
# The form a plan takes in a generation record (`Plan.to_record`): no model section, the
# model's fingerprint instead. Whatever an etcd writer puts there, a reader builds the model
# from its own job spec; a record made for another model is refused, never run.
PLAN_RECORD_FORMAT_VERSION = 3
SHARED_PLANS = 8  # plans `Plan.shared` keeps


@dataclass(frozen=True, order=True)
class Layout:
    pp: int
    tp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    def __str__(self) -> str:
        return f"pp={self.pp},tp={self.tp},dp={self.dp}"

    @classmethod
    def parse(cls, text: str) -> Layout:
        """`pp=2,tp=2,dp=1` (any order; a missing axis is 1)."""
        values = {"pp": 1, "tp": 1, "dp": 1}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, val = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in values:
                raise ConfigError(f"layout {text!r}: expected pp=P,tp=T,dp=D, got {part!r}")
            try:
                values[key] = int(val)
            except ValueError:
                raise ConfigError(f"layout {text!r}: {key} must be an integer") from None
            if values[key] <= 0:
                raise ConfigError(f"layout {text!r}: {key} must be positive")
        return cls(**values)


@dataclass(frozen=True, order=True)
class Coord:
    """A worker's coordinates in the layout."""

    pp: int
    tp: int
    dp: int


@dataclass(frozen=True)
class WorkerSlot:
    rank: int
    node_id: str
    local_rank: int  # GPU index (or worker slot) on the node
    coord: Coord


def rank_of(layout: Layout, coord: Coord) -> int:
    return (coord.dp * layout.pp + coord.pp) * layout.tp + coord.tp


def coord_of(layout: Layout, rank: int) -> Coord:
    group, tp = divmod(rank, layout.tp)
    dp, pp = divmod(group, layout.pp)
    return Coord(pp=pp, tp=tp, dp=dp)


def split_batch(global_batch: int, micro_batch: int, dp: int) -> tuple[int, ...]:
    """Micro-batch counts per replica with sum(m_r) * micro_batch == global_batch exactly.

    Counts differ by at most one; the larger counts go to the lower replicas.
    """
    if micro_batch <= 0 or dp <= 0:
        raise ConfigError("micro_batch and dp must be positive")
    if global_batch % micro_batch:
        raise PlanError(
            f"global batch {global_batch} is not a multiple of micro-batch {micro_batch}"
        )
    total = global_batch // micro_batch
    if total < dp:
        raise PlanError(
            f"global batch {global_batch} is too small for dp={dp} replicas of micro-batch "
            f"{micro_batch} (needs at least {dp * micro_batch})"
        )
    base, extra = divmod(total, dp)
    return tuple(base + (1 if r < extra else 0) for r in range(dp))


def partition_even(num_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """Contiguous `[first, end)` block ranges, as even as the count allows."""
    if pp > num_layers:
        raise PlanError(f"{pp} pipeline stages for {num_layers} layers: at most one stage a layer")
    base, extra = divmod(num_layers, pp)
    stages, first = [], 0
    for s in range(pp):
        end = first + base + (1 if s >= pp - extra else 0)
        stages.append((first, end))
        first = end
    return tuple(stages)


def place(cluster: ClusterSpec, layout: Layout) -> tuple[WorkerSlot, ...]:
    """Assign every rank a (node, local GPU); TP groups stay inside one node."""
    pp, tp = layout.pp, layout.tp
    groups_needed = pp * layout.dp
    slots: list[WorkerSlot] = []
    group = 0
    for node in cluster.nodes:
        fits = min(node.gpus // tp, groups_needed - group)
        for g in range(fits):
            # rank = group * tp + t and (dp, pp) = divmod(group, pp): see the module docstring
            dp_index, pp_index = divmod(group, pp)
            rank0 = group * tp
            local0 = g * tp
            for t in range(tp):
                slots.append(
                    WorkerSlot(rank0 + t, node.node_id, local0 + t, Coord(pp_index, t, dp_index))
                )
            group += 1
        if group == groups_needed:
            break
    if group < groups_needed:
        raise PlanError(
            f"layout {layout} needs {groups_needed} groups of {layout.tp} GPUs inside a node; "
            f"the cluster has room for {group}"
        )
    return tuple(slots)


@dataclass(frozen=True)
class Plan:
    """A layout with everything a worker needs to run its part of every step."""

    model: ModelSpec
    layout: Layout
    global_batch: int
    micro_batch: int
    microbatches: tuple[int, ...]  # per data-parallel replica; sum * micro_batch == global_batch
    stages: tuple[tuple[int, int], ...]  # per pipeline stage, [first_block, end_block)
    recompute: bool
    placement: tuple[WorkerSlot, ...]  # indexed by rank
    est_step_seconds: float = 0.0
    bubble_fraction: float = 0.0
    memory_gib: float = 0.0  # the largest per-GPU estimate
    generation: int = 0

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def gpus_used(self) -> int:
        return self.layout.world_size

    def slot(self, rank: int) -> WorkerSlot:
        return self.placement[rank]

    def ranks_on(self, node_id: str) -> list[WorkerSlot]:
        """The slots placed on `node_id`, in rank order (a new list each call)."""
        return list(self._slots_by_node.get(node_id, ()))

    @cached_property
    def _slots_by_node(self) -> dict[str, tuple[WorkerSlot, ...]]:
        # Every agent asks for its own ranks on every tick: a scan of the whole placement
        # was O(world) a tick on each of N nodes (16,384 ranks at 2,048 nodes).
        by_node: dict[str, list[WorkerSlot]] = {}
        for slot in self.placement:
            by_node.setdefault(slot.node_id, []).append(slot)
        return {node: tuple(slots) for node, slots in by_node.items()}

    def sample_range(self, dp_index: int) -> tuple[int, int]:
        """Offsets `[first, end)` within a step's global batch that replica `dp_index` trains."""
        first = sum(self.microbatches[:dp_index]) * self.micro_batch
        return first, first + self.microbatches[dp_index] * self.micro_batch

    def with_generation(self, generation: int) -> Plan:
        # The fields alone: __dict__ also holds what cached properties computed.
        return dataclasses.replace(self, generation=generation)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": PLAN_FORMAT_VERSION,
            "generation": self.generation,
            "model": self.model.to_dict(),
            "pp": self.pp,
            "tp": self.tp,
            "dp": self.dp,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "microbatches": list(self.microbatches),
            "stages": [list(s) for s in self.stages],
            "recompute": self.recompute,
            "placement": _placement_to_dict(self.placement),
            "gpus_used": self.gpus_used,
            "est_step_seconds": self.est_step_seconds,
            "bubble_fraction": self.bubble_fraction,
            "memory_gib": self.memory_gib,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @cached_property
    def shared_dict(self) -> dict[str, Any]:
        """`to_dict()`, made once per plan object: the agents of a process share a
        generation's plan (`shared`), and each hands it to its workers; its placement is
        serialised once, not once per agent. Callers must not change it."""
        return self.to_dict()

    def to_record(self, model_fingerprint: str) -> dict[str, Any]:
        """The plan as a generation record holds it: `to_dict()` without the model,
        which every reader takes from its own job spec, and with the fingerprint of that
        spec's model (`JobSpec.model_fingerprint`), which a reader compares with its own."""
        data = self.to_dict()
        del data["model"]
        data["format_version"] = PLAN_RECORD_FORMAT_VERSION
        data["model_fingerprint"] = model_fingerprint
        return data

    @classmethod
    def from_record(cls, data: dict[str, Any], model: ModelSpec, model_fingerprint: str) -> Plan:
        """The plan of a generation record, built with `model` (the reader's own job spec's,
        whose fingerprint is `model_fingerprint`). A record names no code: a plan made for
        another model (another fingerprint, or an earlier release's model section that is
        not `model`) is refused with `ConfigError`, whatever that section names."""
        if not isinstance(data, dict):
            raise ConfigError("plan: expected a JSON object")
        version = data.get("format_version")
        if version == PLAN_RECORD_FORMAT_VERSION:
            theirs = data.get("model_fingerprint")
            if "model" in data:
                raise ConfigError("plan: a record's plan carries no model section")
            if theirs != model_fingerprint:
                raise ConfigError(
                    f"plan: made for the model with fingerprint {_short(theirs)}, "
                    f"not this job spec's model ({model_fingerprint[:12]})"
                )
            body = {**data, "format_version": PLAN_FORMAT_VERSION}
        elif version in PLAN_FORMAT_VERSIONS_READ:
            # Written by an earlier release, with the model spelled out: read only when that
            # model is this spec's, field for field; the model built is still this spec's.
            theirs = data.get("model")
            if theirs != json.loads(json.dumps(model.to_dict())):
                family = theirs.get("family") if isinstance(theirs, dict) else theirs
                raise ConfigError(
                    "plan: its model section differs from this job spec's model "
                    f"(family {_short(family)})"
                )
            body = data
        else:
            raise ConfigError(
                f"plan: format_version {version!r} is not one of "
                f"{(*PLAN_FORMAT_VERSIONS_READ, PLAN_RECORD_FORMAT_VERSION)}"
            )
        return cls._with_model(body, model)

    @classmethod
    def shared(
        cls,
        data: dict[str, Any],
        model: ModelSpec | None = None,
        model_fingerprint: str = "",
    ) -> Plan:
        """`from_dict(data)`, one object for equal data in this process (a plan is
        immutable): the agents of one process (the simulation's hundreds) parse a
        generation's plan and index its placement by node once, not once each, which was
        O(N) per agent and O(N^2) per process. The last SHARED_PLANS are kept. `data` must
        not be changed afterwards (the same dict asked again is answered without reading it).
        With `model`: `from_record(data, model, model_fingerprint)`, a generation record's
        plan (kept apart by the fingerprint: what a record says is read against each spec)."""
        if model is not None and not model_fingerprint:
            raise ConfigError("plan: a record's plan is read with its model's fingerprint")
        with _SHARED_LOCK:
            # The same dict again (the agents of a process share a parsed generation record,
            # `GenerationRecord.shared`): no key to serialise. The entry holds `data`, so its
            # id is not reused while it is kept.
            held = _SHARED_BY_ID.get((id(data), model_fingerprint))
            if held is not None and held[0] is data:
                return held[1]
        key = model_fingerprint + json.dumps(data, sort_keys=True, separators=(",", ":"))
        if model is None:
            plan = _SHARED.get(key, lambda: cls.from_dict(data))  # bad data: nothing kept
        else:
            plan = _SHARED.get(key, lambda: cls.from_record(data, model, model_fingerprint))
        with _SHARED_LOCK:
            _SHARED_BY_ID[(id(data), model_fingerprint)] = (data, plan)
            while len(_SHARED_BY_ID) > SHARED_PLANS:
                _SHARED_BY_ID.pop(next(iter(_SHARED_BY_ID)))
        return plan

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """A plan with its model spelled out (`to_dict()`: plan files, a worker's
        assignment); a generation record's plan is read with `from_record`."""
        version = data.get("format_version")
        if version not in PLAN_FORMAT_VERSIONS_READ:
            raise ConfigError(
                f"plan: format_version {version!r} is not one of {PLAN_FORMAT_VERSIONS_READ}"
            )
        try:
            model = ModelSpec.from_dict(dict(data["model"]), source="plan.model")
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"plan: malformed field: {exc!r}") from exc
        return cls._with_model(data, model)

    @classmethod
    def _with_model(cls, data: dict[str, Any], model: ModelSpec) -> Plan:
        version = data.get("format_version")
        try:
            layout = Layout(int(data["pp"]), int(data["tp"]), int(data["dp"]))
            if version == 1:
                placement = _placement_from_v1(data["placement"])
            else:
                placement = _placement_from_dict(data["placement"], layout)
            plan = cls(
                model=model,
                layout=layout,
                global_batch=int(data["global_batch"]),
                micro_batch=int(data["micro_batch"]),
                microbatches=tuple(int(m) for m in data["microbatches"]),
                stages=tuple((int(a), int(b)) for a, b in data["stages"]),
                recompute=bool(data["recompute"]),
                placement=placement,
                est_step_seconds=float(data.get("est_step_seconds", 0.0)),
                bubble_fraction=float(data.get("bubble_fraction", 0.0)),
                memory_gib=float(data.get("memory_gib", 0.0)),
                generation=int(data.get("generation", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"plan: malformed field: {exc!r}") from exc
        plan.validate()
        return plan

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"plan: not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError("plan: expected a JSON object")
        return cls.from_dict(data)

    def validate(self) -> None:
        """Check the promises every plan keeps; raises `PlanError` naming the broken one."""
        L = self.layout
        if not self.model.tp_fits(L.tp):
            raise PlanError(f"tp={L.tp} does not divide {_tp_sizes(self.model)}")
        if len(self.microbatches) != L.dp:
            raise PlanError(f"{len(self.microbatches)} micro-batch counts for dp={L.dp}")
        if (
            sum(self.microbatches) * self.micro_batch != self.global_batch
            or min(self.microbatches) < 1
        ):
            raise PlanError(
                f"micro-batches {list(self.microbatches)} x {self.micro_batch} != global batch "
                f"{self.global_batch}"
            )
        if len(self.stages) != L.pp:
            raise PlanError(f"{len(self.stages)} stages for pp={L.pp}")
        expect = 0
        for first, end in self.stages:
            if first != expect or end <= first:
                raise PlanError(f"stages {list(self.stages)} are not contiguous non-empty ranges")
            expect = end
        if expect != self.model.num_layers:
            raise PlanError(f"stages cover {expect} of {self.model.num_layers} layers")
        if len(self.placement) != L.world_size:
            raise PlanError(f"placement has {len(self.placement)} ranks for {L.world_size}")
        seen: set[tuple[str, int]] = set()
        lead_node = ""
        for rank, s in enumerate(self.placement):
            group, tp_index = divmod(rank, L.tp)
            dp_index, pp_index = divmod(group, L.pp)
            c = s.coord
            if s.rank != rank or c.tp != tp_index or c.pp != pp_index or c.dp != dp_index:
                raise PlanError(f"placement rank {rank} has wrong rank/coordinates")
            where = (s.node_id, s.local_rank)
            if where in seen:
                raise PlanError(f"two ranks on {s.node_id} GPU {s.local_rank}")
            seen.add(where)
            if tp_index == 0:
                lead_node = s.node_id
            elif s.node_id != lead_node:
                raise PlanError(f"TP group of rank {rank} crosses nodes")


def build_plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    layout: Layout,
    *,
    global_batch: int,
    micro_batch: int,
    recompute: bool = False,
    stages: tuple[tuple[int, int], ...] | None = None,
) -> Plan:
    """A plan for a fixed layout (no search): validated batch split, stages and placement."""
    if not model.tp_fits(layout.tp):
        raise PlanError(f"tp={layout.tp} does not divide {_tp_sizes(model)}")
    if layout.tp > cluster.max_gpus_per_node:
        raise PlanError(
            f"tp={layout.tp} exceeds the GPUs of any node ({cluster.max_gpus_per_node})"
        )
    plan = Plan(
        model=model,
        layout=layout,
        global_batch=global_batch,
        micro_batch=micro_batch,
        microbatches=split_batch(global_batch, micro_batch, layout.dp),
        stages=stages if stages is not None else partition_even(model.num_layers, layout.pp),
        recompute=recompute,
        placement=place(cluster, layout),
    )
    plan.validate()
    return plan


_SHARED: Interned[str, Plan] = Interned(SHARED_PLANS)  # by the plan's canonical JSON
# id(data) -> (data, its plan): the dicts asked about last, insertion-ordered.
_SHARED_BY_ID: dict[tuple[int, str], tuple[dict[str, Any], Plan]] = {}
_SHARED_LOCK = threading.Lock()


def _placement_to_dict(placement: tuple[WorkerSlot, ...]) -> dict[str, Any]:
    """Runs of ranks per node plus the ranks whose GPU index is not the derived one."""
    runs: list[list[Any]] = []
    next_local: dict[str, int] = {}
    moved: list[list[int]] = []
    for s in placement:
        if runs and runs[-1][0] == s.node_id:
            runs[-1][1] += 1
        else:
            runs.append([s.node_id, 1])
        derived = next_local.get(s.node_id, 0)
        next_local[s.node_id] = derived + 1
        if s.local_rank != derived:
            moved.append([s.rank, s.local_rank])
    return {"node_runs": runs, "local_ranks": moved}


def _placement_from_dict(data: dict[str, Any], layout: Layout) -> tuple[WorkerSlot, ...]:
    """The inverse of `_placement_to_dict`; `ConfigError` naming what does not add up."""
    nodes: list[str] = []
    for entry in data["node_runs"]:
        node_id, count = entry
        if not isinstance(node_id, str) or not _is_int(count) or count < 1:
            raise ConfigError(f"plan: placement run {entry!r} is not [node_id, count >= 1]")
        nodes.extend([node_id] * count)
    if len(nodes) != layout.world_size:
        raise ConfigError(
            f"plan: placement runs cover {len(nodes)} ranks; layout {layout} has "
            f"{layout.world_size}"
        )
    moved: dict[int, int] = {}
    for entry in data.get("local_ranks", []):
        rank, local = entry
        if not _is_int(rank) or not 0 <= rank < len(nodes) or rank in moved:
            raise ConfigError(f"plan: local_ranks entry {entry!r} names no rank or one twice")
        if not _is_int(local) or local < 0:
            raise ConfigError(f"plan: local_ranks entry {entry!r}: GPU index must be >= 0")
        moved[rank] = local
    next_local: dict[str, int] = {}
    slots = []
    for rank, node_id in enumerate(nodes):
        derived = next_local.get(node_id, 0)
        next_local[node_id] = derived + 1
        slots.append(WorkerSlot(rank, node_id, moved.get(rank, derived), coord_of(layout, rank)))
    return tuple(slots)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _placement_from_v1(entries: list[dict[str, Any]]) -> tuple[WorkerSlot, ...]:
    return tuple(
        WorkerSlot(
            int(p["rank"]),
            str(p["node_id"]),
            int(p["local_rank"]),
            Coord(int(p["pp"]), int(p["tp"]), int(p["dp"])),
        )
        for p in entries
    )


def _tp_sizes(model: ModelSpec) -> str:
    """What a tensor-parallel width must divide, for error messages."""
    if model.numbers is not None:
        return f"the model's split sizes {model.tp_divisors}"
    return f"num_heads={model.num_heads} and num_kv_heads={model.num_kv_heads}"


def _short(value: object) -> str:
    """A value from outside, for a message: its repr, cut short."""
    return f"{value!r:.80}"
