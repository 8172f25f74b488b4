"""The planner's cost and memory model. Pure arithmetic on specs; no torch.

Everything here is an estimate meant to *rank* layouts, not to predict a step to the
millisecond. The assumptions, all per GPU and per micro-batch of `b` samples of `s` tokens:

Compute
    forward FLOPs of a block = 2 * block_params * b*s + 4 * b * s^2 * q (attention scores
    and their use, where q = num_heads * head_dim is the attention width: h unless the model
    declares another head_dim, as Qwen3 does); the LM head = 2 * h * V * b*s. Backward is
    twice the forward; full recomputation adds one more forward of every block (not of the
    head). Tensor parallelism divides the FLOPs by `t`. Time = FLOPs / (peak * eff(b)) with
    eff(b) = max_efficiency * b / (b + half_efficiency_micro_batch): a saturating curve whose
    default (0.3) gives eff(large b) / eff(1) ~ 1.3, the gain Megatron-LM measured.
Messages
    every message pays the link's latency (`DeviceSpec.intra_node_latency_us` or
    `inter_node_latency_us`) besides its bytes / bandwidth. A ring all-reduce over r ranks
    is 2(r-1) messages in sequence: 2(r-1) * latency + 2(r-1)/r * bytes / bandwidth; a p2p
    transfer is one: latency + bytes / bandwidth. On GPUs the latency matters only for
    small messages; on CPU with gloo (hundreds of microseconds a message) it dominates, and
    is why tensor parallelism, with its many small all-reduces, loses there.
Tensor parallelism
    two all-reduces of b*s*h bf16 values per block per pass (forward, backward, and the
    recomputed forward), one for the vocabulary-parallel embedding; ring all-reduces over
    the t ranks on the intra-node link.
Pipeline
    1F1B with a flush. A step takes (m_max + p - 1) slots; a slot is the slowest stage's
    forward + backward of one micro-batch plus the two boundary transfers (b*s*h bf16 values
    forward, the same backward; one message each), on the intra-node link when every replica
    sits inside one node and on the network otherwise. m_max is the largest per-replica
    micro-batch count: with an uneven split the slowest replica sets the pace.
    Bubble = (p-1)/(m_max+p-1).
Data parallelism
    a ring all-reduce of the largest stage's bf16 gradients over the d replicas (one
    bucket: 2(d-1) latencies + 2(d-1)/d * bytes / bandwidth), on the network unless the
    whole layout sits in one node; not overlapped with the backward pass (a pessimistic
    choice that penalises large d a little).
Optimizer
    memory-bound AdamW: the 16 bytes of state per parameter are read and written once
    (32 bytes of HBM traffic per parameter of the largest stage).
Memory
    mixed-precision state of 16 bytes per parameter (bf16 weights and gradients, fp32
    master weights and two moments) of the stage's blocks, the embedding on the first
    stage and the LM head on the last, divided by `t`; activations per block per
    micro-batch in flight of s*b*(10h + (16h + 8q)/t + 5*a*s/t) bytes (Korthikanti et al.,
    tensor parallel without sequence parallelism: s*b*h*(34 + 5as/h) at t=1 and q = h; the
    8q are Q, K, V and the attention output, all q wide once K and V are repeated for
    grouped-query attention) or, with full recomputation, the block input (2*s*b*h bytes)
    plus one block's full activations while it is recomputed; 1F1B keeps min(p - stage, m)
    micro-batches in flight on a stage; the last stage also holds one micro-batch's logits
    and their gradient (8*b*s*V/t bytes);
    plus a fixed workspace (CUDA context, communication buffers, fragmentation).
    The largest stage decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elasticpp.errors import ConfigError
from elasticpp.plan.flops import forward_flops
from elasticpp.plan.layout import Plan
from elasticpp.plan.specs import GIB, DeviceSpec, ModelSpec

BF16_BYTES = 2


@dataclass(frozen=True)
class CostParams:
    """The model's tunable constants; the defaults are documented in the module docstring."""

    max_efficiency: float = 0.6
    half_efficiency_micro_batch: float = 0.3
    workspace_gib: float = 2.0
    state_bytes_per_param: float = 16.0
    optimizer_traffic_bytes_per_param: float = 32.0
    logits_bytes_per_value: float = 8.0

    def __post_init__(self) -> None:
        if not 0 < self.max_efficiency <= 1:
            raise ConfigError(f"cost: max_efficiency must be in (0, 1], got {self.max_efficiency}")
        for name in (
            "half_efficiency_micro_batch",
            "workspace_gib",
            "state_bytes_per_param",
            "optimizer_traffic_bytes_per_param",
            "logits_bytes_per_value",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"cost: {name} must be >= 0")

    def efficiency(self, micro_batch: int) -> float:
        return self.max_efficiency * micro_batch / (micro_batch + self.half_efficiency_micro_batch)


