"""Piece transfer throughput: the state service over gRPC against a plain socket copy.

    python bench/transfer.py [--size-mib 256] [--repeats 5] [--dir DIR] [--fsync]
    python bench/transfer.py --train [--model tiny] [--layout pp=2] [--steps 30]

Both servers run in their own process (as on another node) on loopback and send the same
file; both receivers write it to a file in DIR and fsync it. The gRPC receiver is
`StateClient.fetch_piece` as shipped (sha256 verified, atomic rename); the socket receiver
does the least a copy can do (`sendfile` → `recv_into` → `write`). Runs alternate so both
see the same machine load; the table gives medians. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PIECE = "block.0000.tp0-1.safetensors"
NODE = "node-src"
STEP = 1


def _make_store(root: Path, size: int) -> str:
    from elasticpp.plan.specs import default_units
    from elasticpp.store.local import LocalStore

    store = LocalStore(root, NODE)
    step_dir = store.own_dir / f"step-{STEP:010d}"
    step_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with (step_dir / PIECE).open("wb") as f:
        left = size
        while left:
            block = os.urandom(min(left, 16 << 20))
            f.write(block)
            digest.update(block)
            left -= len(block)
    sha = digest.hexdigest()
    store.record_pieces(STEP, [{"name": PIECE, "size": size, "sha256": sha}])
    store.commit(STEP, units=default_units(1))
    return sha


def _serve_grpc(root: Path, chunk_bytes: int) -> None:
    from elasticpp.store.local import LocalStore
    from elasticpp.store.service import serve

    server, port = serve(LocalStore(root, NODE), lambda: 0, chunk_bytes=chunk_bytes)
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop(0)


def _serve_socket(path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        with conn, path.open("rb") as f:
            conn.sendfile(f)


def _socket_fetch(port: int, dest: Path, *, verify: bool, fsync: bool) -> None:
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    digest = hashlib.sha256()
    with socket.create_connection(("127.0.0.1", port)) as conn, dest.open("wb") as f:
        while n := conn.recv_into(buf):
            f.write(view[:n])
            if verify:
                digest.update(view[:n])
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def _spawn(*args: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.stdin:
        proc.stdin.close()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 9)
    proc.wait()


def run_transfer(
    size_mib: int, repeats: int, chunk_mib: int, work: Path, *, fsync: bool
) -> list[str]:
    from elasticpp.store.client import StateClient

    size = size_mib << 20
    src_root = work / "src"
    sha = _make_store(src_root, size)
    src_file = src_root / "own" / f"step-{STEP:010d}" / PIECE
    dest = work / "dest"
    dest.mkdir(exist_ok=True)
    grpc_proc, grpc_port = _spawn("--serve-grpc", str(src_root), "--chunk-mib", str(chunk_mib))
    sock_proc, sock_port = _spawn("--serve-socket", str(src_file))
    results: dict[str, list[float]] = {"socket": [], "socket+sha256": [], "grpc": []}
    try:
        with StateClient(f"127.0.0.1:{grpc_port}") as client:
            client.list_steps(0)  # connect before timing
            for _ in range(repeats):
                for name in results:
                    out = dest / name
                    t0 = time.perf_counter()
                    if name == "grpc":
                        client.fetch_piece(STEP, PIECE, NODE, out, sha, 0, fsync=fsync)
                    else:
                        _socket_fetch(sock_port, out, verify=name == "socket+sha256", fsync=fsync)
                    results[name].append(size_mib / (time.perf_counter() - t0))
                    if out.stat().st_size != size:
                        raise RuntimeError(f"{name}: received {out.stat().st_size} bytes")
                    out.unlink()
    finally:
        _kill(grpc_proc)
        _kill(sock_proc)
    base = statistics.median(results["socket"])
    rows = [
        f"Piece transfer on loopback, {size_mib} MiB piece, {chunk_mib} MiB chunks, "
        f"{'with' if fsync else 'without'} fsync, {repeats} alternating runs each",
        "",
        "| receiver | MiB/s (median) | min | max | vs socket copy |",
        "|---|---:|---:|---:|---:|",
    ]
    labels = {
        "socket": "plain socket copy (`sendfile` → `recv_into` → file)",
        "socket+sha256": "plain socket copy + sha256 of the bytes",
        "grpc": "gRPC FetchPiece (`StateClient.fetch_piece`: sha256 verified, rename)",
    }
    for name, values in results.items():
        med = statistics.median(values)
        rows.append(
            f"| {labels[name]} | {med:.0f} | {min(values):.0f} | {max(values):.0f} | "
            f"{med / base:.2f}× |"
        )
    return rows


def run_snapshot_cost(model_name: str, layout_text: str, steps: int, repeats: int) -> list[str]:
    """Step time of `elasticpp train`'s engine with snapshots to a store every step vs none.

    Runs alternate (off, on, off, on, ...) so both see the same machine load. With
    snapshots on, every step's pieces are recorded and committed into a `LocalStore` as the
    agent does (timed separately: it runs in the agent, not on the workers' critical path).
    """
    from elasticpp.plan.layout import Layout, build_plan
    from elasticpp.plan.specs import ClusterSpec, load_device_spec, load_model_spec
    from elasticpp.store.local import LocalStore
    from elasticpp.train.config import TrainConfig
    from elasticpp.train.worker.launch import kill_all, run_local, spawn_workers

    layout = Layout.parse(layout_text)
    plan = build_plan(
        load_model_spec(model_name),
        ClusterSpec.uniform(1, layout.world_size, load_device_spec("cpu")),
        layout,
        global_batch=16,
        micro_batch=2,
    )
    job = TrainConfig(steps=steps)
    step_s: dict[str, list[float]] = {"off": [], "on": []}
    store_s: list[float] = []
    work = Path(tempfile.mkdtemp(prefix="elasticpp-bench-train-"))
    try:
        for i in range(repeats):
            for mode in ("off", "on"):
                store = LocalStore(work / f"store-{i}", "node-0") if mode == "on" else None
                workers = spawn_workers(plan.gpus_used, work / "logs", tag=f"{mode}{i}")
                try:
                    result = run_local(
                        plan,
                        job,
                        workers,
                        snapshot_dir=None if store is None else store.own_dir,
                        snapshot_every=1 if store is not None else 0,
                        num_threads=1,
                    )
                finally:
                    kill_all(workers)
                # The first steps warm up allocators and the data loader; leave them out.
                step_s[mode] += [r["step_seconds"] for r in result.records[3:]]
                if store is not None:
                    by_step: dict[int, list[dict[str, object]]] = {}
                    for ev in result.snapshots:
                        by_step.setdefault(int(ev["step"]), []).extend(ev["pieces"])
                    for step, pieces in sorted(by_step.items()):
                        t0 = time.perf_counter()
                        store.record_pieces(step, pieces)  # type: ignore[arg-type]
                        store.commit(step, plan.model.units)
                        store_s.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    off, on = statistics.median(step_s["off"]), statistics.median(step_s["on"])
    return [
        f"Training step time, model {model_name}, {layout}, global batch 16, micro-batch 2, "
        f"{repeats} alternating runs of {steps} steps each (first 3 steps of a run left out)",
        "",
        "| snapshots | step time (median) | vs off |",
        "|---|---:|---:|",
        f"| off | {off * 1000:.1f} ms | 1.000× |",
        f"| every step, handed to the store | {on * 1000:.1f} ms | {on / off:.3f}× |",
        "",
        f"Store bookkeeping per step (record + commit, in the agent): median "
        f"{statistics.median(store_s) * 1000:.2f} ms.",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="where files are written")
    parser.add_argument("--fsync", action="store_true", help="fsync every received file")
    parser.add_argument("--train", action="store_true", help="the snapshot-cost benchmark")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--layout", default="pp=2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--serve-grpc", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--serve-socket", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_grpc:
        _serve_grpc(args.serve_grpc, args.chunk_mib << 20)
        return 0
    if args.serve_socket:
        _serve_socket(args.serve_socket)
        return 0
    if args.train:
        print("\n".join(run_snapshot_cost(args.model, args.layout, args.steps, args.repeats)))
        return 0
    work = Path(tempfile.mkdtemp(prefix="elasticpp-bench-", dir=args.dir))
    try:
        print(
            "\n".join(
                run_transfer(args.size_mib, args.repeats, args.chunk_mib, work, fsync=args.fsync)
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
