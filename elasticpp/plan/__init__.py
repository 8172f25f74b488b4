"""The layout planner. Pure Python: imports neither torch nor etcd nor grpc."""

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
    "MODEL_PRESETS",
    "ClusterSpec",
    "Coord",
    "DeviceSpec",
    "Layout",
    "ModelSpec",
    "NodeSpec",
    "Plan",
    "WorkerSlot",
    "build_plan",
    "coord_of",
    "load_device_spec",
    "load_model_spec",
    "partition_even",
    "place",
    "rank_of",
    "split_batch",
]