@dataclass(frozen=True)
class ModelCosts:
    """Per-model constants of the cost model, computed once per model."""

    block_params: int
    embed_params: int
    head_params: int
    block_fwd_flops_per_sample: float
    head_fwd_flops_per_sample: float
    hidden_values_per_sample: int  # s*h: one boundary activation, one TP all-reduce
    seq_len: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    attention_width: int  # num_heads * head_dim: Q's width and the attention output's

    @classmethod
    def of(cls, model: ModelSpec) -> ModelCosts:
        h, f, s, v = model.hidden_size, model.ffn_hidden_size, model.seq_len, model.vocab_size
        n = model.numbers
        if n is not None:
            # A declared model: its own counts (elasticpp.train.model.contract.model_numbers).
            return cls(
                block_params=n.block_params,
                embed_params=n.first_params,
                head_params=n.last_params,
                block_fwd_flops_per_sample=n.block_flops_per_token * s,
                head_fwd_flops_per_sample=n.last_flops_per_token * s,
                hidden_values_per_sample=n.boundary_values_per_token * s,
                seq_len=s,
                hidden_size=h,
                num_heads=model.num_heads,
                vocab_size=v,
                attention_width=h,  # not declared: the hidden size stands in
            )
        q = model.num_heads * model.head_dim  # h unless the model declares its head_dim
        kv = model.num_kv_heads * model.head_dim  # grouped-query attention: narrower K and V
        mlp_mats = 3 if model.gated_mlp else 2
        matmul_params = 2 * h * q + 2 * h * kv + mlp_mats * h * f
        flops = forward_flops(model, attention_computed=1.0)
        if model.family == "llama":
            # two RMSNorm weights; rotary positions (no position embedding); the biases and
            # per-head q/k norms that Qwen2 and Qwen3 add (elasticpp.train.model.families.llama)
            opts = model.option_map
            block_params = matmul_params + 2 * h
            block_params += q + 2 * kv if opts.get("qkv_bias") is True else 0
            block_params += h if opts.get("o_bias") is True else 0
            block_params += 2 * model.head_dim if opts.get("qk_norm") is True else 0
            embed_params = v * h
            head_params = v * h + h
        else:
            # biases (q, k, v, proj, fc1, fc2) and the two layer norms: small, but real
            block_params = matmul_params + 2 * h + 2 * kv + f + h + 4 * h
            embed_params = v * h + s * h
            head_params = v * h + 2 * h
        return cls(
            block_params=block_params,
            embed_params=embed_params,
            head_params=head_params,
            # The count MFU uses (elasticpp.plan.flops), with attention's masked half included:
            # the efficiency curve (docs/plan.md) was calibrated on that count.
            block_fwd_flops_per_sample=flops.block * s,
            head_fwd_flops_per_sample=flops.last * s,
            hidden_values_per_sample=s * h,
            seq_len=s,
            hidden_size=h,
            num_heads=model.num_heads,
            vocab_size=v,
            attention_width=q,
        )


def total_params(model: ModelSpec) -> int:
    mc = ModelCosts.of(model)
    return model.num_layers * mc.block_params + mc.embed_params + mc.head_params


