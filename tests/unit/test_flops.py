"""Model FLOPs (elasticpp.plan.flops) against torch's own counter, and the peak table.

The oracle is `torch.utils.flop_counter.FlopCounterMode` over a forward and backward of a
small model of each built-in family, fp32 on CPU. It counts matmuls only (mm, addmm, bmm, the
fused attention ops it knows), as the model-FLOPs rule does, so elementwise work is left out
on both sides. Its known difference: causal attention. Under the math kernel (whose `bmm`s it
sees) it counts the whole `s x s` score matrix; elasticpp's path is a fused kernel that skips
the masked half, and counts half."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from elasticpp.plan import ClusterSpec, Layout, NodeSpec, build_plan, load_device_spec
from elasticpp.plan.flops import (
    CAUSAL_ATTENTION_COMPUTED,
    device_peak_tflops,
    forward_flops,
    node_step_flops,
    rank_step_flops,
    slot_peak,
    step_flops,
)
from elasticpp.plan.specs import ModelSpec
from elasticpp.train.model.contract import init_unit
from elasticpp.train.model.families import build_model
from elasticpp.train.model.stage import Stage

SEQ, BATCH = 64, 3
SPECS = {
    "gpt": ModelSpec(
        "g", num_layers=2, hidden_size=64, num_heads=4, vocab_size=256, seq_len=SEQ,
        ffn_hidden_size=96, family="gpt",
    ),
    # grouped-query attention and a head_dim other than hidden / heads (Qwen3's shape)
    "llama": ModelSpec(
        "l", num_layers=2, hidden_size=64, num_heads=4, vocab_size=256, seq_len=SEQ,
        ffn_hidden_size=96, num_kv_heads=2, family="llama", options=(("head_dim", 32),),
    ),
    "llama-tied": ModelSpec(
        "t", num_layers=3, hidden_size=64, num_heads=4, vocab_size=300, seq_len=SEQ,
        ffn_hidden_size=128, family="llama", options=(("tie_embeddings", True),),
    ),
}  # fmt: skip


def _counted(spec: ModelSpec, kernel: SDPBackend | None) -> dict[str, int]:
    """FlopCounterMode's counts by op of one forward and backward of `spec`, whole, on CPU."""
    torch.manual_seed(0)
    model = build_model(spec)
    stage = Stage.for_stage(model, spec, ((0, spec.num_layers),), 0)
    params: dict[str, dict[str, torch.Tensor]] = {}
    for unit in model.units:
        params[unit.name] = {k: t.requires_grad_() for k, t in init_unit(unit, 0, 0, 1).items()}
    tied = model.unit("head").param("lm_head.weight").tied_to
    if tied is not None:  # the engine hands the head the embedding's tensor itself
        params["head"]["lm_head.weight"] = params["embed"]["tok.weight"]
    tokens = torch.randint(0, spec.vocab_size, (BATCH, SEQ))
    targets = torch.randint(0, spec.vocab_size, (BATCH, SEQ))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(kernel) if kernel is not None else torch.enable_grad(), counter:
        stage.forward(params, tokens, 0, 1, None, None, targets).backward()
    return {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sorted(SPECS))
def test_the_count_agrees_with_torchs_flop_counter(family: str) -> None:
    spec = SPECS[family]
    math_kernel = _counted(spec, SDPBackend.MATH)
    dense = math_kernel.get("aten.mm", 0) + math_kernel.get("aten.addmm", 0)
    attention_whole = math_kernel["aten.bmm"]  # scores and values, the masked half included
    f = forward_flops(spec)
    tokens = BATCH * SEQ
    ours_dense = 3 * tokens * (spec.num_layers * f.block_matmul + f.last)
    ours_attention = 3 * tokens * spec.num_layers * f.block_attention
    # The weight matrices (LM head included, embedding lookups not): exactly the counter's.
    assert ours_dense == pytest.approx(dense, rel=1e-9)
    # Attention as the fused kernel computes it: half the math kernel's s x s.
    assert ours_attention == pytest.approx(CAUSAL_ATTENTION_COMPUTED * attention_whole, rel=1e-9)
    reference = dense + CAUSAL_ATTENTION_COMPUTED * attention_whole
    ours = step_flops(spec, BATCH)
    assert ours == pytest.approx(reference, rel=0.02)
    assert ours == pytest.approx(ours_dense + ours_attention)
    # Against the counter's raw total (the masked half counted) the difference is that half.
    raw = sum(math_kernel.values())
    assert raw - ours == pytest.approx((1 - CAUSAL_ATTENTION_COMPUTED) * attention_whole)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_elasticpps_attention_runs_a_fused_kernel_not_the_math_one(family: str) -> None:
    """The reason causal attention counts half: without a kernel forced, no bmm runs (the
    math kernel's), the same matmuls as under it do."""
    spec = SPECS[family]
    default = _counted(spec, None)
    forced = _counted(spec, SDPBackend.MATH)
    assert "aten.bmm" not in default
    assert {k: v for k, v in forced.items() if k != "aten.bmm"} == {
        k: v for k, v in default.items() if "attention" not in k
    }


