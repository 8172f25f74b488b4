"""`elasticpp job`: a job as etcd holds it, also once every agent is gone.

    elasticpp job status --etcd HOST:PORT --name JOB
    elasticpp job nodes  --etcd HOST:PORT --name JOB
    elasticpp job stop   --etcd HOST:PORT --name JOB     end it at a step boundary, checkpointed
    elasticpp job reset  --etcd HOST:PORT --name JOB     a failed, halted, stopped job runs again
    elasticpp job delete --etcd HOST:PORT --name JOB     every key of the job (not while agents run)
    elasticpp job cordon --etcd HOST:PORT --name JOB --node N   plan nothing more onto node N
    elasticpp job uncordon --etcd HOST:PORT --name JOB --node N
    elasticpp job events --etcd HOST:PORT --name JOB [--since 10m] [--follow]
    elasticpp job checkpoint --etcd HOST:PORT --name JOB   persist the newest step, now
    elasticpp job whatif --nodes N (--etcd HOST:PORT --name JOB | --spec FILE --slots S)

Each prints a table, or `-o json|yaml` (elasticpp.cli.output).

`status` says how the job stands (`running`, `waiting`, `stopping`, `finished`, `failed`,
`halted`, `stopped`, or `absent`) from its records: its spec, epoch, generation record,
leader, members, quarantines, safe step, stop request, end record and done barrier. `stop`
asks the running job to stop and waits (`--wait`) until it ended: every agent stops its
workers at the same step boundary, commits that step and persists it (with the job's
`persist_dir`), then the leader ends the job as `stopped` and the agents exit 0 (or idle, as
`--on-job-end` says); exit 1 if it has not ended within `--wait` (the request stays).
`reset` deletes the end record of a job that failed, halted or was stopped (and the
quarantines that led there, and the stop request), so that agents started again train it on
from its newest committed step; a finished or running job is refused. `delete` removes the job's
keys, refused while an agent is registered unless `--force`. `cordon` sets a node aside as
Kubernetes cordons one: it is planned into no new generation, and the leader moves the job
off it at a step boundary (recomputing nothing, as off a draining node) unless that would
leave fewer than `min_nodes`; its agent stays up, a spare; `uncordon` lets it be planned
again (a join). `whatif` says what the leader
would plan for N nodes (layout, micro-batch, gradient accumulation, estimated step time),
from the job's spec in etcd or a spec file, with the planner call the leader makes. The etcd
flags are the agent's.
"""

from __future__ import annotations

import argparse
from typing import Any

from elasticpp.cli import flagtypes
from elasticpp.cli.etcdflags import add_etcd_flags, etcd_from_args
from elasticpp.cli.output import add_output_flag, emit, message_table
from elasticpp.cluster.keys import check_name
from elasticpp.errors import ConfigError


