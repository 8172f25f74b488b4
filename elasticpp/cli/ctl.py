"""`elasticpp ctl`: status, drain and events of a running agent over gRPC."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_tls_flags(p: argparse.ArgumentParser, *, who: str) -> None:
    """`--tls-cert`, `--tls-key`, `--tls-ca`: mutual TLS (elasticpp.transport)."""
    p.add_argument("--tls-cert", type=Path, default=None, help=f"{who} certificate (PEM)")
    p.add_argument("--tls-key", type=Path, default=None, help="its private key (PEM)")
    p.add_argument("--tls-ca", type=Path, default=None, help="the job's CA certificate (PEM)")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--agent",
        default="127.0.0.1:7430",
        help="the agent's gRPC HOST:PORT, or unix:PATH of its --control-socket",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="RPC deadline in seconds")
    add_tls_flags(p, who="this client's")
    p.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="the agent's control token (drain, lift, events; not needed on its control socket)",
    )
    sub = p.add_subparsers(dest="action", required=True)
    st = sub.add_parser("status", help="generation, layout, workers and recovery timeline")
    st.add_argument(
        "--json",
        action="store_true",
        help="the status as JSON: numbers as numbers, and every field, zeros and empty ones too",
    )
    dr = sub.add_parser("drain", help="move the job off this node, then the agent exits 0")
    dr.add_argument(
        "--wait",
        type=float,
        default=120.0,
        help="seconds the agent waits for the hand-off before exiting anyway",
    )
    sub.add_parser("events", help="stream the agent's decisions")
    lf = sub.add_parser("lift", help="re-admit a quarantined node now (any agent of the job)")
    lf.add_argument("node", help="the quarantined node's id")


def run(args: argparse.Namespace) -> int:
    import grpc

    from elasticpp.errors import ConfigError
    from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc
    from elasticpp.transport import Dialer, TLSFiles, TokenFile

    if args.timeout <= 0:
        raise ConfigError(f"--timeout must be positive, got {args.timeout}")
    tls = TLSFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
    token = TokenFile(args.token_file) if args.token_file is not None else None
    dialer = Dialer(tls, token)
    md = dialer.metadata(args.agent)  # the token, where the channel does not carry it
    with dialer.channel(args.agent) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        try:
            if args.action == "status":
                s = stub.GetStatus(agent_pb2.GetStatusRequest(), timeout=args.timeout)
                if args.json:
                    print(json.dumps(status_dict(s), indent=1))
                else:
                    _print_status(s)
            elif args.action == "lift":
                r = stub.LiftQuarantine(
                    agent_pb2.LiftQuarantineRequest(node_id=args.node),
                    timeout=args.timeout,
                    metadata=md,
                )
                print(r.message)
            elif args.action == "drain":
                r = stub.Drain(
                    agent_pb2.DrainRequest(timeout_s=args.wait), timeout=args.timeout, metadata=md
                )
                print(r.message)
                return 0 if r.accepted else 1
            else:
                for e in stub.WatchEvents(agent_pb2.WatchEventsRequest(), metadata=md):
                    print(f"{e.time:.3f} gen={e.generation} {e.kind}: {e.message}", flush=True)
        except grpc.RpcError as exc:
            code = exc.code()
            print(
                f"elasticpp ctl: {args.agent}: {code.name if code else 'error'}: {exc.details()}",
                file=sys.stderr,
            )
            return 1
    return 0


def status_dict(s: object) -> dict[str, object]:
    """A status as `--json` prints it. Not the bare proto3 JSON mapping: that writes int64
    values as strings (`"generation": "1"`) and leaves out every field at its zero value (a
    rank 0 worker without `rank`, `pp` or `local_rank`, a recovery at step 0 without
    `resume_step`), which a script reading it must then guess. Whole numbers a double holds
    exactly are numbers here (larger ones stay strings, as the mapping says), and every
    field is there."""
    from google.protobuf.json_format import MessageToDict
    from google.protobuf.message import Message

    assert isinstance(s, Message)
    return MessageToDict(
        s,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )


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
