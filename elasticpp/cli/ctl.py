"""`elasticpp ctl`: status, drain, events and lift of a running agent over gRPC; each
prints its result as a table, JSON or YAML (`-o`, elasticpp.cli.output)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from elasticpp.cli import flagtypes
from elasticpp.cli.output import add_output_flag, emit, emit_item, message_table, proto_dict


def add_tls_flags(p: argparse.ArgumentParser, *, who: str) -> None:
    """`--tls-cert`, `--tls-key`, `--tls-ca`: mutual TLS (elasticpp.transport)."""
    p.add_argument("--tls-cert", type=flagtypes.path, default=None, help=f"{who} certificate (PEM)")
    p.add_argument("--tls-key", type=flagtypes.path, default=None, help="its private key (PEM)")
    p.add_argument(
        "--tls-ca", type=flagtypes.path, default=None, help="the job's CA certificate (PEM)"
    )


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--agent",
        type=flagtypes.agent_address,
        default="127.0.0.1:7430",
        help="the agent's gRPC HOST:PORT, or unix:PATH of its --control-socket",
    )
    p.add_argument(
        "--timeout", type=flagtypes.positive_float, default=10.0, help="RPC deadline in seconds"
    )
    add_tls_flags(p, who="this client's")
    p.add_argument(
        "--token-file",
        type=flagtypes.path,
        default=None,
        help="the agent's control token (drain, lift, events; not needed on its control socket)",
    )
    sub = p.add_subparsers(dest="action", required=True)
    st = sub.add_parser("status", help="generation, layout, workers and recovery timeline")
    add_output_flag(st, json_alias=True)
    dr = sub.add_parser("drain", help="move the job off this node, then the agent exits 0")
    dr.add_argument(
        "--wait",
        type=flagtypes.nonnegative_float,
        default=120.0,
        help="seconds the agent waits for the hand-off before exiting anyway",
    )
    add_output_flag(dr)
    ev = sub.add_parser("events", help="stream the agent's decisions")
    add_output_flag(ev)
    lf = sub.add_parser("lift", help="re-admit a quarantined node now (any agent of the job)")
    lf.add_argument("node", type=flagtypes.name, help="the quarantined node's id")
    add_output_flag(lf)


def run(args: argparse.Namespace) -> int:
    import grpc

    from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc
    from elasticpp.transport import Dialer, TLSFiles, TokenFile

    tls = TLSFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
    token = TokenFile(args.token_file) if args.token_file is not None else None
    dialer = Dialer(tls, token)
    md = dialer.metadata(args.agent)  # the token, where the channel does not carry it
    with dialer.channel(args.agent) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        try:
            if args.action == "status":
                s = stub.GetStatus(agent_pb2.GetStatusRequest(), timeout=args.timeout)
                if args.output == "table":
                    _print_status(s)
                else:
                    emit(proto_dict(s), args.output, str)
            elif args.action == "lift":
                r = stub.LiftQuarantine(
                    agent_pb2.LiftQuarantineRequest(node_id=args.node),
                    timeout=args.timeout,
                    metadata=md,
                )
                emit(proto_dict(r), args.output, message_table)
            elif args.action == "drain":
                r = stub.Drain(
                    agent_pb2.DrainRequest(timeout_s=args.wait), timeout=args.timeout, metadata=md
                )
                emit(proto_dict(r), args.output, message_table)
                return 0 if r.accepted else 1
            else:
                for e in stub.WatchEvents(agent_pb2.WatchEventsRequest(), metadata=md):
                    emit_item(proto_dict(e), args.output, _event_line)
        except grpc.RpcError as exc:
            code = exc.code()
            print(
                f"elasticpp ctl: {args.agent}: {code.name if code else 'error'}: {exc.details()}",
                file=sys.stderr,
            )
            return 1
    return 0


def _event_line(e: dict[str, Any]) -> str:
    return f"{e['time']:.3f} gen={e['generation']} {e['kind']}: {e['message']}"


def _print_status(s: object) -> None:
    from elasticpp.rpc.agent.v1 import agent_pb2

    assert isinstance(s, agent_pb2.GetStatusResponse)
    print(f"node {s.node_id}  job {s.job}  generation {s.generation}  leader {s.leader}")
    print(
        f"phase {s.phase}  layout {s.layout or '-'}  last step {s.last_step}  "
        f"loss {s.last_loss:.4f}  members {', '.join(s.members)}"
    )
    if s.ended:
        print(f"job ended: {s.ended}")
    if s.waiting:
        print(f"waiting for state: {s.waiting}")
    for q in s.quarantined:
        until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(q.until))
        print(f"quarantined {q.node_id} until {until} (the {q.count}. time): {q.reason}")
    for w in s.workers:
        print(
            f"  rank {w.rank:3d} (pp={w.pp} tp={w.tp} dp={w.dp}) pid {w.pid} {w.state} "
            f"step {w.last_step}"
        )
    if s.recoveries:
        print("recoveries (seconds after detection):")
        print(
            "  gen  reason                      before -> after                  "
            "planned stopped moved resumed  resume@ recomputed"
        )
        for r in s.recoveries:
            print(
                f"  {r.generation:3d}  {r.reason[:26]:26s}  {r.layout_before or '-':>16s} -> "
                f"{r.layout_after:16s} {r.planned_s:7.2f} {r.stopped_s:7.2f} {r.moved_s:5.2f} "
                f"{r.resumed_s:7.2f}  {r.resume_step:7d} {r.steps_recomputed:10d}"
            )
