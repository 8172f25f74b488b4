"""`elasticpp plan`: the fastest layout for a cluster, with the runner-ups.

Pure planning (no torch, etcd or grpc), so it answers in well under a second even for
thousands of nodes. Output is a readable table, or one object with `-o json|yaml` (`--json`
is `-o json`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from elasticpp.cli import flagtypes
from elasticpp.cli.output import add_output_flag, emit

JSON_FORMAT_VERSION = 1


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=flagtypes.nonempty,
        required=True,
        help="a preset, a YAML/JSON spec file, a Hugging Face model directory, or "
        "package.module:function",
    )
    parser.add_argument(
        "--global-batch",
        type=flagtypes.positive_int,
        required=True,
        help="samples per optimizer step (B)",
    )
    positive = flagtypes.positive_int
    parser.add_argument("--nodes", type=positive, default=1, help="number of nodes (default 1)")
    parser.add_argument(
        "--gpus-per-node", type=positive, default=8, help="GPUs per node (default 8)"
    )
    parser.add_argument(
        "--node-gpus",
        type=flagtypes.node_gpus,
        metavar="N,N,...",
        help="healthy GPUs of each node, for uneven clusters (replaces --nodes/--gpus-per-node)",
    )
    parser.add_argument(
        "--device",
        type=flagtypes.device_preset,
        default="a100-80g",
        help="device preset (default a100-80g)",
    )
    parser.add_argument("--seq-len", type=positive, help="override the model's sequence length")
    parser.add_argument("--micro-batch", type=positive, help="fix the micro-batch size b")
    parser.add_argument(
        "--top",
        type=flagtypes.nonnegative_int,
        default=5,
        metavar="K",
        help="runner-ups to show (default 5)",
    )
    add_output_flag(parser, json_alias=True)
    parser.add_argument(
        "--plan-out",
        type=flagtypes.path,
        metavar="FILE",
        help="also write the full plan (with placement) as JSON",
    )


def _cluster(args: argparse.Namespace, device: Any) -> Any:
    from elasticpp.plan import ClusterSpec, NodeSpec

    if args.node_gpus:
        counts = [int(x) for x in args.node_gpus.split(",") if x.strip()]  # flagtypes.node_gpus
        width = len(str(len(counts) - 1))
        nodes = tuple(NodeSpec(f"node-{i:0{width}d}", c) for i, c in enumerate(counts))
        return ClusterSpec(nodes, device)
    return ClusterSpec.uniform(args.nodes, args.gpus_per_node, device)


def run(args: argparse.Namespace) -> int:
    from elasticpp.plan import Planner, load_device_spec
    from elasticpp.train.model.modelref import resolve_model  # torch only for a user's function

    model = resolve_model(args.model, seq_len=args.seq_len).spec
    device = load_device_spec(args.device)
    cluster = _cluster(args, device)
    planner = Planner(model, device, args.global_batch, micro_batch=args.micro_batch)
    result = planner.plan(cluster, top_k=args.top)
    if args.plan_out:
        Path(args.plan_out).write_text(result.best.to_json() + "\n", encoding="utf-8")
    best, *others = result.candidates
    out = {
        "format_version": JSON_FORMAT_VERSION,
        "model": model.name,
        "device": device.name,
        "nodes": len(cluster.nodes),
        "gpus": cluster.total_gpus,
        "global_batch": args.global_batch,
        **best.to_dict(),
        "alternatives": [c.to_dict() for c in others],
    }
    emit(
        out,
        args.output,
        lambda _: _render(model, device, cluster, args.global_batch, result.candidates),
    )
    return 0


def runs(values: list[int]) -> str:
    """`[96, 96, 95]` -> `96 (x2), 95`: run-length, so thousands of replicas stay one line."""
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        parts.append(f"{values[i]} (x{j - i})" if j - i > 1 else str(values[i]))
        i = j
    return ", ".join(parts)


def _render(model: Any, device: Any, cluster: Any, global_batch: int, candidates: list[Any]) -> str:
    best = candidates[0]
    L = best.layout
    nodes = len(cluster.nodes)
    gpus = cluster.total_gpus
    blocks = [end - first for first, end in best.stages]
    per_node = (
        f"{cluster.nodes[0].gpus} GPUs each"
        if len({n.gpus for n in cluster.nodes}) == 1
        else "uneven GPUs"
    )
    lines = [
        f"{model.name} on {nodes} node(s), {per_node} ({gpus} x {device.name}), "
        f"global batch {global_batch}, sequence {model.seq_len}",
        "",
        f"  layout            pp={L.pp} tp={L.tp} dp={L.dp}   ({best.gpus_used} of {gpus} GPUs)",
        f"  micro-batch       {best.micro_batch}    recompute {'on' if best.recompute else 'off'}",
        f"  micro-batches     {runs(list(best.microbatches))} per replica   "
        f"({sum(best.microbatches)} x b={best.micro_batch} = {global_batch} samples)",
        f"  blocks per stage  {runs(blocks)}   (embedding on stage 0, head on stage {L.pp - 1})",
        f"  est. step time    {best.est_step_seconds:.3f} s   "
        f"bubble {100 * best.bubble_fraction:.1f} %",
        f"  memory per GPU    {best.memory_gib:.1f} GiB of {device.memory_gib:g} GiB",
        "",
        "  rank = (dp_index * pp + pp_index) * tp + tp_index; TP groups fill nodes in order",
    ]
    if len(candidates) > 1:
        lines += ["", f"next best ({len(candidates) - 1}):"]
        header = (
            "#",
            "pp",
            "tp",
            "dp",
            "b",
            "recomp",
            "GPUs",
            "step s",
            "vs best",
            "bubble",
            "GiB",
        )
        rows = [header]
        for i, c in enumerate(candidates[1:], 1):
            rows.append(
                (
                    str(i),
                    str(c.layout.pp),
                    str(c.layout.tp),
                    str(c.layout.dp),
                    str(c.micro_batch),
                    "on" if c.recompute else "off",
                    str(c.gpus_used),
                    f"{c.est_step_seconds:.3f}",
                    f"+{100 * (c.est_step_seconds / best.est_step_seconds - 1):.1f} %",
                    f"{100 * c.bubble_fraction:.1f} %",
                    f"{c.memory_gib:.1f}",
                )
            )
        widths = [max(len(r[k]) for r in rows) for k in range(len(header))]
        for r in rows:
            lines.append("  " + "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
    return "\n".join(lines)