def test_the_planner_and_the_families_count_attention_whole() -> None:
    for spec in SPECS.values():
        model = build_model(spec)
        whole = forward_flops(spec, attention_computed=1.0)
        assert model.blocks[0].fwd_flops_per_token == pytest.approx(whole.block)
        causal = forward_flops(spec)
        assert whole.block - causal.block == pytest.approx(causal.block_attention)


def _plan(layout: str, global_batch: int = 10, micro_batch: int = 1) -> Any:
    spec = ModelSpec(
        "p", num_layers=6, hidden_size=64, num_heads=4, vocab_size=256, seq_len=32,
        family="llama", num_kv_heads=2,
    )  # fmt: skip
    cluster = ClusterSpec(
        (NodeSpec("a", 4), NodeSpec("b", 4), NodeSpec("c", 4)), load_device_spec("cpu")
    )
    return build_plan(
        spec, cluster, Layout.parse(layout), global_batch=global_batch, micro_batch=micro_batch
    )


@pytest.mark.parametrize("layout", ["pp=1,tp=1,dp=1", "pp=3,tp=2,dp=2", "pp=2,tp=1,dp=3"])
def test_the_ranks_share_of_a_step_sums_to_the_step(layout: str) -> None:
    plan = _plan(layout)  # 10 samples over 2 or 3 replicas: uneven shares
    ranks = [rank_step_flops(plan, s.rank) for s in plan.placement]
    assert sum(ranks) == pytest.approx(step_flops(plan.model, plan.global_batch))
    nodes = {s.node_id for s in plan.placement}
    assert sum(node_step_flops(plan, n) for n in nodes) == pytest.approx(sum(ranks))
    assert node_step_flops(plan, "nowhere") == 0.0


def test_the_last_stage_carries_the_lm_head_and_the_first_no_embedding_flops() -> None:
    plan = _plan("pp=2,tp=1,dp=1")
    f = forward_flops(plan.model)
    first, last = (rank_step_flops(plan, s.rank) for s in plan.placement)
    tokens = plan.global_batch * plan.model.seq_len
    assert last - first == pytest.approx(3 * f.last * tokens)


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 80GB HBM3", "fp32", 495.0),  # TF32: elasticpp's fp32 on CUDA
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "bf16", 835.0),
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA GH200 480GB", "bf16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-PCIE-40GB", "fp32", 156.0),
        ("NVIDIA L40S", "bf16", 362.0),
        ("NVIDIA L40", "bf16", 181.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA A10G", "bf16", None),  # not the A10
        ("NVIDIA B200", "bf16", None),
        ("Tesla V100-SXM2-16GB", "bf16", None),
        ("NVIDIA H100 80GB HBM3", "fp8", None),
    ],
)
def test_the_peak_table_matches_cuda_device_names(
    name: str, precision: str, peak: float | None
) -> None:
    assert device_peak_tflops(name, precision) == peak


def test_a_peak_is_the_job_specs_else_the_tables_and_a_cpu_slot_has_none() -> None:
    assert slot_peak(None, "NVIDIA H200", "bf16")[0] == 989.0
    assert slot_peak(300.0, "NVIDIA H200", "bf16")[0] == 300.0  # the override wins
    peak, why = slot_peak(None, "cpu", "fp32")
    assert peak is None and "CPU" in why and "peak_tflops" in why
    peak, why = slot_peak(None, "NVIDIA B200", "bf16")
    assert peak is None and "B200" in why
    assert slot_peak(0.03, "cpu", "fp32")[0] == 0.03  # the user's declaration
