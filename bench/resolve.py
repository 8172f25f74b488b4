"""How much CPU the leader spends on a re-plan at scale: `resolve` and the planner.

    .venv/bin/python -m bench.resolve [--nodes 64,256,1024,2048] [--reference-max-nodes 256]
        [--models llama-70b,llama-7b]

The scene, for each model and node count N (8 slots a node): the job ran a plan of the given
layout on nodes n0000.. and committed two anchor steps. Every node holds its own pieces of
both (its ranks' slices of its stage's units, at the plan's tp) and, ring-replicated with
r = 1, a replica of the previous node's. Then one node in the middle is lost; a spare node
takes its place in the same layout, holding nothing, so its ranks fetch their pieces from the
lost node's data-parallel twins. That is what nodes report after a node loss.

Timed (CPU seconds, `time.process_time`, best of `--repeats`, each after a full garbage
collection, so a call pays only for the garbage it makes): `resolve` for the new plan,
the old resolver (`bench/resolve_reference.py`) where N <= `--reference-max-nodes` (it is
O(ranks x pieces x candidates): beyond that it runs for minutes), and `plan()` for the new
cluster (top_k=0). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.resolve_reference import resolve_reference
from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.plan import ClusterSpec, load_device_spec, load_model_spec, plan
from elasticpp.plan.layout import Layout, Plan, build_plan
from elasticpp.plan.specs import ModelSpec, NodeSpec
from elasticpp.store.holdings import NodeHoldings, PieceInfo, StepHolding
from elasticpp.store.resolver import resolve

GPUS_PER_NODE = 8
STEPS = (900, 1000)  # the two anchors every node holds; 1000 is the newest


@dataclass(frozen=True)
class Scene:
    """Holdings after a node loss and the plan that replaces the lost node by a spare."""

    holdings: dict[str, NodeHoldings]
    live: tuple[str, ...]
    target: Plan
    cluster: ClusterSpec
    lost: str


def _piece_size(model: ModelSpec, unit: str, tp: int) -> int:
    """bf16 weights plus fp32 Adam moments and master weights (16 bytes a parameter)."""
    h = model.hidden_size
    params = model.vocab_size * h if unit in ("embed", "head") else 12 * h * h
    return 16 * params // tp


def scene(model: ModelSpec, layout: Layout, nodes: int, device: str = "h100-80g") -> Scene:
    """The holdings `nodes` nodes report after the one in the middle is lost (see the module)."""
    names = [f"n{i:04d}" for i in range(nodes)]
    dev = load_device_spec(device)
    batch = 4 * layout.dp
    old = build_plan(
        model,
        ClusterSpec(tuple(NodeSpec(n, GPUS_PER_NODE) for n in names), dev),
        layout,
        global_batch=batch,
        micro_batch=1,
    )
    own: dict[str, dict[int, dict[str, PieceInfo]]] = {n: {s: {} for s in STEPS} for n in names}
    for slot in old.placement:
        for unit in model.stage_units(old.stages, slot.coord.pp):
            key = PieceKey(unit, slot.coord.tp, layout.tp)
            size = _piece_size(model, unit, layout.tp)
            for step in STEPS:
                # data-parallel twins hold identical state: the same checksum
                sha = f"{key.filename}@{step}".encode().hex()[:64].ljust(64, "0")
                own[slot.node_id][step][key.filename] = PieceInfo(size, sha)
    holdings: dict[str, NodeHoldings] = {}
    for i, node in enumerate(names):
        prev = names[i - 1]
        steps = {
            (origin, step): StepHolding(origin, step, model.units, own[origin][step], 3, 1)
            for origin in (node, prev)
            for step in STEPS
        }
        holdings[node] = NodeHoldings(node, steps)
    lost = names[nodes // 2]
    del holdings[lost]
    new_names = [("spare" if n == lost else n) for n in names]
    cluster = ClusterSpec(tuple(NodeSpec(n, GPUS_PER_NODE) for n in new_names), dev)
    target = build_plan(model, cluster, layout, global_batch=batch, micro_batch=1)
    live = tuple(n for n in new_names)
    return Scene(holdings, live, target.with_generation(4), cluster, lost)


def _best_cpu(repeats: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    best: tuple[float, Any] | None = None
    for _ in range(repeats):
        gc.collect()  # the scene's garbage is not the timed call's to collect
        c0 = time.process_time()
        out = fn()
        cpu = time.process_time() - c0
        if best is None or cpu < best[0]:
            best = (cpu, out)
    assert best is not None
    return best


CASES = (("llama-70b", "pp=8,tp=8"), ("llama-7b", "pp=1,tp=8"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--nodes", default="64,256,1024,2048")
    ap.add_argument("--reference-max-nodes", type=int, default=256)
    ap.add_argument("--models", default=",".join(m for m, _ in CASES))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="h100-80g")
    args = ap.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]

    print(f"{GPUS_PER_NODE} slots a node, {args.device}; CPU seconds (best of {args.repeats})\n")
    print("| model | layout | nodes | ranks | fetches | resolve, old s | resolve, new s | ratio "
          "| plan() s | planner's layout |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for model_name, text in CASES:
        if model_name not in args.models.split(","):
            continue
        model = load_model_spec(model_name)
        for nodes in counts:
            base = Layout.parse(text)
            layout = Layout(base.pp, base.tp, nodes * GPUS_PER_NODE // (base.pp * base.tp))
            sc = scene(model, layout, nodes, args.device)

            def run(fn: Callable[..., Any], sc: Scene = sc) -> Any:
                return fn(sc.holdings, sc.target, live_nodes=sc.live)

            new_s, rp = _best_cpu(args.repeats, lambda: run(resolve))
            old = "not run"
            ratio = ""
            if nodes <= args.reference_max_nodes:
                old_s, ref = _best_cpu(args.repeats, lambda: run(resolve_reference))
                if ref != rp:
                    raise SystemExit(f"{model_name} {nodes} nodes: the resolvers disagree")
                old, ratio = f"{old_s:.3f}", f"{old_s / new_s:.0f}x"
            batch = 4 * layout.dp
            plan_s, result = _best_cpu(
                args.repeats,
                lambda sc=sc, b=batch, m=model: plan(m, sc.cluster, b, micro_batch=1, top_k=0),
            )
            fetches = sum(len(f) for f in rp.fetches.values())
            print(
                f"| {model_name} | {layout} | {nodes:,} | {layout.world_size:,} | {fetches:,} "
                f"| {old} | {new_s:.3f} | {ratio} | {plan_s:.3f} | {result.best.layout} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
