"""Measure what the planner's `cpu` device preset stands for: gloo latency and bandwidth
between local worker processes, and torch's compute speed on the tiny model on one thread.

    .venv/bin/python bench/calibrate_cpu.py [--ranks 2] [--iters 200] [--model tiny]

Communication: `--ranks` processes on this machine (gloo over loopback, as the tests and
the demo run) time a ping-pong of one small tensor (one-way p2p latency = round trip / 2),
all-reduces of a few sizes, and one large send for bandwidth. The cost model charges a ring
all-reduce over r ranks `2(r-1)` latencies plus `2(r-1)/r * bytes / bandwidth`, so the
printed "per-latency" column divides the small all-reduce's time by `2(r-1)`.

Compute: one thread (`torch.set_num_threads(1)`, what the agent gives each CPU worker)
runs the engine's own transformer block forward + backward, and the block's matmuls alone,
for several micro-batch sizes. FLOPs are the cost model's count, so "implied peak" is the
`peak_tflops` for which the model's `peak * eff(b)` equals the measured speed.

The numbers move with the load on the machine: run it on an idle machine for a floor, on a
busy one for what a test run sees; medians are printed beside the minima.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from elasticpp.plan import load_model_spec
from elasticpp.plan.cost import CostParams, ModelCosts
from elasticpp.train.model.contract import UnitContext, init_unit
from elasticpp.train.model.families import build_model

FLOAT32_BYTES = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _times(fn: Callable[[], Any], iters: int, warmup: int = 10) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _fmt_us(xs: list[float]) -> str:
    return f"min {min(xs) * 1e6:8.0f} us   median {statistics.median(xs) * 1e6:8.0f} us"


def _comm_worker(rank: int, world: int, port: int, iters: int, sizes: list[int], q: Any) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # Ranks pair up (0-1, 2-3, ...) and all pairs talk at once, as TP groups of two and
        # neighbouring pipeline stages do in a run; an odd last rank only joins the barriers.
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]
        peer = rank ^ 1 if rank ^ 1 < world else None
        pair = pairs[rank // 2] if peer is not None else None
        lines: list[str] = []
        small = torch.zeros(1)

        def ping_pong() -> None:
            if peer is None:
                return
            if rank % 2 == 0:
                dist.send(small, peer)
                dist.recv(small, peer)
            else:
                dist.recv(small, peer)
                dist.send(small, peer)

        rtts = _times(ping_pong, iters)
        dist.barrier()
        one_way = [t / 2 for t in rtts]
        lines.append(f"p2p one-way, 4 B (ping-pong / 2)      {_fmt_us(one_way)}")
        cases: list[tuple[str, Any, int, bool]] = [(f"all_reduce x{world}", None, world, True)]
        if world > 2:
            label = f"all_reduce x2, {world // 2} pairs at once"
            cases.insert(0, (label, pair, 2, pair is not None))
        for label, group, ranks, member in cases:
            for nbytes in sizes:
                t = torch.ones(max(1, nbytes // FLOAT32_BYTES))
                n = iters if nbytes <= 1 << 20 else max(5, iters // 20)

                def ar(t: torch.Tensor = t, g: Any = group, member: bool = member) -> None:
                    if member:
                        dist.all_reduce(t, group=g)

                xs = _times(ar, n, warmup=3)
                dist.barrier()
                line = f"{label}, {nbytes:>9} B   {_fmt_us(xs)}"
                if nbytes <= 1 << 14:
                    per = statistics.median(xs) / (2 * (ranks - 1))
                    line += f"   per message (median / 2(r-1)) {per * 1e6:.0f} us"
                else:
                    ring = 2 * (ranks - 1) / ranks * nbytes
                    line += (
                        f"   ~{ring / statistics.median(xs) / 1e9:.2f} GB/s (ring bytes / median)"
                    )
                lines.append(line)
        big = torch.ones((64 << 20) // FLOAT32_BYTES)

        def send_big() -> None:
            if peer is None:
                return
            if rank % 2 == 0:
                dist.send(big, peer)
                dist.recv(small, peer)
            else:
                dist.recv(big, peer)
                dist.send(small, peer)

        sends = _times(send_big, 5, warmup=1)
        lines.append(
            f"p2p 64 MiB send                       {_fmt_us(sends)}   "
            f"~{big.numel() * FLOAT32_BYTES / statistics.median(sends) / 1e9:.2f} GB/s"
        )
        dist.barrier()
        if rank == 0:
            q.put(lines)
    finally:
        dist.destroy_process_group()


def measure_comm(world: int, iters: int, sizes: list[int]) -> list[str]:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_comm_worker, args=(r, world, port, iters, sizes, q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a communication worker failed: {[p.exitcode for p in procs]}")
    lines: list[str] = q.get()
    return lines


def measure_compute(model_name: str, micro_batches: list[int], iters: int) -> list[str]:
    torch.set_num_threads(1)
    model = load_model_spec(model_name)
    mc, params = ModelCosts.of(model), CostParams()
    s, h, f = model.seq_len, model.hidden_size, model.ffn_hidden_size
    unit = build_model(model).blocks[0]
    weights = {k: v.requires_grad_(True) for k, v in init_unit(unit, 0, 0, 1).items()}
    ctx = UnitContext(unit.name, 0, 1, None, model.vocab_size, None)
    lines = []
    for b in micro_batches:
        x = torch.randn(b, s, h, requires_grad=True)

        def fwd_bwd(x: torch.Tensor = x) -> None:
            y = unit.forward(ctx, weights, x)
            torch.autograd.backward(y.sum())

        block = _times(fwd_bwd, iters)
        flops = 3.0 * mc.block_fwd_flops_per_sample * b
        rate = flops / statistics.median(block)
        implied = rate / params.efficiency(b) / 1e12
        a = torch.randn(b * s, h)
        w_qkv, w_o = torch.randn(3 * h, h), torch.randn(h, h)
        w_1, w_2 = torch.randn(f, h), torch.randn(h, f)

        def matmuls(
            a: torch.Tensor = a, ws: tuple[torch.Tensor, ...] = (w_qkv, w_o, w_1, w_2)
        ) -> None:
            F.linear(a, ws[0])
            F.linear(a, ws[1])
            F.linear(F.linear(a, ws[2]), ws[3])

        mm = _times(matmuls, iters)
        mm_flops = 2.0 * b * s * (4 * h * h + 2 * h * f)
        lines.append(
            f"b={b:<2} block fwd+bwd median {statistics.median(block) * 1e6:7.0f} us "
            f"= {rate / 1e9:6.2f} GFLOP/s (implied peak_tflops {implied:.4f}); "
            f"matmuls alone {mm_flops / statistics.median(mm) / 1e9:6.2f} GFLOP/s"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args()
    model = load_model_spec(args.model)
    act = model.seq_len * model.hidden_size * FLOAT32_BYTES  # one sample's boundary activation
    sizes = [4, 2 * act, 1 << 20, 16 << 20]
    print(f"gloo on this machine, {args.ranks} processes, {os.cpu_count()} CPUs")
    for line in measure_comm(args.ranks, args.iters, sizes):
        print("  " + line)
    print(f"\ncompute, {model.name}, one thread (torch {torch.__version__})")
    for line in measure_compute(args.model, [1, 2, 4, 8], args.iters):
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
