"""How large the job's etcd records grow with the cluster: each record built as the agent
builds it, for N nodes x 8 GPUs and two models, printed in bytes.

    .venv/bin/python bench/records.py [--nodes 64,256,1024,2048]

Models: llama-70b at pp=8 tp=8 (one pipeline stage per node) and llama-7b at pp=1 tp=8 (one
whole replica per node). Node ids look like production ones (`gpu-node-01234`). Holdings are
the steady state: 4 own committed steps and 4 replica steps of the ring predecessor per node
(replication_copies = 1). The resume instruction is the one after a loss: the middle node is
gone and the layout keeps pp and tp with the replicas that still fit; its fetches follow the
resolver's preference (a piece the node holds, its own step before a replica; else the
least-loaded live node holding it as its own; ties by node id), built without the resolver's
all-candidates search, which takes minutes at 2,048 nodes (tests/unit/test_record_sizes.py
checks that both agree on a small cluster).

Values are the bytes etcd stores under one key (the JSON the agent puts); a prefix read is
the sum of keys and values over the prefix (what one range reply carries). Bounds the
control plane aims for: no single value over 64 KiB, no prefix read over 1 MiB (etcd refuses
requests over 1.5 MiB and the client receives at most 4 MiB).
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from elasticpp.agent.actions import ResolveResume
from elasticpp.agent.leader.resume import _resume_instruction
from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.cluster.arrivals import resume_records
from elasticpp.cluster.commits import HISTORY_KEPT
from elasticpp.cluster.health import QuarantineRecord
from elasticpp.cluster.keys import JobKeys
from elasticpp.cluster.records import (
    ANCHORS_REPORTED,
    CommitRecord,
    GenerationRecord,
    GenerationSummary,
    dumps,
    node_fields,
)
from elasticpp.plan import ClusterSpec, NodeSpec, load_model_spec
from elasticpp.plan.layout import Layout, Plan, build_plan
from elasticpp.plan.specs import DEVICE_PRESETS
from elasticpp.store.digest import digest_of
from elasticpp.store.holdings import NodeHoldings, PieceInfo, StepHolding
from elasticpp.store.resolver import Fetch, FetchKind, ResumePlan

KIB, MIB = 1024, 1024 * 1024
VALUE_LIMIT = 64 * KIB  # what one value may take
READ_LIMIT = 1 * MIB  # what one prefix read may return
GPUS = 8
OWN_STEPS, REPLICA_STEPS = 4, 4
STEP0 = 1_000_000  # step numbers of a long job: their digits count
WALL = 1_760_000_000.123456  # a wall-clock time, as time.time() writes it
JOB = JobKeys("llama-pretrain")
INCARNATION = "8d0e5f3a2c9b4e71a6f0d2c4b8e9f1a3"


@dataclass(frozen=True)
class Model:
    label: str
    preset: str
    pp: int
    tp: int


MODELS = (
    Model("llama-70b pp8 tp8", "llama-70b", 8, 8),
    Model("llama-7b pp1 tp8", "llama-7b", 1, 8),
)


def node_ids(n: int) -> list[str]:
    return [f"gpu-node-{i:05d}" for i in range(n)]


def address(node: str) -> str:
    return f"10.{int(node[-5:]) // 256 % 256}.{int(node[-5:]) % 256}.17:7070"


def make_plan(model: Model, nodes: list[str], generation: int) -> Plan:
    spec = load_model_spec(model.preset)
    cluster = ClusterSpec(tuple(NodeSpec(n, GPUS) for n in nodes), DEVICE_PRESETS["h100-80g"])
    dp = len(nodes) * GPUS // (model.pp * model.tp)
    layout = Layout(model.pp, model.tp, dp)
    plan = build_plan(spec, cluster, layout, global_batch=4 * dp, micro_batch=1)
    return plan.with_generation(generation)


def _info(name: str, origin: str, step: int) -> PieceInfo:
    # Pieces of one step are equal bytes on every data-parallel twin; sizes of 70B shards.
    return PieceInfo(1_234_567_890, hashlib.sha256(f"{name}@{step}".encode()).hexdigest())


def own_pieces(plan: Plan, node: str) -> list[str]:
    """The piece names `node`'s ranks write under `plan` (its stage's units, its tp slices)."""
    names: list[str] = []
    for s in plan.ranks_on(node):
        for unit in plan.model.stage_units(plan.stages, s.coord.pp):
            names.append(PieceKey(unit, s.coord.tp, plan.tp).filename)
    return names


def holdings(plan: Plan, node: str, predecessor: str) -> NodeHoldings:
    """Steady state: the node's own newest steps and as many replica steps of its ring
    predecessor (whose replica holder it is)."""
    steps: dict[tuple[str, int], StepHolding] = {}
    units = plan.model.units
    for origin, count in ((node, OWN_STEPS), (predecessor, REPLICA_STEPS)):
        for k in range(count):
            step = STEP0 - k
            pieces = {n: _info(n, origin, step) for n in own_pieces(plan, origin)}
            steps[(origin, step)] = StepHolding(origin, step, units, pieces, plan.generation, 7)
    return NodeHoldings(node, steps)


def resume_after_loss(old: Plan, new: Plan, lost: str) -> ResumePlan:
    """The resolver's choice for `new` when every node but `lost` holds its own pieces of
    `old` at STEP0 and a replica of its ring predecessor's (see the module docstring)."""
    nodes = sorted({s.node_id for s in old.placement})
    pred = {n: nodes[i - 1] for i, n in enumerate(nodes)}
    held = {n: set(own_pieces(old, n)) for n in nodes}
    owners: dict[str, list[str]] = {}
    for n in nodes:
        if n != lost:
            for name in held[n]:
                owners.setdefault(name, []).append(n)
    load: dict[str, int] = dict.fromkeys(nodes, 0)
    heaps: dict[tuple[str, ...], list[tuple[int, str]]] = {}
    on_node: dict[tuple[str, str], Fetch] = {}
    fetches: dict[int, tuple[Fetch, ...]] = {}
    for slot in new.placement:
        node, chosen = slot.node_id, []
        for unit in new.model.stage_units(new.stages, slot.coord.pp):
            name = PieceKey(unit, slot.coord.tp, new.tp).filename
            fetch = on_node.get((node, name))
            if fetch is None:
                info = _info(name, node, STEP0)
                if name in held[node]:
                    fetch = Fetch(name, node, node, FetchKind.LOCAL, *info)
                elif name in held[pred[node]]:  # a replica it keeps (also of the lost node)
                    fetch = Fetch(name, pred[node], node, FetchKind.LOCAL, *info)
                else:
                    heap = heaps.setdefault(tuple(owners[name]), [])
                    if not heap:
                        heap.extend((load[o], o) for o in owners[name])
                        heapq.heapify(heap)
                    _, source = heapq.heappop(heap)
                    load[source] += info.size
                    heapq.heappush(heap, (load[source], source))
                    fetch = Fetch(name, source, source, FetchKind.PEER, *info)
                on_node[(node, name)] = fetch
            chosen.append(fetch)
        fetches[slot.rank] = tuple(chosen)
    return ResumePlan(
        STEP0, new.generation, new.model.units, fetches, {s.rank: s.node_id for s in new.placement}
    )


