"""The cost and memory model: the behaviour the planner's choices rest on."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from elasticpp.errors import ConfigError
from elasticpp.plan import (
    ClusterSpec,
    DeviceSpec,
    Layout,
    ModelSpec,
    build_plan,
    estimate,
    estimate_plan,
    load_device_spec,
    load_model_spec,
)
from elasticpp.plan.cost import CostParams, ModelCosts, memory_costs, total_params
from elasticpp.train.model.contract import init_unit
from elasticpp.train.model.families import build_model

A100 = load_device_spec("a100-80g")


def _estimate(model_name: str, layout: Layout, *, b: int, batch: int, recompute: bool = False):
    model = load_model_spec(model_name)
    gpn = 8
    nodes = -(-layout.world_size // gpn)
    cluster = ClusterSpec.uniform(nodes, gpn, A100)
    plan = build_plan(
        model, cluster, layout, global_batch=batch, micro_batch=b, recompute=recompute
    )
    return plan, estimate_plan(plan, A100)


@pytest.mark.parametrize(
    ("pp", "dp", "batch", "b", "m_max"),
    [(4, 2, 20, 2, 5), (4, 2, 18, 2, 5), (8, 1, 8, 1, 8), (2, 4, 4, 1, 1), (1, 4, 64, 4, 4)],
)
def test_bubble_fraction_is_p_minus_one_over_m_plus_p_minus_one(pp, dp, batch, b, m_max):
    plan, est = _estimate("gpt-1.3b", Layout(pp, 1, dp), b=b, batch=batch)
    assert max(plan.microbatches) == m_max
    assert est.bubble_fraction == pytest.approx((pp - 1) / (m_max + pp - 1))


def test_uneven_split_costs_as_much_as_the_slowest_replica():
    model = load_model_spec("gpt-1.3b")
    common = dict(pp=4, tp=1, dp=2, micro_batch=2, stages=((0, 6), (6, 12), (12, 18), (18, 24)))
    kw = dict(recompute=False, p2p_intra=True, dp_intra=True)
    uneven = estimate(model, A100, microbatches=(5, 4), **common, **kw)
    even = estimate(model, A100, microbatches=(5, 5), **common, **kw)
    fewer = estimate(model, A100, microbatches=(4, 4), **common, **kw)
    assert uneven.pipeline_seconds == even.pipeline_seconds
    assert fewer.pipeline_seconds < uneven.pipeline_seconds


def test_recompute_lowers_memory_and_raises_time():
    layout = Layout(4, 2, 1)
    _, plain = _estimate("gpt-6.7b", layout, b=2, batch=64)
    _, recomputed = _estimate("gpt-6.7b", layout, b=2, batch=64, recompute=True)
    assert recomputed.memory_bytes < plain.memory_bytes
    assert recomputed.step_seconds > plain.step_seconds


def test_more_pipeline_stages_lower_memory_per_gpu():
    memories = [
        _estimate("gpt-13b", Layout(pp, 1, 1), b=1, batch=64)[1].memory_bytes for pp in (2, 4, 8)
    ]
    assert memories[0] > memories[1] > memories[2]


def test_more_tensor_parallel_ranks_lower_memory_per_gpu():
    memories = [
        _estimate("gpt-13b", Layout(2, tp, 1), b=1, batch=64)[1].memory_bytes for tp in (1, 2, 4)
    ]
    assert memories[0] > memories[1] > memories[2]


def test_larger_micro_batch_raises_efficiency_by_about_a_third_and_saturates():
    params = CostParams()
    effs = [params.efficiency(b) for b in (1, 2, 4, 8, 16, 32)]
    assert all(a < b for a, b in itertools.pairwise(effs))
    assert 1.2 < effs[-1] / effs[0] < 1.35
    assert effs[-1] <= params.max_efficiency


def test_block_activations_follow_korthikanti_without_recompute():
    model = load_model_spec("gpt-13b")
    mc = ModelCosts.of(model)
    s, h, a, b = model.seq_len, model.hidden_size, model.num_heads, 2
    mem = memory_costs(mc, CostParams(), b, 1, False)
    assert mem.block_act_bytes == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    recomputed = memory_costs(mc, CostParams(), b, 1, True)
    assert recomputed.block_act_bytes == pytest.approx(2 * s * b * h)


def test_gpt3_175b_has_about_175_billion_parameters():
    assert 174e9 < total_params(load_model_spec("gpt-175b")) < 176e9


def test_data_parallel_allreduce_costs_nothing_for_one_replica_and_more_across_nodes():
    model = load_model_spec("gpt-1.3b")
    common = dict(pp=1, tp=1, micro_batch=1, stages=((0, 24),), recompute=False, p2p_intra=True)
    one = estimate(model, A100, dp=1, microbatches=(8,), dp_intra=False, **common)
    intra = estimate(model, A100, dp=2, microbatches=(4, 4), dp_intra=True, **common)
    inter = estimate(model, A100, dp=2, microbatches=(4, 4), dp_intra=False, **common)
    assert one.dp_seconds == 0.0
    assert 0.0 < intra.dp_seconds < inter.dp_seconds


def test_pipeline_boundaries_on_the_network_cost_more_than_inside_a_node():
    # pp=2 x tp=4: on 4-GPU nodes the two stages sit on two nodes, on one 8-GPU node together
    model = load_model_spec("gpt-1.3b")
    slow = DeviceSpec("slow-net", 80, 312, 300, 1)
    across, inside = (
        estimate_plan(
            build_plan(
                model,
                ClusterSpec.uniform(nodes, gpn, slow),
                Layout(2, 4, 1),
                global_batch=16,
                micro_batch=1,
            ),
            slow,
        )
        for nodes, gpn in ((2, 4), (1, 8))
    )
    assert across.step_seconds > inside.step_seconds


def _with_latency(device: DeviceSpec, intra_us: float, inter_us: float) -> DeviceSpec:
    return dataclasses.replace(
        device, intra_node_latency_us=intra_us, inter_node_latency_us=inter_us
    )


def test_every_message_pays_the_link_latency_once():
    # ring all-reduce over r ranks: 2(r-1) messages; p2p: one; bytes cost the same as before
    model = load_model_spec("gpt-1.3b")
    zero, slow = _with_latency(A100, 0, 0), _with_latency(A100, 100, 1000)
    lat_intra, lat_inter = 100e-6, 1000e-6
    kw = dict(micro_batch=1, recompute=False)

    def pair(**layout):
        return [estimate(model, d, **layout, **kw) for d in (zero, slow)]

    # DP alone, across nodes: 2(d-1) network latencies
    a, b = pair(
        pp=1, tp=1, dp=4, microbatches=(2,) * 4, stages=((0, 24),), p2p_intra=True, dp_intra=False
    )
    assert b.dp_seconds - a.dp_seconds == pytest.approx(2 * 3 * lat_inter)
    assert b.pipeline_seconds == a.pipeline_seconds
    # a pipeline of 4 inside a node: two boundary messages per slot, (m + p - 1) slots
    stages = ((0, 6), (6, 12), (12, 18), (18, 24))
    a, b = pair(pp=4, tp=1, dp=1, microbatches=(8,), stages=stages, p2p_intra=True, dp_intra=True)
    assert b.pipeline_seconds - a.pipeline_seconds == pytest.approx((8 + 3) * 2 * lat_intra)
    # ... across nodes, on the network's latency
    a, b = pair(pp=4, tp=1, dp=1, microbatches=(8,), stages=stages, p2p_intra=False, dp_intra=True)
    assert b.pipeline_seconds - a.pipeline_seconds == pytest.approx((8 + 3) * 2 * lat_inter)
    # TP over t ranks: 4 all-reduces per block (forward 2, backward 2) + 1 for the embedding,
    # each 2(t-1) intra-node messages; one stage holds all 24 blocks and the embedding
    a, b = pair(
        pp=1, tp=4, dp=1, microbatches=(5,), stages=((0, 24),), p2p_intra=True, dp_intra=True
    )
    per_microbatch = (24 * 4 + 1) * 2 * 3 * lat_intra
    assert b.pipeline_seconds - a.pipeline_seconds == pytest.approx(5 * per_microbatch)


def test_gpu_presets_have_microsecond_latencies_and_the_cpu_preset_gloo_ones():
    for name in ("a100-40g", "a100-80g", "h100-80g", "h200"):
        gpu = load_device_spec(name)
        assert 0 < gpu.intra_node_latency_us <= gpu.inter_node_latency_us <= 50
    cpu = load_device_spec("cpu")
    assert cpu.intra_node_latency_us >= 100 and cpu.inter_node_latency_us >= 100
    # a spec written before latencies existed still constructs, with the GPU defaults
    old = DeviceSpec("old", 80, 312, 300, 25)
    assert old.intra_node_latency_us > 0 and old.inter_node_latency_us > 0


@pytest.mark.parametrize("field", ["intra_node_latency_us", "inter_node_latency_us"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), "5", True])
def test_a_bad_latency_is_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        DeviceSpec("d", 80, 312, 300, 25, **{field: value})


def test_zero_latency_is_allowed():
    d = DeviceSpec("d", 80, 312, 300, 25, intra_node_latency_us=0, inter_node_latency_us=0)
    assert d.intra_node_latency_s == 0.0 == d.inter_node_latency_s


# Llama-family shapes Hugging Face configs produce (elasticpp.train.model.hfconfig): Qwen3's
# head_dim wider than hidden/heads with per-head q/k norms, a Mistral's narrower one, Qwen2's Q/K/V
# biases, a Llama with attention_bias (Q/K/V and output biases).
_HF_LIKE = {
    "qwen3": {"head_dim": 32, "qk_norm": True, "hf_model_type": "qwen3"},
    "mistral": {"head_dim": 8, "hf_model_type": "mistral"},
    "qwen2": {"qkv_bias": True, "hf_model_type": "qwen2"},
    "llama-bias": {"qkv_bias": True, "o_bias": True},
}


def _hf_like(kind: str) -> ModelSpec:
    return ModelSpec(
        kind,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        vocab_size=256,
        seq_len=32,
        ffn_hidden_size=96,
        num_kv_heads=2,
        family="llama",
        options=tuple(_HF_LIKE[kind].items()),
    )


@pytest.mark.parametrize("kind", sorted(_HF_LIKE))
def test_the_planners_parameter_count_and_flops_are_the_built_models(kind: str) -> None:
    spec = _hf_like(kind)
    model = build_model(spec)
    # The oracle: the tensors the family initialises, counted one by one.
    real = {u.name: sum(t.numel() for t in init_unit(u, 0, 0, 1).values()) for u in model.units}
    mc = ModelCosts.of(spec)
    assert total_params(spec) == sum(real.values())
    assert mc.block_params == real["block.0000"]
    assert mc.block_fwd_flops_per_sample == pytest.approx(
        model.blocks[0].fwd_flops_per_token * spec.seq_len
    )


def test_block_activations_are_as_wide_as_the_declared_attention() -> None:
    spec = _hf_like("qwen3")
    s, h, a, b = spec.seq_len, spec.hidden_size, spec.num_heads, 2
    q = a * 32  # twice the hidden size
    for t in (1, 2):
        mem = memory_costs(ModelCosts.of(spec), CostParams(), b, t, False)
        assert mem.block_act_bytes == pytest.approx(
            s * b * (10 * h + (16 * h + 8 * q) / t + 5 * a * s / t)
        )


def test_a_bad_head_dim_option_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="head_dim"):
        dataclasses.replace(_hf_like("qwen3"), options=(("head_dim", 0),))
