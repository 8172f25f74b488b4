"""Model, device and cluster specs, with presets. Pure Python; no torch, etcd or grpc.

Specs are frozen dataclasses validated on construction: a bad field raises `ConfigError`
naming the field. Model spec files (YAML or JSON) use the field names of `ModelSpec`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from elasticpp.errors import ConfigError
from elasticpp.names import parse_name

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


FAMILIES = ("gpt", "llama")
UNIT_EMBED = "embed"
UNIT_HEAD = "head"
# JSON scalars a family option may hold (options travel in plans and job specs as JSON).
OptionValue = bool | int | float | str | None


def block_unit(index: int) -> str:
    """The name of block `index` in the built-in families (and in version-1 checkpoints)."""
    return f"block.{index:04d}"


def default_units(num_layers: int) -> tuple[str, ...]:
    return (UNIT_EMBED, *(block_unit(i) for i in range(num_layers)), UNIT_HEAD)


@dataclass(frozen=True)
class ModelNumbers:
    """What the planner needs of a model it cannot compute from the shape fields: the numbers
    a model declaration (`elasticpp.train.model.contract`) gives, handed over as plain numbers.

    Parameter counts are whole-model (before tensor parallelism); FLOPs are forward FLOPs
    per token; `boundary_values_per_token` is what one token sends across a stage boundary;
    `tp_divisors` are sizes every tensor-parallel width must divide (heads, split dims).
    Blocks may differ; the planner balances stages with the mean block.
    """

    first_params: int
    block_params: int  # mean over the blocks, rounded up
    last_params: int
    block_flops_per_token: float
    last_flops_per_token: float
    boundary_values_per_token: int
    tp_divisors: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        owner = "model numbers"
        for name in ("first_params", "block_params", "last_params"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{owner}: {name} must be an integer >= 0, got {v!r}")
        for name in ("block_flops_per_token", "last_flops_per_token"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ConfigError(f"{owner}: {name} must be a finite number >= 0, got {v!r}")
        _positive_int(owner, "boundary_values_per_token", self.boundary_values_per_token)
        divisors = tuple(self.tp_divisors)
        for d in divisors:
            _positive_int(owner, "tp_divisors", d)
        object.__setattr__(self, "tp_divisors", divisors)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tp_divisors"] = list(self.tp_divisors)
        return data


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-style model as the planner, the checkpoint and the workers see it.

    `num_layers` counts the repeated blocks the planner partitions into stages; the units
    before them (`first_units` of them: the embedding) belong to the first pipeline stage,
    the units after them (`last_units`: final norm, LM head, loss) to the last. `family` says
    which model definition trains it: a built-in family (`gpt`, `llama`) or a user's
    `package.module:function` (docs/train.md, "The model contract"); `options` are that
    family's settings (JSON scalars), opaque to the planner except the `llama` family's that
    change its sizes (`head_dim`, `qkv_bias`, `o_bias`, `qk_norm`). `units` names every unit in
    model order; empty means the built-in names `embed`, `block.NNNN`, `head`. `numbers`,
    when given, replaces the cost model's shape-based parameter and FLOP counts.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_len: int
    ffn_hidden_size: int = 0  # 0 means 4 * hidden_size
    gated_mlp: bool = False  # SwiGLU MLP (three matrices); always true for llama
    num_kv_heads: int = 0  # grouped-query attention; 0 means num_heads
    family: str = "gpt"
    options: tuple[tuple[str, OptionValue], ...] = ()
    units: tuple[str, ...] = ()
    first_units: int = 1
    last_units: int = 1
    numbers: ModelNumbers | None = None

    def __post_init__(self) -> None:
        owner = f"model {self.name!r}"
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len"):
            _positive_int(owner, name, getattr(self, name))
        if self.ffn_hidden_size == 0:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        _positive_int(owner, "ffn_hidden_size", self.ffn_hidden_size)
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        _positive_int(owner, "num_kv_heads", self.num_kv_heads)
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"{owner}: hidden_size {self.hidden_size} is not divisible by "
                f"num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{owner}: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if not isinstance(self.family, str) or not (
            self.family in FAMILIES or _ENTRY_RE.fullmatch(self.family)
        ):
            raise ConfigError(
                f"{owner}: family must be one of {', '.join(FAMILIES)} or "
                f"'package.module:function', got {self.family!r}"
            )
        if self.family == "llama":
            object.__setattr__(self, "gated_mlp", True)
        options = self.options.items() if isinstance(self.options, dict) else self.options
        checked: list[tuple[str, OptionValue]] = []
        for item in options:
            key, value = item
            if not isinstance(key, str) or not isinstance(
                value, (bool, int, float, str, type(None))
            ):
                raise ConfigError(f"{owner}: option {key!r} must be a JSON scalar, got {value!r}")
            checked.append((key, value))
        object.__setattr__(self, "options", tuple(sorted(checked)))
        if self.family == "llama" and "head_dim" in self.option_map:
            _positive_int(owner, "option head_dim", self.option_map["head_dim"])
        for name in ("first_units", "last_units"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{owner}: {name} must be an integer >= 0, got {v!r}")
        if not self.units:
            if (self.first_units, self.last_units) != (1, 1):
                raise ConfigError(f"{owner}: units must be named when first/last_units != 1")
            object.__setattr__(self, "units", default_units(self.num_layers))
        units = tuple(parse_name(u, what=f"{owner}: unit") for u in self.units)
        if len(units) != self.first_units + self.num_layers + self.last_units:
            raise ConfigError(
                f"{owner}: {len(units)} unit names for {self.first_units} first unit(s), "
                f"{self.num_layers} blocks and {self.last_units} last unit(s)"
            )
        if len(set(units)) != len(units):
            raise ConfigError(f"{owner}: unit names are not unique")
        object.__setattr__(self, "units", units)
        if self.numbers is not None and not isinstance(self.numbers, ModelNumbers):
            raise ConfigError(f"{owner}: numbers must be ModelNumbers")

    @property
    def head_dim(self) -> int:
        """The width of one attention head: the `llama` family's `head_dim` option where the
        model declares one (Qwen3 and some Mistral models choose their own), else
        hidden_size / num_heads."""
        declared = self.option_map.get("head_dim") if self.family == "llama" else None
        if isinstance(declared, int) and not isinstance(declared, bool):
            return declared
        return self.hidden_size // self.num_heads

    @property
    def option_map(self) -> dict[str, OptionValue]:
        return dict(self.options)

    @property
    def tp_divisors(self) -> tuple[int, ...]:
        """Sizes a tensor-parallel width must divide."""
        if self.numbers is not None:
            return self.numbers.tp_divisors
        return (self.num_heads, self.num_kv_heads)

    def tp_fits(self, tp: int) -> bool:
        return all(d % tp == 0 for d in self.tp_divisors)

    def stage_units(self, stages: tuple[tuple[int, int], ...], stage: int) -> tuple[str, ...]:
        """The units pipeline stage `stage` of a plan with these block ranges holds."""
        first, end = stages[stage]
        f = self.first_units
        units = list(self.units[f + first : f + end])
        if stage == 0:
            units = list(self.units[:f]) + units
        if stage == len(stages) - 1:
            units += self.units[f + self.num_layers :]
        return tuple(units)

    def with_seq_len(self, seq_len: int) -> ModelSpec:
        return replace(self, seq_len=seq_len)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["options"] = dict(self.options)
        data["units"] = list(self.units)
        data["numbers"] = None if self.numbers is None else self.numbers.to_dict()
        return data

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
        options = values.get("options", {})
        if not isinstance(options, dict):
            raise ConfigError(f"{source}: options must be a mapping")
        values["options"] = tuple(options.items())
        if not isinstance(values.get("units", []), (list, tuple)):
            raise ConfigError(f"{source}: units must be a list of names")
        values["units"] = tuple(values.get("units", ()))
        numbers = values.get("numbers")
        if numbers is not None:
            check_fields(f"{source}.numbers", numbers, ModelNumbers)
            try:
                values["numbers"] = ModelNumbers(**numbers)
            except TypeError as exc:
                raise ConfigError(f"{source}.numbers: {exc}") from exc
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"{source}: {exc}") from exc


_ENTRY_RE = re.compile(
    r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
)


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
        # Llama family: RMSNorm, rotary positions, SwiGLU MLP; 70B uses grouped-query
        # attention with 8 key/value heads. Sizes from the Llama 2 paper's configurations.
        ModelSpec("llama-7b", 32, 4096, 32, 32000, 4096, 11008, family="llama"),
        ModelSpec("llama-13b", 40, 5120, 40, 32000, 4096, 13824, family="llama"),
        ModelSpec("llama-70b", 80, 8192, 64, 32000, 4096, 28672, num_kv_heads=8, family="llama"),
        # A Llama the tests and the demo can train on CPU (GQA: 4 query heads, 2 kv heads).
        ModelSpec("llama-tiny", 4, 64, 4, 256, 32, 128, num_kv_heads=2, family="llama"),
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


def gpu_preset(gpu_name: str, memory_gib: float) -> str | None:
    """The device preset for a GPU as CUDA names it (`torch.cuda.get_device_name`) with its
    memory, or None where no preset models it (then a job spec gives a custom device)."""
    name = gpu_name.upper()
    if "H200" in name:
        return "h200"
    if "H100" in name:
        return "h100-80g" if memory_gib >= 70 else None
    if "A100" in name:
        return "a100-80g" if memory_gib >= 60 else "a100-40g"
    return None


def gpu_device_model(gpu_name: str, memory_gib: float) -> str | dict[str, float]:
    """A job spec's `device` for a GPU as CUDA names it: its preset (`gpu_preset`), else
    figures from its memory with a guess at the rest (100 TFLOP/s, 100 GB/s in a node,
    10 GB/s between nodes): give the real ones for plans that should be right."""
    preset = gpu_preset(gpu_name, memory_gib)
    if preset is not None:
        return preset
    return {
        "memory_gib": round(memory_gib, 1),
        "peak_tflops": 100.0,
        "intra_node_gbps": 100.0,
        "inter_node_gbps": 10.0,
    }


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
