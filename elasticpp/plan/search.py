"""The layout search: the fastest (p, t, d, b, recompute) that fits, for any cluster.

Candidates
    t divides num_heads (and num_kv_heads, and a declared model's split sizes), t <= the GPUs
    of the largest node and t divides the GPU count of at least one node (so TP groups
    pack; a node holds gpus // t groups); 1 <= p <= num_layers;
    p * d groups fit the cluster; b from `MICRO_BATCH_CHOICES` dividing B (or fixed);
    d <= B / b; recompute on or off. A plan may leave GPUs idle.
Choice
    the smallest estimated step time among the plans that fit in memory; ties go to fewer
    GPUs, then smaller (p, t, d, b), then no recomputation — the key is
    `(est_step_seconds, gpus_used, pp, tp, dp, micro_batch, recompute)`. Runner-ups are the
    best plan of each other (p, t, b, recompute) combination, in the same order.
Speed
    Everything except d and the cluster's shape is cluster-independent, so a `Planner`
    computes one `Profile` per (p, t, b, recompute) once (elasticpp.plan.profile: the
    balanced stages, their times, what fits in memory). For a cluster only d remains; the
    step time `slot * (ceil(N/d) + p - 1) + allreduce(d) + optimizer` (N = B/b) is least at
    the smallest d of each distinct ceil(N/d) (allreduce(d) grows with d, in bytes and in its
    2(d-1) message latencies, and a larger d can only move p2p and DP traffic from the
    intra-node link to the network, assumed no faster in bandwidth or latency); profiles are
    visited best lower bound first and the search stops when no profile can beat the
    runner-ups. Placements (O(GPUs)) are built for the returned plans only. `plan_all`
    reuses one set of profiles for every node count.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from elasticpp.errors import ConfigError, PlanError
from elasticpp.plan import cost
from elasticpp.plan.layout import Layout, Plan, build_plan, split_batch
from elasticpp.plan.partition import balanced_stages
from elasticpp.plan.profile import NO_LIMIT, Choice, Profile, Shape, largest_fitting_m, memory_bytes
from elasticpp.plan.specs import GIB, ClusterSpec, DeviceSpec, ModelSpec

MICRO_BATCH_CHOICES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Candidate:
    """A planned layout without its placement: what a table of choices shows."""

    layout: Layout
    micro_batch: int
    microbatches: tuple[int, ...]
    stages: tuple[tuple[int, int], ...]
    recompute: bool
    est_step_seconds: float
    bubble_fraction: float
    memory_gib: float

    @property
    def gpus_used(self) -> int:
        return self.layout.world_size

    def to_dict(self) -> dict[str, Any]:
        """The summary shape `elasticpp plan --json` prints for the plan and each runner-up."""
        return {
            "pp": self.layout.pp,
            "tp": self.layout.tp,
            "dp": self.layout.dp,
            "micro_batch": self.micro_batch,
            "microbatches": list(self.microbatches),
            "stages": [list(s) for s in self.stages],
            "recompute": self.recompute,
            "gpus_used": self.gpus_used,
            "est_step_seconds": self.est_step_seconds,
            "bubble_fraction": self.bubble_fraction,
            "memory_gib": self.memory_gib,
        }


class PlanResult:
    """The chosen plan and the runner-ups, best first.

    `best` is built at once; the runner-ups' placements (one entry per GPU each) only when
    `alternatives` is first read. `candidates` describes all of them without placements.
    """

    def __init__(
        self, best: Plan, candidates: list[Candidate], build: Callable[[int], Plan]
    ) -> None:
        self.best = best
        self.candidates = candidates
        self._build = build
        self._alternatives: list[Plan] | None = None

    @property
    def alternatives(self) -> list[Plan]:
        if self._alternatives is None:
            self._alternatives = [self._build(i) for i in range(1, len(self.candidates))]
        return self._alternatives


class Planner:
    """Plans for one model, device and global batch; caches what cluster changes leave alone.

    Keep one per job: `plan(cluster)` for the live (possibly uneven) set of nodes and
    `plan_all(...)` for every uniform node count ahead of time share the cached profiles.
    """

    def __init__(
        self,
        model: ModelSpec,
        device: DeviceSpec,
        global_batch: int,
        *,
        micro_batch: int | None = None,
        params: cost.CostParams | None = None,
    ) -> None:
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise ConfigError(f"global_batch must be a positive integer, got {global_batch!r}")
        if micro_batch is not None:
            if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
                raise ConfigError(f"micro_batch must be a positive integer, got {micro_batch!r}")
            if global_batch % micro_batch:
                raise PlanError(
                    f"global batch {global_batch} is not a multiple of micro-batch {micro_batch}"
                )
            self.micro_batches: tuple[int, ...] = (micro_batch,)
        else:
            self.micro_batches = tuple(b for b in MICRO_BATCH_CHOICES if global_batch % b == 0)
        self.model = model
        self.device = device
        self.global_batch = global_batch
        self.params = params or cost.CostParams()
        self._mc = cost.ModelCosts.of(model)
        self._profiles: dict[int, tuple[Profile, ...]] = {}  # per tp

    # -- profiles ---------------------------------------------------------------------------

    def tp_choices(self, cluster: ClusterSpec) -> list[int]:
        widest = cluster.max_gpus_per_node
        sizes = {n.gpus for n in cluster.nodes if n.gpus}
        return [
            t
            for t in range(1, widest + 1)
            if self.model.tp_fits(t) and any(g % t == 0 for g in sizes)
        ]

    def _profiles_for(self, tp: int) -> tuple[Profile, ...]:
        cached = self._profiles.get(tp)
        if cached is None:
            cached = tuple(self._build_profiles(tp))
            self._profiles[tp] = cached
        return cached

    def _build_profiles(self, tp: int) -> Iterator[Profile]:
        """The profiles that fit in memory with some micro-batch count."""
        capacity = self.device.memory_bytes
        # No stage holds less than the average state, so a (p, t) whose average alone
        # overflows never fits: skip it before partitioning.
        state = cost.total_params(self.model) * self.params.state_bytes_per_param
        workspace = self.params.workspace_gib * GIB
        for recompute in (False, True):
            too_big: set[int] = set()  # memory grows with b: a p that failed stays failed
            for b in self.micro_batches:
                costs = self._unit_costs(tp, b, recompute)
                for pp in range(1, self.model.num_layers + 1):
                    if pp in too_big or state / (pp * tp) + workspace > capacity:
                        continue
                    prof = self._profile(tp, b, recompute, pp, costs)
                    if prof.max_in_flight_fit == 0:
                        too_big.add(pp)
                    else:
                        yield prof

    def _unit_costs(
        self, tp: int, b: int, recompute: bool
    ) -> tuple[cost.UnitCosts, cost.MemoryCosts, float, float]:
        uc = cost.unit_costs(self._mc, self.device, self.params, b, tp, recompute)
        mem = cost.memory_costs(self._mc, self.params, b, tp, recompute)
        p2p_intra = 2.0 * cost.p2p_seconds(uc, self.device, True)
        p2p_inter = 2.0 * cost.p2p_seconds(uc, self.device, False)
        return uc, mem, p2p_intra, p2p_inter

    def _profile(
        self,
        tp: int,
        b: int,
        recompute: bool,
        pp: int,
        costs: tuple[cost.UnitCosts, cost.MemoryCosts, float, float],
    ) -> Profile:
        mc = self._mc
        uc, mem, p2p_intra, p2p_inter = costs
        stages = balanced_stages(
            self.model.num_layers, pp, uc.block_seconds, uc.embed_seconds, uc.head_seconds
        )
        kinds: dict[tuple[int, bool, bool], int] = {}
        for s, (lo, hi) in enumerate(stages):
            kinds.setdefault((hi - lo, s == 0, s == pp - 1), s)
        kind_list = tuple((s, n, f, last) for (n, f, last), s in kinds.items())
        slot = max(cost.stage_seconds(uc, n, f, last) for _, n, f, last in kind_list)
        biggest = max(cost.stage_params(mc, n, f, last) for _, n, f, last in kind_list)
        capacity = self.device.memory_bytes
        return Profile(
            pp=pp,
            tp=tp,
            micro_batch=b,
            recompute=recompute,
            stages=stages,
            kinds=kind_list,
            compute_slot=slot,
            p2p_intra=p2p_intra if pp > 1 else 0.0,
            p2p_inter=p2p_inter if pp > 1 else 0.0,
            max_stage_params=biggest,
            optimizer_seconds=cost.optimizer_seconds(self.device, self.params, biggest, tp),
            max_in_flight_fit=largest_fitting_m(mc, mem, kind_list, pp, capacity),
            min_memory_bytes=memory_bytes(mc, mem, kind_list, pp, 1),
            memory=mem,
        )

    # -- one profile on one cluster ---------------------------------------------------------

    def _best_dp(
        self, prof: Profile, shape: Shape, straddle: int, bound: float
    ) -> tuple[float, int, int] | None:
        """(step seconds, d, m_max) minimising the step time, or None if none beats `bound`."""
        n = self.global_batch // prof.micro_batch
        d_hi = min(shape.groups // prof.pp, n)
        fit = prof.max_in_flight_fit
        if fit == 0 or d_hi < 1:
            return None
        d_lo = 1 if fit >= n else -(-n // fit)
        if d_lo > d_hi:
            return None
        dev = self.device
        slot_floor = prof.compute_slot + min(prof.p2p_intra, prof.p2p_inter)
        best: tuple[float, int, int] | None = None
        d = d_hi
        while d >= d_lo:
            m = -(-n // d)
            d = max(d_lo, -(-n // m))  # the fewest replicas that reach this m: cheapest DP
            m = -(-n // d)
            limit = bound if best is None else best[0]
            if slot_floor * (m + prof.pp - 1) + prof.optimizer_seconds > limit:
                break  # larger m only costs more pipeline time than any DP saving
            slot = prof.compute_slot + (prof.p2p_intra if d <= straddle else prof.p2p_inter)
            dp_intra = prof.pp * d <= shape.first_node_groups
            step = (
                slot * (m + prof.pp - 1)
                + cost.dp_seconds(prof.max_stage_params, prof.tp, d, dev, dp_intra)
                + prof.optimizer_seconds
            )
            if step <= limit:  # on a tie the smaller d (fewer GPUs) wins
                best = (step, d, m)
            d -= 1
        return best

    def _choose(
        self,
        shapes: dict[int, Shape],
        top_k: int,
        order: list[tuple[float, Profile]] | None = None,
    ) -> list[Choice]:
        """The best `top_k + 1` choices.

        `order` lists (lower bound of the step time, profile) by ascending bound; without
        it every profile of `shapes` is bounded for this cluster and sorted.
        """
        keep = top_k + 1
        chosen: list[Choice] = []
        if order is None:
            bounded: list[tuple[float, int, int, Profile]] = []
            for tp, shape in shapes.items():
                for i, prof in enumerate(self._profiles_for(tp)):
                    n = self.global_batch // prof.micro_batch
                    d_hi = min(shape.groups // prof.pp, n)
                    if d_hi < 1:
                        continue
                    slot = prof.compute_slot + min(prof.p2p_intra, prof.p2p_inter)
                    lb = slot * (-(-n // d_hi) + prof.pp - 1) + prof.optimizer_seconds
                    bounded.append((lb, tp, i, prof))
            bounded.sort(key=lambda x: x[:3])
            order = [(lb, prof) for lb, _, _, prof in bounded]
        straddles: dict[tuple[int, int], int] = {}
        for lb, prof in order:
            bound = chosen[-1].step_seconds if len(chosen) == keep else math.inf
            if lb > bound:
                break
            shape = shapes[prof.tp]
            key_sp = (prof.tp, prof.pp)
            straddle = straddles.get(key_sp)
            if straddle is None:
                straddle = straddles[key_sp] = shape.straddle_replica(prof.pp)
            found = self._best_dp(prof, shape, straddle, bound)
            if found is None:
                continue
            step, d, m = found
            key = (
                step,
                prof.pp * prof.tp * d,
                prof.pp,
                prof.tp,
                d,
                prof.micro_batch,
                prof.recompute,
            )
            choice = Choice(key=key, profile=prof, dp=d, m_max=m)
            bisect.insort(chosen, choice, key=lambda c: c.key)
            del chosen[keep:]
        return chosen

    # -- building plans ---------------------------------------------------------------------

    def _candidate(self, choice: Choice) -> Candidate:
        prof = choice.profile
        return Candidate(
            layout=Layout(prof.pp, prof.tp, choice.dp),
            micro_batch=prof.micro_batch,
            microbatches=split_batch(self.global_batch, prof.micro_batch, choice.dp),
            stages=prof.stages,
            recompute=prof.recompute,
            est_step_seconds=choice.step_seconds,
            bubble_fraction=cost.bubble_fraction(prof.pp, choice.m_max),
            memory_gib=prof.memory_bytes(self._mc, choice.m_max) / GIB,
        )

    def _build(self, choice: Choice, cluster: ClusterSpec) -> Plan:
        prof = choice.profile
        plan = build_plan(
            self.model,
            cluster,
            Layout(prof.pp, prof.tp, choice.dp),
            global_batch=self.global_batch,
            micro_batch=prof.micro_batch,
            recompute=prof.recompute,
            stages=prof.stages,
        )
        return dataclasses.replace(
            plan,
            est_step_seconds=choice.step_seconds,
            bubble_fraction=cost.bubble_fraction(prof.pp, choice.m_max),
            memory_gib=prof.memory_bytes(self._mc, choice.m_max) / GIB,
        )

    def _nothing_fits(self, shapes: dict[int, Shape], gpus: int) -> PlanError:
        """Why no plan fits: the smallest memory need of any layout the cluster can hold.

        Only on the error path, so it may partition every (p, t) again.
        """
        smallest: tuple[float, Profile] | None = None
        b = self.micro_batches[0]
        for tp, shape in shapes.items():
            for recompute in (False, True):
                costs = self._unit_costs(tp, b, recompute)
                for pp in range(1, min(self.model.num_layers, shape.groups) + 1):
                    prof = self._profile(tp, b, recompute, pp, costs)
                    if smallest is None or prof.min_memory_bytes < smallest[0]:
                        smallest = (prof.min_memory_bytes, prof)
        if smallest is None:
            return PlanError(f"no layout of {self.model.name} fits {gpus} GPUs")
        need, prof = smallest
        return PlanError(
            f"{self.model.name} fits no layout on {gpus} GPUs of {self.device.name}: the "
            f"smallest memory need found is {need / GIB:.1f} GiB per GPU (pp={prof.pp}, "
            f"tp={prof.tp}, micro-batch {prof.micro_batch}, recompute="
            f"{'on' if prof.recompute else 'off'}) vs {self.device.memory_gib:g} GiB capacity"
        )

    # -- public -----------------------------------------------------------------------------

    def plan(self, cluster: ClusterSpec, *, top_k: int = 5) -> PlanResult:
        """The fastest plan for `cluster` and up to `top_k` runner-ups."""
        if cluster.device != self.device:
            raise ConfigError(
                f"cluster device {cluster.device.name!r} is not the planner's {self.device.name!r}"
            )
        if top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {top_k}")
        shapes = {t: Shape.of(cluster, t) for t in self.tp_choices(cluster)}
        chosen = self._choose(shapes, top_k)
        if not chosen:
            raise self._nothing_fits(shapes, cluster.total_gpus)
        chosen = chosen[: top_k + 1]
        return PlanResult(
            best=self._build(chosen[0], cluster),
            candidates=[self._candidate(c) for c in chosen],
            build=lambda i: self._build(chosen[i], cluster),
        )

    def plan_all(self, gpus_per_node: int, min_nodes: int, max_nodes: int) -> PlanTable:
        """The best plan for every uniform cluster of `min_nodes..max_nodes` nodes."""
        for name, value in (
            ("gpus_per_node", gpus_per_node),
            ("min_nodes", min_nodes),
            ("max_nodes", max_nodes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if min_nodes > max_nodes:
            raise ConfigError(f"min_nodes {min_nodes} exceeds max_nodes {max_nodes}")
        probe = ClusterSpec.uniform(1, gpus_per_node, self.device)
        tps = self.tp_choices(probe)
        # The step time of a profile at a given d is the same for every node count (the
        # node boundaries repeat every gpus_per_node // tp groups), so its best time with
        # unlimited nodes is a lower bound for any count: visit profiles in that order.
        huge = {t: Shape.uniform(gpus_per_node, t, max(2, max_nodes)) for t in tps}
        ideal: list[tuple[float, int, int, Profile]] = []
        for t in tps:
            shape = dataclasses.replace(huge[t], groups=NO_LIMIT)
            for i, prof in enumerate(self._profiles_for(t)):
                found = self._best_dp(prof, shape, shape.straddle_replica(prof.pp), math.inf)
                if found is not None:
                    ideal.append((found[0], t, i, prof))
        ideal.sort(key=lambda x: x[:3])
        order = [(lb, prof) for lb, _, _, prof in ideal]
        choices: dict[int, Choice] = {}
        reasons: dict[int, str] = {}
        for nodes in range(min_nodes, max_nodes + 1):
            shapes = {t: Shape.uniform(gpus_per_node, t, nodes) for t in tps}
            chosen = self._choose(shapes, 0, order)
            if chosen:
                choices[nodes] = chosen[0]
            else:
                reasons[nodes] = str(self._nothing_fits(shapes, nodes * gpus_per_node))
        return PlanTable(self, gpus_per_node, choices, reasons)


class PlanTable(Mapping[int, Plan]):
    """Node count -> plan, for the counts where a plan exists; `reason(n)` for the others.

    The layouts are decided when the table is made; a plan's placement (one entry per GPU)
    is built on first lookup and kept, so a table for thousands of node counts stays small.
    """

    def __init__(
        self,
        planner: Planner,
        gpus_per_node: int,
        choices: dict[int, Choice],
        reasons: dict[int, str],
    ) -> None:
        self._planner = planner
        self._gpus_per_node = gpus_per_node
        self._choices = choices
        self._reasons = reasons
        self._built: dict[int, Plan] = {}

    def __getitem__(self, nodes: int) -> Plan:
        plan = self._built.get(nodes)
        if plan is None:
            choice = self._choices[nodes]
            cluster = ClusterSpec.uniform(nodes, self._gpus_per_node, self._planner.device)
            plan = self._built[nodes] = self._planner._build(choice, cluster)
        return plan

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._choices))

    def __len__(self) -> int:
        return len(self._choices)

    def layout(self, nodes: int) -> tuple[Layout, int, bool, float]:
        """(layout, micro-batch, recompute, est. step seconds) without building the plan."""
        c = self._choices[nodes]
        p = c.profile
        return Layout(p.pp, p.tp, c.dp), p.micro_batch, p.recompute, c.step_seconds

    def reason(self, nodes: int) -> str:
        """Why `nodes` nodes have no plan ('' when they have one)."""
        return self._reasons.get(nodes, "")


def plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    *,
    micro_batch: int | None = None,
    top_k: int = 5,
    params: cost.CostParams | None = None,
) -> PlanResult:
    """The fastest plan for `cluster` that fits in memory, and up to `top_k` runner-ups."""
    planner = Planner(model, cluster.device, global_batch, micro_batch=micro_batch, params=params)
    return planner.plan(cluster, top_k=top_k)


def plan_all(
    model: ModelSpec,
    device: DeviceSpec,
    gpus_per_node: int,
    min_nodes: int,
    max_nodes: int,
    global_batch: int,
    micro_batch: int | None = None,
    *,
    params: cost.CostParams | None = None,
) -> PlanTable:
    """The plan for every node count in `[min_nodes, max_nodes]`, decided ahead of time."""
    planner = Planner(model, device, global_batch, micro_batch=micro_batch, params=params)
    return planner.plan_all(gpus_per_node, min_nodes, max_nodes)
