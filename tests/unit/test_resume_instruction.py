"""The resume instruction's compact form: every node derives from it, with the plan, exactly
the fetches the resolver chose for it; a value of another format is refused."""

from __future__ import annotations

import json
import random

import pytest

from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.cluster.barriers import RESUME_FORMAT_VERSION, check_arrival
from elasticpp.cluster.errors import ClusterDataError
from elasticpp.errors import ConfigError, StateUnavailableError
from elasticpp.plan.layout import Layout, Plan, build_plan
from elasticpp.plan.specs import DEVICE_PRESETS, ClusterSpec, ModelSpec, NodeSpec
from elasticpp.store.holdings import DISK_SOURCE, NodeHoldings, PieceInfo, StepHolding
from elasticpp.store.instruction import INSTRUCTION_FORMAT_VERSION, encode, node_fetches
from elasticpp.store.resolver import ResumePlan, resolve

MODEL = ModelSpec("t", num_layers=4, hidden_size=16, num_heads=4, vocab_size=32, seq_len=8)
LAYOUTS = ("pp=1,tp=1", "pp=2,tp=1", "pp=1,tp=2", "pp=2,tp=2", "pp=1,tp=4", "pp=4,tp=1")


def _plan(rng: random.Random, nodes: list[str], generation: int) -> Plan | None:
    gpus = {n: rng.choice((1, 2, 4)) for n in nodes}
    cluster = ClusterSpec(tuple(NodeSpec(n, g) for n, g in gpus.items()), DEVICE_PRESETS["cpu"])
    for text in rng.sample(LAYOUTS, len(LAYOUTS)):
        layout = Layout.parse(text)
        for dp in (3, 2, 1):
            try:
                plan = build_plan(
                    MODEL,
                    cluster,
                    Layout(layout.pp, layout.tp, dp),
                    global_batch=12,
                    micro_batch=1,
                )
            except Exception:
                continue
            return plan.with_generation(generation)
    return None


def _holdings(rng: random.Random, node: str, nodes: list[str]) -> NodeHoldings:
    """Random steps of random origins; each holds a random part of a random tp size's
    slices, and some copies differ in their bytes (another commit of the step)."""
    steps = {}
    for _ in range(rng.randint(0, 3)):
        origin = rng.choice(nodes)
        step = rng.choice((5, 6))
        tp = rng.choice((1, 2, 4))
        pieces = {}
        for unit in MODEL.units:
            for r in range(tp):
                if rng.random() < 0.8:
                    tag = rng.choice(("", "", "", "x"))
                    name = PieceKey(unit, r, tp).filename
                    pieces[name] = PieceInfo(rng.choice((100, 100, 7)), f"{name}{tag}".ljust(64))
        steps[(origin, step)] = StepHolding(origin, step, MODEL.units, pieces, 1, 1)
    return NodeHoldings(node, steps)


def _case(seed: int) -> tuple[Plan, list[str], ResumePlan] | None:
    """A random plan and the resolver's choice for it from random holdings; None if no
    layout fits or no step resolves."""
    rng = random.Random(seed)
    nodes = [f"n{i}" for i in range(rng.randint(1, 6))]
    plan = _plan(rng, nodes, 9)
    if plan is None:
        return None
    held = {n: _holdings(rng, n, nodes) for n in nodes}
    disk = _holdings(rng, DISK_SOURCE, [DISK_SOURCE]) if rng.random() < 0.3 else None
    live = [n for n in nodes if rng.random() < 0.85]
    try:
        return plan, nodes, resolve(held, plan, live_nodes=live, disk=disk)
    except StateUnavailableError:
        return None


SEEDS = range(150)
CASES = [c for c in map(_case, SEEDS) if c is not None]  # seeds where a layout and a step fit


def test_the_random_cases_are_enough() -> None:
    assert len(CASES) >= 80


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].layout}-{len(c[1])}nodes")
def test_every_node_derives_exactly_the_resolvers_fetches_from_the_compact_form(
    case: tuple[Plan, list[str], ResumePlan],
) -> None:
    plan, nodes, rp = case
    value = json.loads(json.dumps(encode(rp, plan)))  # as it comes back from etcd
    for n in nodes:
        assert node_fetches(value, plan, n) == rp.node_fetches(n), n


def test_the_random_cases_use_every_part_of_the_form() -> None:
    seen: set[str] = set()
    for plan, _, rp in CASES:
        value = encode(rp, plan)
        seen |= {k for k in ("reshard", "reshard_by_node", "infos_by_node") if value[k]}
        if DISK_SOURCE in value["nodes"]:
            seen.add("disk")
        if any(len(run) == 3 for runs in value["by_node"].values() for run in runs):
            seen.add("origin other than the source")
        if len(value["by_node"]) < len(set(rp.rank_nodes.values())):
            seen.add("a node taking everything from itself")
    assert seen == {
        "reshard",
        "reshard_by_node",
        "infos_by_node",
        "disk",
        "origin other than the source",
        "a node taking everything from itself",
    }


def _one_node_plan() -> Plan:
    cluster = ClusterSpec((NodeSpec("a", 2), NodeSpec("b", 2)), DEVICE_PRESETS["cpu"])
    return build_plan(MODEL, cluster, Layout.parse("pp=1,tp=2"), global_batch=4, micro_batch=1)


def test_a_fresh_job_has_nothing_to_fetch() -> None:
    value = encode(None, _one_node_plan(), step=0)
    assert value["step"] == 0 and node_fetches(value, _one_node_plan(), "a") == ()


def test_an_instruction_of_another_format_is_refused_not_misread() -> None:
    old = {"step": 3, "fetches": {"0": [["embed.tp0-2.safetensors", "a", "b", "0" * 64, 1]]}}
    with pytest.raises(ConfigError, match=r"format_version None is not 2 .*another release"):
        node_fetches(old, _one_node_plan(), "a")
    newer = {**encode(None, _one_node_plan()), "format_version": INSTRUCTION_FORMAT_VERSION + 1}
    with pytest.raises(ConfigError, match="format_version 3 is not 2"):
        node_fetches(newer, _one_node_plan(), "a")


def test_a_source_that_is_not_a_node_name_is_refused_before_it_becomes_a_path() -> None:
    plan = _one_node_plan()
    held = {
        "b": NodeHoldings(
            "b",
            {
                ("b", 3): StepHolding(
                    "b",
                    3,
                    MODEL.units,
                    {
                        PieceKey(u, r, 2).filename: PieceInfo(1, "0" * 64)
                        for u in MODEL.units
                        for r in range(2)
                    },
                )
            },
        )
    }
    value = encode(resolve(held, plan, live_nodes=["a", "b"]), plan)
    assert value["nodes"] == ["b"] and "a" in value["by_node"]
    value["nodes"] = ["../etc"]
    with pytest.raises(ConfigError, match="node"):
        node_fetches(value, plan, "a")


def test_the_cluster_layer_refuses_an_instruction_of_another_release_by_name() -> None:
    assert RESUME_FORMAT_VERSION == INSTRUCTION_FORMAT_VERSION
    value = {**encode(None, _one_node_plan(), step=4), "at": 1.0, "recomputed": 0}
    assert check_arrival("resume-3", "resume", value) == value
    old = {"step": 4, "fetches": {"0": []}, "at": 1.0}  # the per-rank form of earlier releases
    with pytest.raises(ClusterDataError, match=r"format_version None is not 2 .*another release"):
        check_arrival("resume-3", "resume", old)