def add_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="job_command", required=True)
    for name, help_text in (
        ("status", "how the job stands, from etcd"),
        ("nodes", "the job's nodes: address, slots, ranks, draining, quarantine, version"),
        ("stop", "stop the job at a step boundary, its step committed and persisted"),
        ("reset", "let a failed, halted or stopped job run again"),
        ("delete", "delete every key of the job"),
        ("cordon", "plan no new generation onto a node: the job moves off it at a step boundary"),
        ("uncordon", "let a cordoned node be planned again"),
        (
            "events",
            "what happened to the job: generations, recoveries, quarantines, cordons, its end",
        ),
        ("checkpoint", "persist a checkpoint now: the newest step every node holds"),
        ("whatif", "the layout, micro-batches and step time the leader would plan for N nodes"),
    ):
        sp = sub.add_parser(name, help=help_text, description=help_text)
        whatif = name == "whatif"
        sp.add_argument(
            "--name",
            type=flagtypes.name,
            required=not whatif,
            default=None,
            help="the job spec's name" + (" (the spec stored in etcd)" if whatif else ""),
        )
        add_etcd_flags(sp, required=not whatif)
        add_output_flag(sp)
        if name == "delete":
            sp.add_argument("--force", action="store_true", help="also while agents are registered")
        if name == "events":
            sp.add_argument(
                "--since",
                type=flagtypes.since,
                default=None,
                help="leave out what came before: a duration back from now (10m, 2h, 1d) or "
                "an ISO 8601 time",
            )
            sp.add_argument(
                "--follow", action="store_true", help="keep reading, and print each new event"
            )
            sp.add_argument(
                "--every",
                type=flagtypes.positive_float,
                default=2.0,
                help="with --follow: seconds between two reads of etcd",
            )
        if name in ("cordon", "uncordon"):
            sp.add_argument("--node", type=flagtypes.name, required=True, help="the node id")
        reasons = {
            "cordon": "the cordon record and the agents' events",
            "stop": "the job's end record and the agents' events",
            "checkpoint": "the agents' events",
        }
        if name in reasons:
            sp.add_argument(
                "--reason",
                type=flagtypes.nonempty,
                default=f"elasticpp job {name}",
                help=f"why, for {reasons[name]}",
            )
        waits = {
            "stop": (1200.0, "seconds to wait for the job to end (0: ask and return)"),
            "checkpoint": (900.0, "seconds to wait for every node's answers and its pieces"),
        }
        if name in waits:
            default, help_text = waits[name]
            sp.add_argument(
                "--wait", type=flagtypes.nonnegative_float, default=default, help=help_text
            )
        if name == "stop":
            sp.add_argument(
                "--if-running",
                action="store_true",
                help="nothing to stop (no such job, no agent registered, or the job ended "
                "already) is not an error: exit 0 and say so (a teardown hook's use)",
            )
        if whatif:
            sp.add_argument(
                "--nodes", type=flagtypes.positive_int, required=True, help="the node count N"
            )
            sp.add_argument(
                "--slots",
                type=flagtypes.positive_int,
                default=None,
                help="workers (GPUs) per node (default: the registered agents' slots)",
            )
            sp.add_argument(
                "--spec",
                type=flagtypes.path,
                default=None,
                help="a job spec file, instead of the spec in etcd (etcd is then not read)",
            )


def _client(args: argparse.Namespace) -> Any:
    from elasticpp.cluster.client import ClusterClient

    check_name("--name", args.name)
    endpoints, security = etcd_from_args(args)
    return ClusterClient(list(endpoints), args.name, security=security, prefix=args.etcd_prefix)


def job_status(client: Any) -> dict[str, Any]:
    """How the job stands, from its records in etcd."""
    spec = client.spec()
    if spec is None:
        return {"name": client.job, "state": "absent"}
    epoch = client.epoch()
    record, _ = client.read_generation()
    members = client.members().nodes
    end = client.health.job_end()
    stop = client.requests.stop_request()
    done, _ = client.arrivals.barrier_state("done")
    safe, _ = client.commits.read_safe()
    quarantined = client.health.quarantined()
    cordoned = client.requests.cordoned()
    if end is not None:
        state = end.status
    elif done:
        state = "finished"
    elif stop is not None:
        state = "stopping"
    elif record is not None and members:
        state = "running"
    else:
        state = "waiting"  # for agents (none registered), or for min_nodes of them
    out: dict[str, Any] = {
        "name": client.job,
        "state": state,
        "epoch": None if epoch is None else epoch.epoch,
        "generation": None if record is None else record.generation,
        "layout": None,
        "planned_nodes": [] if record is None else sorted(record.planned_set),
        "leader": client.leader(),
        "members": sorted(members),
        "quarantined": {n: q.reason for n, q in sorted(quarantined.items())},
        "cordoned": {n: c.reason for n, c in sorted(cordoned.items())},
        "safe_step": None if safe is None else safe.step,
        "trained_steps": max((int(v.get("step", -1)) for v in done.values()), default=None),
        "stop": None if stop is None else stop.to_dict(),
        "end": None if end is None else end.to_dict(),
    }
    if record is not None:
        plan = record.plan if isinstance(record.plan, dict) else {}
        out["layout"] = {k: plan.get(k) for k in ("pp", "tp", "dp")}
    return out


