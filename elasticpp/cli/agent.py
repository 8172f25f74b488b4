"""`elasticpp agent`: the node daemon."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from elasticpp.cli import flagtypes
from elasticpp.cli.ctl import add_tls_flags
from elasticpp.cli.etcdflags import add_etcd_flags, etcd_from_args

# The logging levels --log-level takes (the Helm chart's `agent.logLevel` enum is the same).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_parser(p: argparse.ArgumentParser) -> None:
    add_etcd_flags(p)
    p.add_argument("--job-spec", required=True, type=flagtypes.path, help="the job's YAML spec")
    p.add_argument(
        "--node-id", required=True, type=flagtypes.name, help="this node's unique id ([a-z0-9._-])"
    )
    p.add_argument(
        "--slots",
        type=flagtypes.positive_int,
        default=None,
        help="workers on this node (default: visible GPUs, else 1 CPU worker)",
    )
    p.add_argument(
        "--listen",
        type=flagtypes.host_port,
        default="0.0.0.0:7430",
        help="gRPC HOST:PORT (port 0: any); a non-loopback one needs --tls-* or --insecure",
    )
    doors = p.add_argument_group("the agent's doors (docs/deploy.md, 'Securing a job')")
    add_tls_flags(doors, who="this node's (its common name the node id)")
    doors.add_argument(
        "--token-file",
        type=flagtypes.path,
        default=None,
        help="bearer token that drain, lift and events need (off the control socket)",
    )
    doors.add_argument(
        "--control-socket",
        type=flagtypes.path,
        default=None,
        help="a local unix socket (mode 0600) for ctl, preStop and ExecStop, token-free",
    )
    doors.add_argument(
        "--health-listen",
        type=flagtypes.host_port_or_empty,
        default="",
        help="HOST:PORT of a plaintext port serving grpc.health.v1 alone (kubelet probes)",
    )
    doors.add_argument(
        "--tls-shared-identity",
        type=flagtypes.nonempty,
        default=None,
        help="common name of a certificate every node shares (weaker: trusted as any node)",
    )
    doors.add_argument(
        "--insecure",
        action="store_true",
        help="on a network you trust: plaintext, unauthenticated gRPC on a non-loopback "
        "--listen, an etcd off loopback reached without a client certificate or user",
    )
    p.add_argument(
        "--advertise-host",
        default="",
        help="host peers use to reach this agent (default: the listen host)",
    )
    p.add_argument(
        "--state-dir",
        required=True,
        type=flagtypes.path,
        help="the node's state dir: store, metrics.jsonl, worker logs",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="worker device (default: cuda when GPUs are visible)",
    )
    p.add_argument(
        "--metrics-port",
        type=flagtypes.port,
        default=9430,
        help="serve Prometheus metrics on this port (0: off)",
    )
    p.add_argument(
        "--metrics-host",
        default="",
        help="address /metrics binds (default: the --listen host)",
    )
    p.add_argument(
        "--on-job-end",
        choices=("exit", "idle"),
        default="exit",
        help="when the job ends: exit (0 finished, 3 failed, 4 halted; for systemd) or "
        "idle, healthy, until removed (for a Kubernetes StatefulSet)",
    )
    p.add_argument(
        "--unfinished-exit-code",
        type=int,
        default=0,
        help="exit status when this agent stops before the job ended (drained, or SIGTERM): "
        "0 by default; not 0 under a Kubernetes Job (a pod that exits 0 completes its index)",
    )
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO",
        help=f"the agent's log level: {', '.join(LOG_LEVELS)} (any case)",
    )
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="the agent's log lines: text, or one JSON object a line (a log pipeline's)",
    )


def _visible_gpus() -> int:
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # no torch CUDA build: CPU workers
        return 0


def _gpu_identity() -> tuple[str, float] | None:
    try:
        import torch

        props = torch.cuda.get_device_properties(0)
        return str(props.name), props.total_memory / 2**30
    except Exception:  # no CUDA device or no CUDA build: no hint
        return None


def check_device_model(device: str | dict[str, object], spec_path: Path) -> None:
    """Refuse CUDA workers under a job spec whose planner device is `cpu` (the default): the
    planner would size every plan for 8 GiB CPU slots (recomputing activations a GPU has
    room for, say), and the job would run slower than it should without a word."""
    from elasticpp.errors import ConfigError
    from elasticpp.plan.specs import DEVICE_PRESETS, gpu_preset

    if not (isinstance(device, str) and device.lower() == "cpu"):
        return
    gpus = ", ".join(n for n in DEVICE_PRESETS if n != "cpu")
    hint = ""
    found = _gpu_identity()
    if found is not None:
        name, memory_gib = found
        preset = gpu_preset(name, memory_gib)
        hint = f"; this node's GPU is {name} ({memory_gib:.0f} GiB): " + (
            f"device: {preset}" if preset else "give its figures"
        )
    raise ConfigError(
        f"job spec {spec_path}: device is 'cpu' (the default), the planner's model of a CPU "
        "slot, but this agent runs its workers on CUDA GPUs (--device cuda): set the job "
        f"spec's device to the GPUs' preset ({gpus}) or to their figures (memory_gib, "
        f"peak_tflops, intra_node_gbps, inter_node_gbps){hint}"
    )


def run(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from elasticpp import logfmt
    from elasticpp.agent.jobspec import load_job_spec
    from elasticpp.agent.lifetime import AgentProcess
    from elasticpp.agent.node import AgentConfig, run_agent
    from elasticpp.errors import ConfigError
    from elasticpp.transport import TLSFiles

    logfmt.configure(getattr(logging, args.log_level), args.log_format, args.node_id)
    spec = load_job_spec(args.job_spec)
    gpus = _visible_gpus() if args.slots is None or args.device is None else 0
    device = args.device or ("cuda" if gpus else "cpu")
    if device == "cuda":
        check_device_model(spec.device, args.job_spec)
    slots = args.slots if args.slots is not None else (gpus or 1)
    if slots < 1:
        raise ConfigError(f"--slots must be >= 1, got {slots}")
    endpoints, security = etcd_from_args(args)
    cfg = AgentConfig(
        node_id=args.node_id,
        etcd=endpoints,
        listen=args.listen,
        advertise_host=args.advertise_host,
        slots=slots,
        state_dir=args.state_dir,
        backend="nccl" if device == "cuda" else "gloo",
        device=device,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        on_job_end=args.on_job_end,
        unfinished_exit_code=args.unfinished_exit_code,
        etcd_security=security,
        etcd_prefix=args.etcd_prefix,
        tls=TLSFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca),
        token_file=args.token_file,
        control_socket=args.control_socket,
        health_listen=args.health_listen,
        tls_shared_identity=args.tls_shared_identity,
        insecure=args.insecure,
    )
    stop = threading.Event()
    process = AgentProcess(spec.stop_timeout_s)  # this process's tree: adopted, and stopped
    process.adopt_orphans()

    def on_signal(signum: int, _frame: object) -> None:
        logging.getLogger("elasticpp.agent").info("signal %d: stopping", signum)
        stop.set()
        process.stop_requested()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def notify(_agent: object) -> None:
        # systemd Type=notify: ready once serving and registered.
        sock = os.environ.get("NOTIFY_SOCKET")
        if sock:
            import socket

            addr = "\0" + sock[1:] if sock.startswith("@") else sock
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                s.sendall(b"READY=1")

    try:
        code = run_agent(cfg, spec, stop_event=stop, on_started=notify)
    finally:
        process.finish()  # what is left of this process's tree, stopped and reaped
    # `run_agent` has released everything this agent held: its workers and spares are
    # killed, its lease revoked, its leadership resigned, its gRPC server stopped. What is
    # left is the interpreter's teardown, which collects and frees every object of torch,
    # grpc and the agent: 5 to 12 s of CPU on a 2-core node busy training, during which
    # a drained or finished node has said it is gone but its process is not. Exit now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
