"""The layout planner. Pure Python: imports neither torch nor etcd nor grpc.

`plan(model, cluster, global_batch)` picks the fastest layout for the nodes alive now;
`plan_all(...)` decides one for every node count ahead of time; `Planner` keeps the work
both share for a job. `build_plan` makes a plan for a fixed layout without searching.
"""

from elasticpp.plan.cost import CostParams, Estimate, estimate, estimate_plan
from elasticpp.plan.layout import (
    Coord,
    Layout,
    Plan,
    WorkerSlot,
    build_plan,
    coord_of,
    partition_even,
    place,
    rank_of,
    split_batch,
)
from elasticpp.plan.partition import balanced_stages
from elasticpp.plan.search import (
    MICRO_BATCH_CHOICES,
    Candidate,
    Planner,
    PlanResult,
    PlanTable,
    plan,
    plan_all,
)
from elasticpp.plan.specs import (
    DEVICE_PRESETS,
    MODEL_PRESETS,
    ClusterSpec,
    DeviceSpec,
    ModelSpec,
    NodeSpec,
    load_device_spec,
    load_model_spec,
)

__all__ = [
    "DEVICE_PRESETS",
    "MICRO_BATCH_CHOICES",
    "MODEL_PRESETS",
    "Candidate",
    "ClusterSpec",
    "Coord",
    "CostParams",
    "DeviceSpec",
    "Estimate",
    "Layout",
    "ModelSpec",
    "NodeSpec",
    "Plan",
    "PlanResult",
    "PlanTable",
    "Planner",
    "WorkerSlot",
    "balanced_stages",
    "build_plan",
    "coord_of",
    "estimate",
    "estimate_plan",
    "load_device_spec",
    "load_model_spec",
    "partition_even",
    "place",
    "plan",
    "plan_all",
    "rank_of",
    "split_batch",
]