def job_nodes(client: Any) -> list[dict[str, Any]]:
    """Every node the job knows: its registered agents, and the nodes its plan or its
    quarantines name (an agent that is gone shows without an address)."""
    members = client.members().nodes
    record, _ = client.read_generation()
    quarantined = client.health.quarantined()
    cordoned = client.requests.cordoned()
    ranks: dict[str, int] = {}
    if record is not None and isinstance(record.plan, dict):
        placement = record.plan.get("placement")
        runs = placement.get("node_runs") if isinstance(placement, dict) else None
        for run in runs if isinstance(runs, list) else []:
            if isinstance(run, list) and len(run) == 2 and isinstance(run[0], str):
                ranks[run[0]] = ranks.get(run[0], 0) + int(run[1])
    planned = set() if record is None else set(record.planned_set)
    out = []
    for node in sorted(set(members) | planned | set(quarantined) | set(cordoned)):
        info = members.get(node, {})
        q, c = quarantined.get(node), cordoned.get(node)
        out.append(
            {
                "node_id": node,
                "registered": node in members,
                "address": info.get("address"),
                "slots": info.get("slots"),
                "ranks": ranks.get(node, 0),
                "planned": node in planned,
                "draining": bool(info.get("draining")),
                "quarantined": None if q is None else q.reason,
                "cordoned": None if c is None else c.reason,
                "version": info.get("version"),
            }
        )
    return out