def ring_allreduce_seconds(nbytes: float, ranks: int, gbps: float, latency_s: float = 0.0) -> float:
    """A ring all-reduce: 2(r-1) messages in sequence, each of bytes / r."""
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) * latency_s + 2.0 * (ranks - 1) / ranks * nbytes / (gbps * 1e9)


def link(device: DeviceSpec, intra: bool) -> tuple[float, float]:
    """(GB/s, seconds of latency per message) of the intra-node link or the network."""
    if intra:
        return device.intra_node_gbps, device.intra_node_latency_s
    return device.inter_node_gbps, device.inter_node_latency_s


@dataclass(frozen=True)
class UnitCosts:
    """Seconds per micro-batch of one block / the embedding / the head, for one (b, t, rc)."""

    block_seconds: float
    embed_seconds: float
    head_seconds: float
    boundary_bytes: float  # one p2p transfer of the boundary activation


def unit_costs(
    mc: ModelCosts,
    device: DeviceSpec,
    params: CostParams,
    micro_batch: int,
    tp: int,
    recompute: bool,
) -> UnitCosts:
    flops_per_s = device.peak_tflops * 1e12 * params.efficiency(micro_batch) * tp
    passes = 4.0 if recompute else 3.0  # fwd + 2x bwd (+ recomputed fwd)
    allreduces = 6 if recompute else 4
    act_bytes = float(BF16_BYTES * mc.hidden_values_per_sample * micro_batch)
    ar = ring_allreduce_seconds(act_bytes, tp, *link(device, True))
    block = passes * mc.block_fwd_flops_per_sample * micro_batch / flops_per_s + allreduces * ar
    head = 3.0 * mc.head_fwd_flops_per_sample * micro_batch / flops_per_s
    return UnitCosts(
        block_seconds=block, embed_seconds=ar, head_seconds=head, boundary_bytes=act_bytes
    )


def stage_seconds(uc: UnitCosts, blocks: int, first: bool, last: bool) -> float:
    """Forward + backward of one micro-batch on one stage (no p2p)."""
    t = blocks * uc.block_seconds
    if first:
        t += uc.embed_seconds
    if last:
        t += uc.head_seconds
    return t


def stage_params(mc: ModelCosts, blocks: int, first: bool, last: bool) -> int:
    n = blocks * mc.block_params
    if first:
        n += mc.embed_params
    if last:
        n += mc.head_params
    return n


@dataclass(frozen=True)
class MemoryCosts:
    """Bytes per GPU for one (b, t, rc): the parts of a stage's memory estimate."""

    state_bytes_per_param: float  # already divided by t
    block_act_bytes: float  # per block per micro-batch in flight
    working_bytes: float  # once per stage: a recomputed block's full activations
    logits_bytes: float  # last stage only
    workspace_bytes: float


def memory_costs(
    mc: ModelCosts, params: CostParams, micro_batch: int, tp: int, recompute: bool
) -> MemoryCosts:
    s, h, a, q = mc.seq_len, mc.hidden_size, mc.num_heads, mc.attention_width
    sb = float(s * micro_batch)
    sbh = sb * h
    full = sb * (10.0 * h + (16.0 * h + 8.0 * q) / tp + 5.0 * a * s / tp)
    return MemoryCosts(
        state_bytes_per_param=params.state_bytes_per_param / tp,
        block_act_bytes=BF16_BYTES * sbh if recompute else full,
        working_bytes=full if recompute else 0.0,
        logits_bytes=params.logits_bytes_per_value * micro_batch * s * mc.vocab_size / tp,
        workspace_bytes=params.workspace_gib * GIB,
    )


def stage_memory_bytes(
    mc: ModelCosts, mem: MemoryCosts, blocks: int, first: bool, last: bool, in_flight: int
) -> float:
    total = stage_params(mc, blocks, first, last) * mem.state_bytes_per_param
    total += in_flight * blocks * mem.block_act_bytes + mem.working_bytes + mem.workspace_bytes
    if last:
        total += mem.logits_bytes
    return total


