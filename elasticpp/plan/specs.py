"""Model, device and cluster specs, with presets. Pure Python; no torch, etcd or grpc.

Specs are frozen dataclasses validated on construction: a bad field raises `ConfigError`
naming the field. Model spec files (YAML or JSON) use the field names of `ModelSpec`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from elasticpp.errors import ConfigError

GIB = 1024**3


def check_fields(source: str, data: object, cls: type) -> None:
    """Refuse a non-mapping, or keys that are not fields of the dataclass `cls`, naming them."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{source}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
        )


def _positive_int(owner: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{owner}: {name} must be a positive integer, got {value!r}")
    return value


def _positive_float(owner: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{owner}: {name} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style decoder-only transformer.

    `num_layers` counts transformer blocks; the embedding belongs to the first pipeline
    stage and the final norm + LM head + loss to the last. `gated_mlp` marks a SwiGLU MLP
    (three matrices, Llama-style) for the cost model; the training engine uses a GELU MLP.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_len: int
    ffn_hidden_size: int = 0  # 0 means 4 * hidden_size
    gated_mlp: bool = False

    def __post_init__(self) -> None:
        owner = f"model {self.name!r}"
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len"):
            _positive_int(owner, name, getattr(self, name))
        if self.ffn_hidden_size == 0:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        _positive_int(owner, "ffn_hidden_size", self.ffn_hidden_size)
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"{owner}: hidden_size {self.hidden_size} is not divisible by "
                f"num_heads {self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def with_seq_len(self, seq_len: int) -> ModelSpec:
        return ModelSpec(**{**asdict(self), "seq_len": seq_len})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "model spec") -> ModelSpec:
        check_fields(source, data, cls)
        required = ["num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len"]
        missing = [k for k in required if k not in data]
        if missing:
            raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")
        values = dict(data)
        values.setdefault("name", Path(source).stem if source != "model spec" else "custom")
        values.setdefault("ffn_hidden_size", 0)
        return cls(**values)


MODEL_PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # The models the tests and the demo train on CPU.
        ModelSpec("tiny", num_layers=8, hidden_size=64, num_heads=4, vocab_size=256, seq_len=32),
        ModelSpec("small", num_layers=12, hidden_size=128, num_heads=8, vocab_size=256, seq_len=64),
        # GPT-3 family (Brown et al. 2020, table 2.1); vocabulary padded to 51200.
        ModelSpec("gpt-1.3b", 24, 2048, 16, 51200, 2048),
        ModelSpec("gpt-2.7b", 32, 2560, 32, 51200, 2048),
        ModelSpec("gpt-6.7b", 32, 4096, 32, 51200, 2048),
        ModelSpec("gpt-13b", 40, 5120, 40, 51200, 2048),
        ModelSpec("gpt-175b", 96, 12288, 96, 51200, 2048),
        # Llama-style (SwiGLU MLP). 70B's grouped-query attention is costed as full MHA.
        ModelSpec("llama-7b", 32, 4096, 32, 32000, 4096, ffn_hidden_size=11008, gated_mlp=True),
        ModelSpec("llama-13b", 40, 5120, 40, 32000, 4096, ffn_hidden_size=13824, gated_mlp=True),
        ModelSpec("llama-70b", 80, 8192, 64, 32000, 4096, ffn_hidden_size=28672, gated_mlp=True),
    )
}


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A preset name, or the path of a YAML/JSON file with `ModelSpec`'s fields."""
    if name_or_path in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(
            f"unknown model {name_or_path!r}: not a preset ({', '.join(MODEL_PRESETS)}) "
            "and not a spec file"
        )
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"model spec {path}: cannot parse: {exc}") from exc
    return ModelSpec.from_dict(data, source=str(path))


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: memory, peak dense bf16 speed, and the links around it.

    Bandwidths are per GPU, one direction, in GB/s (1e9 bytes): `intra_node_gbps` for
    NVLink-class links inside a node, `inter_node_gbps` for the network between nodes,
    `hbm_gbps` for the GPU's own memory (it bounds the memory-bound optimizer step).
    Latencies are the fixed cost of one message (one hop of a ring all-reduce, one p2p
    send) in microseconds, whatever its size: `intra_node_latency_us` inside a node,
    `inter_node_latency_us` across the network. The GPU defaults are NCCL's order of
    magnitude (a few microseconds over NVLink, tens over InfiniBand); on CPU with gloo a
    message costs hundreds of microseconds, which is what makes tensor parallelism lose there.
    """

    name: str
    memory_gib: float
    peak_tflops: float
    intra_node_gbps: float
    inter_node_gbps: float
    hbm_gbps: float = 2000.0
    intra_node_latency_us: float = 8.0
    inter_node_latency_us: float = 25.0

    def __post_init__(self) -> None:
        owner = f"device {self.name!r}"
        for name in (
            "memory_gib",
            "peak_tflops",
            "intra_node_gbps",
            "inter_node_gbps",
            "hbm_gbps",
        ):
            _positive_float(owner, name, getattr(self, name))
        for name in ("intra_node_latency_us", "inter_node_latency_us"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 <= value < math.inf
            ):
                raise ConfigError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def intra_node_latency_s(self) -> float:
        return self.intra_node_latency_us * 1e-6

    @property
    def inter_node_latency_s(self) -> float:
        return self.inter_node_latency_us * 1e-6


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec("a100-40g", 40, 312, 300, 25, hbm_gbps=1555),
        DeviceSpec("a100-80g", 80, 312, 300, 25, hbm_gbps=2039),
        DeviceSpec("h100-80g", 80, 989, 450, 50, hbm_gbps=3350),
        DeviceSpec("h200", 141, 989, 450, 50, hbm_gbps=4800),
        # A CPU "device" for local runs: a slot is a worker process with one torch thread,
        # talking gloo over loopback. Rounded from bench/calibrate_cpu.py on a 2-core machine
        # busy with other jobs (docs/plan.md has the numbers): the tiny model's block
        # reaches ~15 GFLOP/s at b=2, i.e. peak * eff(2) with peak 0.03 TFLOP/s (per-op
        # overhead, not FLOPs, dominates such small matrices); gloo moves ~1 GB/s; a message
        # costs ~100-150 us in a small all-reduce between two processes (a blocking p2p
        # ping-pong often ~2 ms: the receiver sleeps) and 300-400 us with 8 workers on 2
        # cores, as the tests and the demo run. Local "nodes" share one loopback, hence
        # intra-node = inter-node.
        DeviceSpec(
            "cpu",
            8,
            0.03,
            1,
            1,
            hbm_gbps=20,
            intra_node_latency_us=300,
            inter_node_latency_us=300,
        ),
    )
}


def load_device_spec(name: str) -> DeviceSpec:
    try:
        return DEVICE_PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown device {name!r}; presets: {', '.join(DEVICE_PRESETS)}"
        ) from None


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    gpus: int

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ConfigError("node: node_id must be a non-empty string")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 0:
            raise ConfigError(f"node {self.node_id!r}: gpus must be >= 0, got {self.gpus!r}")


@dataclass(frozen=True)
class ClusterSpec:
    """The nodes alive now, each with its count of healthy GPUs (nodes may differ)."""

    nodes: tuple[NodeSpec, ...]
    device: DeviceSpec
    _ids: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ConfigError("cluster: needs at least one node")
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"cluster: duplicate node ids in {ids}")
        if self.total_gpus == 0:
            raise ConfigError("cluster: no healthy GPU on any node")
        object.__setattr__(self, "_ids", frozenset(ids))

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @property
    def max_gpus_per_node(self) -> int:
        return max(n.gpus for n in self.nodes)

    @classmethod
    def uniform(cls, num_nodes: int, gpus_per_node: int, device: DeviceSpec) -> ClusterSpec:
        _positive_int("cluster", "nodes", num_nodes)
        _positive_int("cluster", "gpus_per_node", gpus_per_node)
        width = len(str(num_nodes - 1))
        return cls(
            tuple(NodeSpec(f"node-{i:0{width}d}", gpus_per_node) for i in range(num_nodes)),
            device,
        )