def _nodes_table(nodes: list[dict[str, Any]]) -> str:
    head = ("NODE", "ADDRESS", "SLOTS", "RANKS", "STATE", "VERSION")
    rows = [head]
    for n in nodes:
        state = (
            "quarantined" if n["quarantined"] else "draining" if n["draining"]
            else "cordoned" if n["cordoned"] else "planned" if n["planned"]
            else "gone" if not n["registered"] else "spare"
        )  # fmt: skip
        rows.append(
            (
                n["node_id"],
                n["address"] or "-",
                str(n["slots"] if n["slots"] is not None else "-"),
                str(n["ranks"]),
                state,
                n["version"] or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)  # fmt: skip


def _table(status: dict[str, Any]) -> str:
    rows = [("job", status["name"]), ("state", status["state"])]
    if status["state"] != "absent":
        layout = status["layout"]
        rows += [
            ("epoch", str(status["epoch"])),
            ("generation", str(status["generation"])),
            (
                "layout",
                "-" if not layout else "pp={pp},tp={tp},dp={dp}".format(**layout),
            ),
            ("planned nodes", ", ".join(status["planned_nodes"]) or "-"),
            ("leader", status["leader"] or "-"),
            ("members", ", ".join(status["members"]) or "-"),
            ("safe step", "-" if status["safe_step"] is None else str(status["safe_step"])),
        ]
        for node, reason in status["quarantined"].items():
            rows.append(("quarantined", f"{node}: {reason}"))
        for node, reason in status["cordoned"].items():
            rows.append(("cordoned", f"{node}: {reason}"))
        if status["trained_steps"] is not None:
            rows.append(("trained steps", str(status["trained_steps"])))
        stop = status["stop"]
        if stop is not None and status["end"] is None:
            rows.append(("stop", f"asked by {stop['by']}: {stop['reason']}"))
        end = status["end"]
        if end is not None:
            rows.append(("ended", f"{end['status']} by {end['by']}: {end['reason']}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _stop(client: Any, args: argparse.Namespace, status: dict[str, Any]) -> int:
    """Ask the job to stop; wait for its end (the leader writes it once every agent has
    committed and persisted its step). 0 once stopped, 1 if not within `--wait`."""
    import getpass
    import socket
    import time

    state = status["state"]
    if state == "stopped":
        end = status["end"]
        emit({"job": args.name, "state": state, "end": end,
              "message": f"job {args.name}: stopped already ({end['reason']})"},
             args.output, message_table)  # fmt: skip
        return 0
    if state in ("finished", "failed", "halted"):
        why = f"job {args.name} is {state} already: there is nothing to stop"
        if args.if_running:
            return _nothing_to_stop(args, state, why)
        raise ConfigError(why)
    if not status["members"]:
        why = (
            f"job {args.name}: no agent is registered, so none could stop it at a step; its "
            "newest committed steps stay where they are (`job status`, `job delete`)"
        )
        if args.if_running:
            return _nothing_to_stop(args, state, why)
        raise ConfigError(why)
    request = client.requests.request_stop(
        by=f"{getpass.getuser()}@{socket.gethostname()}", reason=args.reason
    )
    deadline = time.monotonic() + args.wait
    end = client.health.job_end()
    while end is None and time.monotonic() < deadline:
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        end = client.health.job_end()
    if end is None:
        message = (
            f"job {args.name}: stop asked by {request.by}"
            + (f"; not ended within {args.wait:.0f} s: " if args.wait else ": ")
            + "it ends once every agent has stopped its workers at a step boundary and "
            "committed and persisted that step (`job status` says when)"
        )
        emit({"job": args.name, "state": "stopping", "stop": request.to_dict(),
              "message": message}, args.output, message_table)  # fmt: skip
        return 1 if args.wait else 0
    message = f"job {args.name}: {end.status} at step {end.step} ({end.reason})"
    emit({"job": args.name, "state": end.status, "end": end.to_dict(), "message": message},
         args.output, message_table)  # fmt: skip
    return 0 if end.status == "stopped" else 1


def _cordon(client: Any, args: argparse.Namespace, status: dict[str, Any]) -> int:
    """Cordon or uncordon `--node`; doing it again is said, and not an error."""
    import getpass
    import socket

    node = args.node
    if args.job_command == "uncordon":
        done = client.requests.uncordon(node)
        message = (
            f"job {args.name}: node {node} uncordoned; the leader plans it again at its next turn"
            if done
            else f"job {args.name}: node {node} is not cordoned"
        )
        emit({"job": args.name, "node_id": node, "cordoned": False, "changed": done,
              "message": message}, args.output, message_table)  # fmt: skip
        return 0
    if node not in status["members"] and node not in status["planned_nodes"]:
        known = ", ".join(status["members"]) or "none"
        raise ConfigError(f"--node {node}: not a node of job {args.name} (registered: {known})")
    by = f"{getpass.getuser()}@{socket.gethostname()}"
    created, record = client.requests.cordon(node, by, args.reason)
    message = (
        f"job {args.name}: node {node} cordoned; the job moves off it at a step boundary "
        "(its agent stays, a spare)"
        if created
        else f"job {args.name}: node {node} is cordoned already (by {record.by}: {record.reason})"
    )
    emit({"job": args.name, "node_id": node, "cordoned": True, "changed": created,
          "record": record.to_dict(), "message": message}, args.output, message_table)  # fmt: skip
    return 0


def _nothing_to_stop(args: argparse.Namespace, state: str, why: str) -> int:
    """`job stop --if-running` of a job with nothing to stop: said, and not an error."""
    emit({"job": args.name, "state": state, "message": why}, args.output, message_table)
    return 0


def whatif(spec: Any, nodes: int, slots: int) -> dict[str, Any]:
    """What the leader would plan for `nodes` agents of `slots` workers each: the same
    planner call (elasticpp.agent.leader.step), with the job's model, device and batch; at
    most `max_nodes` of them in the plan, the others spares."""
    from elasticpp.plan import ClusterSpec, NodeSpec
    from elasticpp.plan.search import plan as plan_layout

    if nodes < spec.min_nodes:
        raise ConfigError(
            f"--nodes {nodes}: below the job's min_nodes {spec.min_nodes}, the job waits "
            "for more agents instead of training"
        )
    planned = min(nodes, spec.max_nodes)
    device = spec.device_spec()
    width = len(str(planned - 1))
    cluster = ClusterSpec(
        tuple(NodeSpec(f"node-{i:0{width}d}", slots) for i in range(planned)), device
    )
    result = plan_layout(
        spec.model, cluster, spec.global_batch, micro_batch=spec.micro_batch, top_k=0
    )
    best = result.candidates[0]
    return {
        "job": spec.name,
        "model": spec.model.name,
        "device": device.name,
        "global_batch": spec.global_batch,
        "nodes": nodes,
        "planned_nodes": planned,
        "spare_nodes": nodes - planned,
        "slots_per_node": slots,
        "gpus": cluster.total_gpus,
        **best.to_dict(),
        # Each replica's micro-batches are its gradient accumulation steps.
        "grad_accumulation": list(best.microbatches),
    }


def _whatif_table(w: dict[str, Any]) -> str:
    spares = f", {w['spare_nodes']} spare (max_nodes)" if w["spare_nodes"] else ""
    layout = f"pp={w['pp']} tp={w['tp']} dp={w['dp']}"
    rows = [
        ("job", f"{w['job']} ({w['model']} on {w['device']}, global batch {w['global_batch']})"),
        ("nodes", f"{w['planned_nodes']} planned x {w['slots_per_node']} slots{spares}"),
        ("layout", f"{layout} ({w['gpus_used']} of {w['gpus']} GPUs)"),
        ("micro-batch", f"{w['micro_batch']}, recompute {'on' if w['recompute'] else 'off'}"),
        ("grad accumulation", f"{_runs(w['grad_accumulation'])} micro-batches per replica"),
        ("est. step time", f"{w['est_step_seconds']:.3f} s"),
        ("bubble", f"{100 * w['bubble_fraction']:.1f} %"),
        ("memory per GPU", f"{w['memory_gib']:.1f} GiB"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _runs(values: list[int]) -> str:
    from elasticpp.cli.plan import runs

    return runs(values)


def _whatif(args: argparse.Namespace) -> int:
    from elasticpp.agent.jobspec import JobSpec, load_job_spec

    slots = args.slots
    if args.spec is not None:
        spec = load_job_spec(args.spec)
        if slots is None:
            raise ConfigError("--slots is needed with --spec: the workers of each node")
    else:
        if args.name is None or args.etcd is None:
            raise ConfigError("whatif needs --spec FILE, or --etcd and --name of a job in etcd")
        with _client(args) as client:
            text = client.spec()
            if text is None:
                raise ConfigError(
                    f"job {args.name}: no such job in etcd (prefix {args.etcd_prefix})"
                )
            spec = JobSpec.from_json(text)
            if slots is None:
                counts = {info.get("slots") for info in client.members().nodes.values()}
                if len(counts) != 1 or not isinstance(next(iter(counts)), int):
                    raise ConfigError(
                        f"job {args.name}: --slots is needed (the registered agents' slots "
                        f"are {sorted(map(str, counts)) or 'none'})"
                    )
                slots = int(next(iter(counts)))  # type: ignore[arg-type]
    emit(whatif(spec, args.nodes, slots), args.output, _whatif_table)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.job_command == "whatif":
        return _whatif(args)
    with _client(args) as client:
        if args.job_command == "events":
            from elasticpp.cli import jobevents

            return jobevents.run(client, args)
        views = {"nodes": (job_nodes, _nodes_table), "status": (job_status, _table)}
        if args.job_command in views:
            read, table = views[args.job_command]
            emit(read(client), args.output, table)
            return 0
        status = job_status(client)
        if status["state"] == "absent":
            why = f"job {args.name}: no such job in etcd (prefix {args.etcd_prefix})"
            if args.job_command == "stop" and args.if_running:
                return _nothing_to_stop(args, "absent", why)
            raise ConfigError(why)
        if args.job_command == "stop":
            return _stop(client, args, status)
        if args.job_command in ("cordon", "uncordon"):
            return _cordon(client, args, status)
        if args.job_command == "checkpoint":
            from elasticpp.cli import jobcheckpoint

            return jobcheckpoint.run(client, args, status)
        if args.job_command == "reset":
            if status["state"] not in ("failed", "halted", "stopped"):
                raise ConfigError(
                    f"job {args.name} is {status['state']}: only a failed, halted or stopped "
                    "job is reset (a finished one trained every step; a running one is not over)"
                )
            client.health.reset_end()
            for node in status["quarantined"]:
                client.health.lift_quarantine(node)
            message = (
                f"job {args.name}: reset ({status['state']} before); agents started again "
                f"train it on from its newest committed step"
            )
            emit({"job": args.name, "state_before": status["state"], "message": message},
                 args.output, message_table)  # fmt: skip
            return 0
        if status["members"] and not args.force:
            raise ConfigError(
                f"job {args.name}: agents are registered ({', '.join(status['members'])}): "
                "stop them first, or --force"
            )
        deleted = client.delete_job()
        message = f"job {args.name}: {deleted} key(s) deleted"
        emit({"job": args.name, "deleted_keys": deleted, "message": message},
             args.output, message_table)  # fmt: skip
        return 0