def bubble_fraction(pp: int, microbatches: int) -> float:
    return (pp - 1) / (microbatches + pp - 1)


def dp_seconds(max_stage_params: int, tp: int, dp: int, device: DeviceSpec, intra: bool) -> float:
    """The gradient all-reduce across the d replicas, on NVLink or the network."""
    return ring_allreduce_seconds(BF16_BYTES * max_stage_params / tp, dp, *link(device, intra))


def optimizer_seconds(
    device: DeviceSpec, params: CostParams, max_stage_params: int, tp: int
) -> float:
    traffic = params.optimizer_traffic_bytes_per_param * max_stage_params / tp
    return traffic / (device.hbm_gbps * 1e9)


@dataclass(frozen=True)
class Estimate:
    step_seconds: float
    pipeline_seconds: float
    dp_seconds: float
    optimizer_seconds: float
    bubble_fraction: float
    stage_memory_bytes: tuple[float, ...]

    @property
    def memory_bytes(self) -> float:
        return max(self.stage_memory_bytes)

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


def estimate(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    pp: int,
    tp: int,
    dp: int,
    micro_batch: int,
    microbatches: Sequence[int],
    stages: Sequence[tuple[int, int]],
    recompute: bool,
    p2p_intra: bool,
    dp_intra: bool,
    params: CostParams | None = None,
) -> Estimate:
    """The step time and per-stage memory of one layout, stage by stage."""
    cp = params or CostParams()
    mc = ModelCosts.of(model)
    uc = unit_costs(mc, device, cp, micro_batch, tp, recompute)
    mem = memory_costs(mc, cp, micro_batch, tp, recompute)
    m_max = max(microbatches)
    slowest = 0.0
    biggest = 0
    memory = []
    for s, (first_block, end_block) in enumerate(stages):
        blocks, first, last = end_block - first_block, s == 0, s == pp - 1
        slowest = max(slowest, stage_seconds(uc, blocks, first, last))
        biggest = max(biggest, stage_params(mc, blocks, first, last))
        memory.append(stage_memory_bytes(mc, mem, blocks, first, last, min(pp - s, m_max)))
    slot = slowest + (2.0 * p2p_seconds(uc, device, p2p_intra) if pp > 1 else 0.0)
    pipeline = slot * (m_max + pp - 1)
    dp_s = dp_seconds(biggest, tp, dp, device, dp_intra)
    opt = optimizer_seconds(device, cp, biggest, tp)
    return Estimate(
        step_seconds=pipeline + dp_s + opt,
        pipeline_seconds=pipeline,
        dp_seconds=dp_s,
        optimizer_seconds=opt,
        bubble_fraction=bubble_fraction(pp, m_max),
        stage_memory_bytes=tuple(memory),
    )


def p2p_seconds(uc: UnitCosts, device: DeviceSpec, intra: bool) -> float:
    """One boundary transfer: one message."""
    gbps, latency_s = link(device, intra)
    return latency_s + uc.boundary_bytes / (gbps * 1e9)


def estimate_plan(plan: Plan, device: DeviceSpec, params: CostParams | None = None) -> Estimate:
    """`estimate` for a built plan; which links carry p2p and DP comes from its placement."""
    L = plan.layout
    replica_nodes: dict[int, set[str]] = {}
    for slot in plan.placement:
        replica_nodes.setdefault(slot.coord.dp, set()).add(slot.node_id)
    p2p_intra = all(len(nodes) == 1 for nodes in replica_nodes.values())
    dp_intra = len({slot.node_id for slot in plan.placement}) == 1
    return estimate(
        plan.model,
        device,
        pp=L.pp,
        tp=L.tp,
        dp=L.dp,
        micro_batch=plan.micro_batch,
        microbatches=plan.microbatches,
        stages=plan.stages,
        recompute=plan.recompute,
        p2p_intra=p2p_intra,
        dp_intra=dp_intra,
        params=params,
    )
