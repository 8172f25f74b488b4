"""Piece transfer throughput: the state service over gRPC against a plain socket copy.

    python bench/transfer.py [--size-mib 256] [--repeats 5] [--dir DIR]

Both servers run in their own process (as on another node) on loopback and send the same
file; both receivers write it to a file in DIR and fsync it. The gRPC receiver is
`StateClient.fetch_piece` as shipped (sha256 verified, atomic rename); the socket receiver
does the least a copy can do (`sendfile` → `recv_into` → `write`). Runs alternate so both
see the same machine load; the table gives medians. Prints a markdown table.
"""

from __future__ import annotations

import argparse
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
    store.commit(STEP, num_layers=1)
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
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="where files are written")
    parser.add_argument("--fsync", action="store_true", help="fsync every received file")
    parser.add_argument("--serve-grpc", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--serve-socket", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_grpc:
        _serve_grpc(args.serve_grpc, args.chunk_mib << 20)
        return 0
    if args.serve_socket:
        _serve_socket(args.serve_socket)
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
