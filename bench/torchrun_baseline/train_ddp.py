"""The torchrun baseline of `bench/recovery.py`: plain DDP on gloo, disk checkpoints.

Launched by `python -m torch.distributed.run` (torchrun), one process per rank. It trains
the same tiny model as elasticpp (the same functional GPT, parameters initialised from
`(seed, unit, name)`, the same byte-window data addressed by global sample index) with the
same global batch `B`: rank r of world w computes samples `k·B + r·B/w ... + B/w - 1` of
step k, and the loss is scaled by `w` so DDP's gradient average is the gradient of
Σ per-sample loss / B, as in elasticpp.

Checkpoints are what a torchrun user writes: every `--ckpt-every` steps rank 0 saves the
parameters and AdamW moments to one safetensors file; every (re)started worker loads the
newest one and redoes the steps since.

Every rank appends JSON lines to `--metrics`: `start` (the process runs, before torch is
imported), `imported`, `pg` (process group formed), `ready` (model built, checkpoint loaded) and one
`step` line per finished step, each with time (unix), rank, world size, pid, torchrun's
restart count and the node name. The benchmark reads them to find the last step before a
kill and the first step after, where the time in between went, and which pids to kill.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

# Taken before torch is imported: the import is part of what a torchrun restart costs.
EXEC_TIME = time.time()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ckpt", type=Path, required=True, help="checkpoint file")
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--metrics", type=Path, required=True, help="JSON lines, appended")
    parser.add_argument("--node", default=os.environ.get("BASELINE_NODE", "node"))
    args = parser.parse_args()

    base: dict[str, Any] = {
        "rank": int(os.environ.get("RANK", "-1")),
        "world": int(os.environ.get("WORLD_SIZE", "0")),
        "pid": os.getpid(),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "node": args.node,
    }

    def emit(event: str, when: float, **extra: Any) -> None:
        # One short O_APPEND write per line: lines of concurrent ranks do not interleave.
        line = json.dumps({"event": event, "time": when, **base, **extra}) + "\n"
        with args.metrics.open("a", encoding="utf-8") as f:
            f.write(line)

    emit("start", EXEC_TIME)
    import torch
    import torch.distributed as dist
    from ddp_model import TinyGPT, load_checkpoint, save_checkpoint

    from elasticpp.train.data.samples import Corpus, load_corpus

    emit("imported", time.time())
    torch.set_num_threads(1)  # as elasticpp's CPU workers: one thread per worker
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    emit("pg", time.time())
    if args.global_batch % world:
        raise SystemExit(f"global batch {args.global_batch} is not divisible by world {world}")
    per_rank = args.global_batch // world

    model = TinyGPT(args.model, args.seed)
    corpus = Corpus(load_corpus(None, 4 << 20), model.spec.seq_len, args.seed)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step = load_checkpoint(args.ckpt, model, opt)
    emit("ready", time.time(), step=step)

    while step < args.steps:
        tokens, targets = corpus.batch(step * args.global_batch + rank * per_rank, per_rank)
        opt.zero_grad(set_to_none=True)
        loss_sum = ddp(tokens, targets)
        # DDP averages gradients over ranks; × world makes it Σ per-sample loss / B.
        (loss_sum * (world / args.global_batch)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        reported = loss_sum.detach() / args.global_batch
        dist.all_reduce(reported)
        if rank == 0 and (step + 1) % args.ckpt_every == 0:
            save_checkpoint(args.ckpt, model, opt, step + 1)
        emit("step", time.time(), step=step, loss=float(reported))
        step += 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
