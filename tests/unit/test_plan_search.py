"""The layout search: promises every plan keeps, optimality, determinism, plan_all."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticpp.errors import ConfigError, PlanError
from elasticpp.plan import (
    MICRO_BATCH_CHOICES,
    ClusterSpec,
    DeviceSpec,
    Layout,
    ModelSpec,
    NodeSpec,
    Plan,
    Planner,
    balanced_stages,
    build_plan,
    estimate_plan,
    load_device_spec,
    load_model_spec,
    plan,
    plan_all,
)
from elasticpp.plan.cost import CostParams, ModelCosts, unit_costs
from elasticpp.plan.specs import GIB


def _key(p: Plan) -> tuple:
    return (p.est_step_seconds, p.gpus_used, p.pp, p.tp, p.dp, p.micro_batch, p.recompute)


def _check_promises(p: Plan, cluster: ClusterSpec) -> None:
    """What every plan the planner returns must keep."""
    p.validate()  # contiguous stages covering every block, placement, TP inside a node
    assert sum(p.microbatches) * p.micro_batch == p.global_batch
    assert max(p.microbatches) - min(p.microbatches) <= 1
    covered = [i for first, end in p.stages for i in range(first, end)]
    assert covered == list(range(p.model.num_layers))
    nodes = {n.node_id: n.gpus for n in cluster.nodes}
    for slot in p.placement:
        assert 0 <= slot.local_rank < nodes[slot.node_id]
        lead = p.placement[slot.rank - slot.coord.tp]
        assert lead.node_id == slot.node_id  # a TP group never crosses a node
    assert p.gpus_used <= cluster.total_gpus
    assert p.model.num_heads % p.tp == 0
    est = estimate_plan(p, cluster.device)
    assert est.memory_bytes <= cluster.device.memory_bytes
    # the search's decomposed arithmetic agrees exactly with the plain stage-by-stage estimate
    assert p.est_step_seconds == est.step_seconds
    assert p.memory_gib == est.memory_gib
    assert p.bubble_fraction == est.bubble_fraction


models = st.builds(
    lambda layers, heads, head_dim, vocab, seq, gated: ModelSpec(
        "m", layers, heads * head_dim, heads, vocab, seq, gated_mlp=gated
    ),
    st.integers(1, 12),
    st.sampled_from([1, 2, 4, 6, 8]),
    st.sampled_from([8, 32, 128]),
    st.integers(16, 60000),
    st.integers(8, 2048),
    st.booleans(),
)
clusters = st.builds(
    lambda counts, mem, intra_us, extra_us: ClusterSpec(
        tuple(NodeSpec(f"n{i}", c) for i, c in enumerate(counts)),
        DeviceSpec(
            "d",
            mem,
            100,
            200,
            20,
            intra_node_latency_us=intra_us,
            inter_node_latency_us=intra_us + extra_us,
        ),
    ),
    st.lists(st.integers(0, 8), min_size=1, max_size=6).filter(any),
    st.floats(2.5, 40.0),
    st.sampled_from([0.0, 8.0, 300.0]),
    st.sampled_from([0.0, 17.0, 2000.0]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=models,
    cluster=clusters,
    batch=st.integers(1, 3000),
    micro=st.one_of(st.none(), st.integers(1, 8)),
)
def test_every_plan_keeps_the_promises(model, cluster, batch, micro):
    if micro is not None and batch % micro:
        with pytest.raises(PlanError, match="not a multiple"):
            plan(model, cluster, batch, micro_batch=micro)
        return
    try:
        result = plan(model, cluster, batch, micro_batch=micro, top_k=3)
    except PlanError as exc:
        assert "GiB" in str(exc)  # the only other refusal: nothing fits in memory
        return
    plans = [result.best, *result.alternatives]
    assert len(plans) == len(result.candidates) <= 4
    for p, c in zip(plans, result.candidates, strict=True):
        _check_promises(p, cluster)
        assert c.layout == p.layout and c.microbatches == p.microbatches
        if micro is not None:
            assert p.micro_batch == micro
    keys = [_key(p) for p in plans]
    assert keys == sorted(keys)  # the chosen plan is never slower than a runner-up
    assert len({(p.pp, p.tp, p.micro_batch, p.recompute) for p in plans}) == len(plans)
    again = plan(model, cluster, batch, micro_batch=micro, top_k=3)
    assert again.best.to_json() == result.best.to_json()
    assert [c.to_dict() for c in again.candidates] == [c.to_dict() for c in result.candidates]


def _brute_force_best(model: ModelSpec, cluster: ClusterSpec, batch: int) -> tuple:
    """Every (p, t, d, b, recompute) built and estimated from scratch; the fastest that fits."""
    mc, params = ModelCosts.of(model), CostParams()
    best = None
    sizes = {n.gpus for n in cluster.nodes if n.gpus}
    for tp in range(1, cluster.max_gpus_per_node + 1):
        if model.num_heads % tp or not any(g % tp == 0 for g in sizes):
            continue
        groups = sum(n.gpus // tp for n in cluster.nodes)
        for b in (b for b in MICRO_BATCH_CHOICES if batch % b == 0):
            for recompute in (False, True):
                uc = unit_costs(mc, cluster.device, params, b, tp, recompute)
                for pp in range(1, min(model.num_layers, groups) + 1):
                    stages = balanced_stages(
                        model.num_layers, pp, uc.block_seconds, uc.embed_seconds, uc.head_seconds
                    )
                    for dp in range(1, min(groups // pp, batch // b) + 1):
                        p = build_plan(
                            model,
                            cluster,
                            Layout(pp, tp, dp),
                            global_batch=batch,
                            micro_batch=b,
                            recompute=recompute,
                            stages=stages,
                        )
                        est = estimate_plan(p, cluster.device)
                        if est.memory_bytes > cluster.device.memory_bytes:
                            continue
                        key = (est.step_seconds, pp * tp * dp, pp, tp, dp, b, recompute)
                        best = key if best is None or key < best else best
    assert best is not None
    return best


@pytest.mark.parametrize(
    ("counts", "memory_gib", "network_gbps", "batch", "latency_us"),
    [
        ((4, 4), 16.0, 25, 48, None),  # memory binds: small p * t does not fit
        ((8, 6, 3), 40.0, 25, 36, None),  # uneven nodes: TP packing and node boundaries differ
        ((2, 2, 2, 2), 80.0, 25, 10, None),  # B = 10: uneven micro-batch split for most d
        ((4, 4, 4), 20.0, 25, 22, None),  # the fastest plan splits 11 micro-batches 4, 4, 3
        ((2, 2), 8.5, 25, 24, None),  # only recomputation fits
        ((4, 4, 4), 80.0, 0.5, 48, None),  # a slow network: fewer replicas than the nodes allow
        ((2, 2, 2, 2), 40.0, 0.2, 64, None),  # ... down to one replica
        ((8, 6, 3), 40.0, 25, 36, (300, 3000)),  # slow messages: TP and crossing nodes cost more
        ((4, 4, 4), 80.0, 25, 48, (0, 0)),  # no latency at all
    ],
)
def test_search_finds_the_brute_force_optimum(counts, memory_gib, network_gbps, batch, latency_us):
    model = load_model_spec("gpt-1.3b")
    device = DeviceSpec("d", memory_gib, 312, 300, network_gbps)
    if latency_us is not None:
        device = dataclasses.replace(
            device, intra_node_latency_us=latency_us[0], inter_node_latency_us=latency_us[1]
        )
    cluster = ClusterSpec(tuple(NodeSpec(f"n{i}", c) for i, c in enumerate(counts)), device)
    got = plan(model, cluster, batch, top_k=0).best
    assert _key(got) == _brute_force_best(model, cluster, batch)
    _check_promises(got, cluster)


def test_message_latency_turns_a_tensor_parallel_choice_into_data_parallel():
    # tiny on 4 nodes x 2 CPU slots: without latency TP=2 looks cheaper than plain DP (it
    # halves each slot's FLOPs and its bytes are few); at gloo's per-message latency its
    # 4 all-reduces per block per micro-batch make it the slower layout, as it is when run.
    model, cpu = load_model_spec("tiny"), load_device_spec("cpu")
    free = dataclasses.replace(cpu, intra_node_latency_us=0.0, inter_node_latency_us=0.0)
    tp_layout, dp_layout = Layout(1, 2, 4), Layout(1, 1, 8)

    def step(device: DeviceSpec, layout: Layout) -> float:
        cluster = ClusterSpec.uniform(4, 2, device)
        built = build_plan(model, cluster, layout, global_batch=16, micro_batch=2)
        return estimate_plan(built, device).step_seconds

    assert step(free, tp_layout) < step(free, dp_layout)
    assert step(cpu, tp_layout) > step(cpu, dp_layout)
    best_free = plan(model, ClusterSpec.uniform(4, 2, free), 16, micro_batch=2).best
    best_cpu = plan(model, ClusterSpec.uniform(4, 2, cpu), 16, micro_batch=2).best
    assert best_free.tp == 2
    assert best_cpu.tp == 1 and best_cpu.layout == dp_layout
    # no TP layout is even among the runner-ups once messages cost what gloo's cost
    result = plan(model, ClusterSpec.uniform(4, 2, cpu), 16, micro_batch=2, top_k=5)
    assert all(c.layout.tp == 1 for c in result.candidates)


def test_network_latency_favours_fewer_replicas():
    # The DP all-reduce is 2(d-1) messages on the network: when each costs milliseconds,
    # wider TP groups inside a node and fewer replicas beat more replicas.
    model = load_model_spec("gpt-1.3b")
    fast = DeviceSpec("d", 80, 312, 300, 25)  # default latencies: microseconds
    slow = dataclasses.replace(fast, inter_node_latency_us=5000.0)
    best_fast = plan(model, ClusterSpec.uniform(2, 4, fast), 64).best
    best_slow = plan(model, ClusterSpec.uniform(2, 4, slow), 64).best
    assert best_slow.dp < best_fast.dp
    assert best_slow.gpus_used == best_fast.gpus_used == 8


def test_one_gpu_gets_a_plan():
    cpu = load_device_spec("cpu")
    result = plan(load_model_spec("tiny"), ClusterSpec.uniform(1, 1, cpu), 8)
    best = result.best
    assert best.layout == Layout(1, 1, 1)
    assert best.stages == ((0, 8),)
    _check_promises(best, ClusterSpec.uniform(1, 1, cpu))


@pytest.mark.timeout(60)
def test_sixteen_thousand_gpus_get_a_valid_plan():
    cluster = ClusterSpec.uniform(2048, 8, load_device_spec("a100-80g"))
    result = plan(load_model_spec("gpt-175b"), cluster, 1536, top_k=1)
    _check_promises(result.best, cluster)
    assert result.best.gpus_used > 1024
    assert result.best.tp == 8  # 175B on A100: the full NVLink domain


def test_uneven_cluster_with_a_lost_gpu_keeps_tp_groups_inside_nodes():
    device = load_device_spec("a100-80g")
    cluster = ClusterSpec(
        (NodeSpec("a", 8), NodeSpec("b", 7), NodeSpec("c", 8), NodeSpec("d", 8)), device
    )
    result = plan(load_model_spec("gpt-13b"), cluster, 256)
    for p in (result.best, *result.alternatives):
        _check_promises(p, cluster)
    assert result.best.gpus_used <= 31


def test_gpt3_175b_on_128_a100s_is_a_plausible_megatron_layout():
    cluster = ClusterSpec.uniform(16, 8, load_device_spec("a100-80g"))
    best = plan(load_model_spec("gpt-175b"), cluster, 1536).best
    assert best.tp == 8 and best.pp * best.tp * best.dp == 128
    assert best.memory_gib <= 80


def test_nothing_fits_says_the_smallest_need_and_the_capacity():
    cluster = ClusterSpec.uniform(1, 8, load_device_spec("a100-80g"))
    with pytest.raises(PlanError, match=r"smallest memory need found is \d+\.\d GiB.*80 GiB"):
        plan(load_model_spec("gpt-175b"), cluster, 1536)


@pytest.mark.parametrize(
    ("batch", "micro", "error", "match"),
    [
        (0, None, ConfigError, "global_batch"),
        (-4, None, ConfigError, "global_batch"),
        (6, 4, PlanError, "not a multiple of micro-batch 4"),
        (2, 4, PlanError, "not a multiple of micro-batch 4"),
        (8, 0, ConfigError, "micro_batch"),
    ],
)
def test_bad_batches_are_refused(batch, micro, error, match):
    cluster = ClusterSpec.uniform(1, 8, load_device_spec("a100-80g"))
    with pytest.raises(error, match=match):
        plan(load_model_spec("gpt-1.3b"), cluster, batch, micro_batch=micro)


def test_planner_refuses_a_cluster_of_another_device():
    planner = Planner(load_model_spec("tiny"), load_device_spec("cpu"), 8)
    with pytest.raises(ConfigError, match="device"):
        planner.plan(ClusterSpec.uniform(1, 8, load_device_spec("a100-80g")))


@pytest.mark.timeout(120)
def test_plan_all_matches_planning_each_node_count():
    model, device = load_model_spec("gpt-13b"), load_device_spec("a100-40g")
    table = plan_all(model, device, 4, 1, 24, 512)
    planner = Planner(model, device, 512)
    feasible = []
    for nodes in range(1, 25):
        cluster = ClusterSpec.uniform(nodes, 4, device)
        try:
            expected = planner.plan(cluster, top_k=0).best
        except PlanError as exc:
            assert nodes not in table
            assert table.reason(nodes) == str(exc)
            continue
        feasible.append(nodes)
        got = table[nodes]
        assert got.to_json() == expected.to_json()
        assert table.layout(nodes) == (
            expected.layout,
            expected.micro_batch,
            expected.recompute,
            expected.est_step_seconds,
        )
        assert table.reason(nodes) == ""
    assert list(table) == feasible and len(table) == len(feasible)
    assert 1 not in table  # 13B's state alone is ~190 GiB: no single 4 x 40 GiB node holds it
    assert feasible and feasible[-1] == 24
    times = [table[n].est_step_seconds for n in feasible]
    assert times[-1] < times[0]  # more nodes, faster steps


def test_plan_all_refuses_bad_ranges():
    model, device = load_model_spec("tiny"), load_device_spec("cpu")
    with pytest.raises(ConfigError, match="min_nodes"):
        plan_all(model, device, 1, 4, 2, 8)
    with pytest.raises(ConfigError, match="gpus_per_node"):
        plan_all(model, device, 0, 1, 2, 8)


def test_memory_estimate_is_reported_in_gib():
    cluster = ClusterSpec.uniform(2, 8, load_device_spec("a100-80g"))
    best = plan(load_model_spec("gpt-6.7b"), cluster, 256).best
    assert best.memory_gib == pytest.approx(estimate_plan(best, cluster.device).memory_bytes / GIB)
    assert 0 < best.memory_gib <= 80
