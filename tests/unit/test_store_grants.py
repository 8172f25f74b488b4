"""What a node may fetch from another (elasticpp.store.grants): what its plan assigns it."""

from __future__ import annotations

from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.plan import ClusterSpec, Layout, NodeSpec, Plan, build_plan, load_device_spec
from elasticpp.plan.specs import load_model_spec
from elasticpp.store.grants import fetch_refusal


def _plan() -> Plan:
    """pp=2, tp=2 on n0 (stage 0: embed, blocks 0-3) and n1 (stage 1: blocks 4-7, head);
    n2 is a member with no rank."""
    nodes = tuple(NodeSpec(n, 2) for n in ("n0", "n1", "n2"))
    cluster = ClusterSpec(nodes, load_device_spec("cpu"))
    model = load_model_spec("tiny")
    return build_plan(
        model, cluster, Layout(2, 2, 1), global_batch=8, micro_batch=2
    ).with_generation(7)


def _ask(caller: str, name: str, *, server: str = "n1", origin: str = "n1", step: int = 10,
         copies: int = 0, every: int = 1) -> str | None:  # fmt: skip
    return fetch_refusal(
        _plan(), caller, server, origin, step, PieceKey.parse(name), copies=copies, every=every
    )


def test_a_node_fetches_the_units_of_its_own_stage_in_any_old_slicing() -> None:
    assert _ask("n0", "embed.tp0-2.safetensors") is None
    assert _ask("n0", "block.0003.tp1-2.safetensors") is None
    # Written by a layout of another tp size: a reshard reads its whole set.
    assert _ask("n0", "block.0000.tp0-1.safetensors") is None
    assert _ask("n0", "block.0000.tp3-4.safetensors") is None
    assert _ask("n1", "head.tp0-2.safetensors", server="n0", origin="n0") is None


def test_a_unit_of_another_stage_is_refused_naming_piece_node_and_generation() -> None:
    why = _ask("n0", "head.tp0-2.safetensors")
    assert why is not None
    assert "head.tp0-2.safetensors" in why and "node n0" in why and "generation 7" in why
    assert _ask("n1", "embed.tp0-1.safetensors", server="n0", origin="n0") is not None
    assert _ask("n0", "ghost.tp0-1.safetensors") is not None  # no stage holds it


def test_a_node_without_a_rank_fetches_nothing() -> None:
    why = _ask("n2", "embed.tp0-2.safetensors")
    assert why is not None and "has no rank" in why
    assert _ask("stranger", "block.0004.tp0-2.safetensors") is not None


def test_replica_holders_copy_every_piece_of_the_servers_own_anchors() -> None:
    # Ring n0, n1 (the planned nodes): n0's replica is kept by n1 and n1's by n0.
    assert _ask("n0", "head.tp0-2.safetensors", copies=1) is None
    assert _ask("n1", "embed.tp0-2.safetensors", server="n0", origin="n0", copies=1) is None
    # Not an anchor step, or a piece of another origin this server keeps: the stage rule only.
    assert _ask("n0", "head.tp0-2.safetensors", copies=1, every=4, step=10) is not None
    assert _ask("n0", "head.tp0-2.safetensors", copies=1, every=4, step=12) is None
    assert _ask("n0", "head.tp0-2.safetensors", origin="n2", copies=1) is not None
    # A node outside the ring keeps nobody's replica.
    assert _ask("n2", "head.tp0-2.safetensors", copies=1) is not None