def _prefix(entries: Iterable[tuple[str, str]]) -> int:
    return sum(len(k.encode()) + len(v.encode()) for k, v in entries)


def _arrival(node: str, value: Any) -> str:
    """A barrier arrival as `ClusterClient.arrive` puts it."""
    return dumps({"node_id": node, "value": value, "at": WALL})


def records(model: Model, n: int) -> dict[str, int]:
    """Record name -> bytes, for `n` nodes of `model`."""
    nodes = node_ids(n)
    generation = 41
    plan = make_plan(model, nodes, generation)
    lost = nodes[n // 2]
    out: dict[str, int] = {}

    members = {
        JOB.node(node): dumps(
            {
                "address": address(node),
                "slots": GPUS,
                "draining": False,
                "incarnation": INCARNATION,
                "pid": 123456,
                "node_id": node,
                "registered_at": WALL,
            }
        )
        for node in nodes
    }
    out["member value"] = max(len(v) for v in members.values())
    out["nodes/ prefix read"] = _prefix(members.items())

    record = GenerationRecord(
        generation=generation,
        plan=plan.to_dict(),
        leader=nodes[0],
        created_at=WALL,
        store_address=address(nodes[0]),
        extra={
            "reason": "lost gpu-node-01024",
            "graceful": False,
            # As the leader writes them (elasticpp.agent.leader.step): every node planned.
            **node_fields(plan.to_dict(), nodes, dict.fromkeys(nodes, INCARNATION)),
            "previous_layout": str(plan.layout),
            "detected_at": WALL,
            "planned_at": WALL,
        },
    )
    # What `ClusterClient.write_generation` puts: the record and its history summary.
    text, summary = record.to_json(), GenerationSummary.of(record).to_json()
    out["generation record"] = len(text)
    out[GENERATION_TXN] = len(text) + len(summary)
    out[HISTORY] = HISTORY_KEPT * len(summary)

    # Every node's holdings have the same shape and ids of one length: one value stands for all.
    # A node arrives with a digest of them; the leader pulls the detail over gRPC.
    i = n // 2
    held = holdings(plan, nodes[i], nodes[i - 1])
    value = {"digest": digest_of(held, address(nodes[i])).to_dict(), "next_step": STEP0 + 1}
    stopped = len(_arrival(nodes[i], {**value, "at": WALL}))
    out["stopped-G value"] = stopped
    out["stopped-G prefix read"] = n * (stopped + len(JOB.barrier(f"stopped-{generation}", lost)))

    survivors = [x for x in nodes if x != lost]
    new = make_plan(model, survivors, generation + 1)
    rp = resume_after_loss(plan, new, lost)
    action = ResolveResume(new.generation, new, {}, tuple(survivors), (STEP0 + 1,), None, WALL)
    value = _resume_instruction(action, rp).value
    # Written as the client writes it: the instruction and, past 48 KiB of pieces, its parts.
    written = [
        len(record) + len(JOB.barrier(f"resume-{new.generation}", member))
        for member, record in resume_records(value, nodes[0], WALL)
    ]
    out["resume instruction (largest value)"] = max(written)
    out["resume txn (instruction + parts)"] = sum(written)

    anchors = tuple(range(STEP0, STEP0 - ANCHORS_REPORTED, -1))
    commits = {
        JOB.commit(generation, x): dumps(
            {
                **CommitRecord(x, generation, STEP0, anchors, {nodes[i - 1]: anchors}).to_dict(),
                "at": WALL,
            }
        )
        for i, x in enumerate(nodes)
    }
    out["commit record"] = max(len(v) for v in commits.values())
    out["commits/G prefix read"] = _prefix(commits.items())

    started = {
        JOB.barrier(f"started-{generation}", x): _arrival(x, {"moved_at": WALL, "at": WALL})
        for x in nodes
    }
    out["started-G prefix read"] = _prefix(started.items())

    quarantine = {
        JOB.quarantine(x): dumps(
            QuarantineRecord(
                x,
                "3 consecutive failed generations (last: worker rank 12345 exited with 1)",
                WALL,
                WALL + 600,
                3,
                "8d0e5f3a2c9b4e71a6f0d2c4b8e9f1a3",
            ).to_dict()
        )
        for x in nodes
    }
    out["quarantine value"] = max(len(v) for v in quarantine.values())
    out["quarantine/ prefix read (every node)"] = _prefix(quarantine.items())

    timeline = _arrival(
        f"gen-{generation}",
        {
            "generation": generation,
            "reason": "lost gpu-node-01024",
            "layout_before": str(plan.layout),
            "layout_after": str(new.layout),
            "resume_step": STEP0,
            "steps_recomputed": 1,
            "detected_at": WALL,
            "planned_s": 0.123456789,
            "stopped_s": 1.23456789,
            "moved_s": 12.3456789,
            "resumed_s": 23.456789,
        },
    )
    out["timeline value"] = len(timeline)
    out["timelines/ prefix read"] = HISTORY_KEPT * (
        len(timeline) + len(JOB.barrier("timelines", f"gen-{generation}"))
    )
    return out


# Records the bounds are checked on: values against VALUE_LIMIT, reads against READ_LIMIT.
VALUES = (
    "member value",
    "generation record",
    "stopped-G value",
    "resume instruction (largest value)",
    "commit record",
    "quarantine value",
    "timeline value",
)


GENERATION_TXN = "generation txn (record + history summary)"

# Stored, not read by any agent: no bound.
HISTORY = f"generations/ history ({HISTORY_KEPT} kept; stored, not read)"


def limit_of(name: str) -> int | None:
    if name == HISTORY:
        return None
    return VALUE_LIMIT if name in VALUES else READ_LIMIT


def table(sizes: Mapping[tuple[str, int], Mapping[str, int]], counts: list[int]) -> str:
    def fmt(b: int) -> str:
        if b < 10 * KIB:
            return f"{b} B"
        return f"{b / KIB:.1f} KiB" if b < MIB else f"{b / MIB:.2f} MiB"

    lines = []
    for model in MODELS:
        lines.append(f"\n{model.label} ({GPUS} GPUs per node)\n")
        lines.append("| record | " + " | ".join(f"{n} nodes" for n in counts) + " | bound |")
        lines.append("|---|" + "---|" * (len(counts) + 1))
        names = list(sizes[(model.label, counts[0])])
        for name in names:
            cells = []
            for n in counts:
                b = sizes[(model.label, n)][name]
                limit = limit_of(name)
                cells.append(fmt(b) + (" **over**" if limit is not None and b > limit else ""))
            bound = limit_of(name)
            shown = "-" if bound is None else fmt(bound)
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {shown} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="64,256,1024,2048")
    args = parser.parse_args()
    counts = [int(c) for c in args.nodes.split(",")]
    sizes = {(m.label, n): records(m, n) for m in MODELS for n in counts}
    print(table(sizes, counts))


if __name__ == "__main__":
    main()
