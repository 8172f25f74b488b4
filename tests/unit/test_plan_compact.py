"""A plan's compact placement (format 2): every plan reads back equal to itself, through JSON,
whether written compactly or in the full per-rank form of format 1; a 2,048-node plan stays
small; a placement that does not add up is refused naming the problem."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticpp.errors import ConfigError, PlanError
from elasticpp.plan import ClusterSpec, Layout, ModelSpec, NodeSpec, Plan, build_plan, plan
from elasticpp.plan.layout import WorkerSlot
from elasticpp.plan.specs import DEVICE_PRESETS, load_model_spec

DEVICE = DEVICE_PRESETS["h100-80g"]


def full_form(p: Plan) -> dict[str, Any]:
    """The plan as format 1 wrote it: one object per rank."""
    data = p.to_dict()
    data["format_version"] = 1
    data["placement"] = [
        {
            "rank": s.rank,
            "node_id": s.node_id,
            "local_rank": s.local_rank,
            "pp": s.coord.pp,
            "tp": s.coord.tp,
            "dp": s.coord.dp,
        }
        for s in p.placement
    ]
    return data


def through_json(data: dict[str, Any]) -> Plan:
    return Plan.from_dict(json.loads(json.dumps(data)))


def check_reads_back(p: Plan) -> None:
    assert through_json(p.to_dict()) == p
    assert through_json(full_form(p)) == p
    assert Plan.from_json(p.to_json()) == p


models = st.builds(
    lambda layers, heads, vocab, gated: ModelSpec(
        "m", layers, heads * 32, heads, vocab, 512, gated_mlp=gated
    ),
    st.integers(1, 12),
    st.sampled_from([1, 2, 4, 6, 8]),
    st.integers(16, 5000),
    st.booleans(),
)
clusters = st.builds(
    lambda counts: ClusterSpec(
        tuple(NodeSpec(f"node-{i}", c) for i, c in enumerate(counts)), DEVICE
    ),
    st.lists(st.integers(0, 8), min_size=1, max_size=12).filter(any),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=models, cluster=clusters, batch=st.integers(1, 512))
def test_every_searched_plan_reads_back_equal(
    model: ModelSpec, cluster: ClusterSpec, batch: int
) -> None:
    try:
        result = plan(model, cluster, batch, top_k=3)
    except PlanError:
        return
    for p in [result.best, *result.alternatives]:
        check_reads_back(p.with_generation(7))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=models,
    cluster=clusters,
    pp=st.integers(1, 4),
    tp=st.sampled_from([1, 2, 4, 8]),
    dp=st.integers(1, 6),
)
def test_every_built_plan_reads_back_equal(
    model: ModelSpec, cluster: ClusterSpec, pp: int, tp: int, dp: int
) -> None:
    try:
        p = build_plan(model, cluster, Layout(pp, tp, dp), global_batch=4 * dp, micro_batch=2)
    except PlanError:
        return
    check_reads_back(p)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=models, cluster=clusters, batch=st.integers(1, 512))
def test_a_nodes_ranks_are_its_slots_of_the_placement_in_rank_order(
    model: ModelSpec, cluster: ClusterSpec, batch: int
) -> None:
    # ranks_on is read from an index built once per plan (every agent asks every tick).
    try:
        p = plan(model, cluster, batch, top_k=1).best
    except PlanError:
        return
    for node in [*(n.node_id for n in cluster.nodes), "not-a-node"]:
        assert p.ranks_on(node) == [s for s in p.placement if s.node_id == node]
    ranks = p.ranks_on(cluster.nodes[0].node_id)
    ranks.clear()  # a caller's list is its own
    assert p.ranks_on(cluster.nodes[0].node_id) == [
        s for s in p.placement if s.node_id == cluster.nodes[0].node_id
    ]
    assert through_json(p.to_dict()) == p  # the index is no part of the plan's value


def _small_plan() -> Plan:
    cluster = ClusterSpec((NodeSpec("a", 4), NodeSpec("b", 4), NodeSpec("c", 4)), DEVICE)
    return build_plan(
        load_model_spec("tiny"), cluster, Layout(2, 2, 3), global_batch=6, micro_batch=1
    )


def test_a_placement_off_the_rule_is_kept_as_exceptions() -> None:
    """GPU indices reversed on each node and nodes revisited: what `place` never builds, but
    a valid plan, so it must read back exactly."""
    p = _small_plan()
    order = ["b", "a", "b", "c", "c", "a"]  # TP group -> node; each node holds two groups
    slots, used = [], dict.fromkeys(order, 0)
    for s in p.placement:
        node = order[s.rank // 2]
        slots.append(WorkerSlot(s.rank, node, 3 - used[node], s.coord))
        used[node] += 1
    odd = dataclasses.replace(p, placement=tuple(slots))
    odd.validate()
    data = odd.to_dict()
    assert data["placement"]["node_runs"] == [["b", 2], ["a", 2], ["b", 2], ["c", 4], ["a", 2]]
    assert len(data["placement"]["local_ranks"]) == 12
    check_reads_back(odd)
    assert p.to_dict()["placement"]["local_ranks"] == []  # `place` follows the rule


def test_a_2048_node_plan_is_small() -> None:
    """Format 1 wrote 1.6 MiB for llama-70b pp=8 tp=8 at 2,048 nodes x 8 GPUs."""
    cluster = ClusterSpec(tuple(NodeSpec(f"gpu-node-{i:05d}", 8) for i in range(2048)), DEVICE)
    p = build_plan(
        load_model_spec("llama-70b"), cluster, Layout(8, 8, 256), global_batch=1024, micro_batch=1
    )
    text = p.to_json()
    assert len(text) <= 64 * 1024, len(text)
    assert Plan.from_json(text) == p
    assert len(json.dumps(full_form(p))) > 1024 * 1024  # what it replaced


@pytest.mark.parametrize(
    ("placement", "match"),
    [
        ({"node_runs": [["a", 4], ["b", 4]], "local_ranks": []}, "cover 8 ranks.*has 12"),
        ({"node_runs": [["a", 4], ["b", 0], ["c", 8]]}, r"\['b', 0\] is not \[node_id"),
        ({"node_runs": [["a", True], ["b", 11]]}, r"is not \[node_id"),
        ({"node_runs": [["a", 4], ["b", 4], ["c", 4]], "local_ranks": [[12, 0]]}, "names no"),
        ({"node_runs": [["a", 4], ["b", 4], ["c", 4]], "local_ranks": [[1, 2], [1, 3]]}, "twice"),
        ({"node_runs": [["a", 4], ["b", 4], ["c", 4]], "local_ranks": [[1, -1]]}, ">= 0"),
        ([{"rank": 0}], "malformed field"),
    ],
)
def test_a_placement_that_does_not_add_up_is_refused(placement: Any, match: str) -> None:
    data = {**_small_plan().to_dict(), "placement": placement}
    with pytest.raises(ConfigError, match=match):
        Plan.from_dict(data)


def test_two_ranks_on_one_gpu_are_refused() -> None:
    data = _small_plan().to_dict()
    data["placement"]["local_ranks"] = [[1, 0]]  # rank 0 is on a's GPU 0 already
    with pytest.raises(PlanError, match="two ranks on a GPU 0"):
        Plan.from_dict(data)


def test_an_unknown_format_is_refused() -> None:
    data = {**_small_plan().to_dict(), "format_version": 3}
    with pytest.raises(ConfigError, match=r"format_version 3 is not one of \(1, 2\)"):
        Plan.from_dict(data)
