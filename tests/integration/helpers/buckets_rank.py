"""One rank of two training steps that records where its data-parallel all-reduces are
issued: `python buckets_rank.py RANK WORLD PORT PLAN.json OUT.json BUCKET_CAP_BYTES`.

`torch.autograd.backward` is wrapped to flag when backward runs, each parameter gets a hook
counting the gradients that backward call has accumulated so far, and `dist.all_reduce` logs,
for each call on the replicas' group, whether backward was running, whether the call was
asynchronous, and that count. OUT gets {"steps": one list of those records per step,
"params": the parameter count, "losses": the steps' losses}.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elasticpp.plan import Plan
from elasticpp.train.config import TrainConfig
from elasticpp.train.data.samples import open_corpus
from elasticpp.train.engine.parallel import ParallelGroups
from elasticpp.train.engine.trainer import NO_STOP, Trainer, tie_stages
from elasticpp.train.model.families import build_model

in_backward = [False]
accumulated = [0]  # parameters whose gradient the running backward has accumulated
calls: list[dict[str, Any]] = []


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    plan = Plan.from_json(Path(sys.argv[4]).read_text())
    out = Path(sys.argv[5])
    cap = int(sys.argv[6])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    job = TrainConfig(steps=2)
    model = build_model(plan.model)
    groups = ParallelGroups.build(plan, rank, 60.0, tie_stages(model, plan))
    corpus = open_corpus(job, plan.model.seq_len, plan.model.vocab_size)
    trainer = Trainer(plan, job, groups, corpus, torch.device("cpu"), model, bucket_cap_bytes=cap)
    trainer.init_fresh()
    trainer.agree_stop(NO_STOP)
    params = [t for ts in trainer.params.values() for t in ts.values()]
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda _: accumulated.__setitem__(0, accumulated[0] + 1)
        )

    backward, all_reduce = torch.autograd.backward, dist.all_reduce

    def flagged_backward(*args: Any, **kwargs: Any) -> Any:
        in_backward[0] = True
        accumulated[0] = 0
        try:
            return backward(*args, **kwargs)
        finally:
            in_backward[0] = False

    def logged_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("group") is groups.dp:
            calls.append(
                {
                    "in_backward": in_backward[0],
                    "async": bool(kwargs.get("async_op", False)),
                    "grads_ready": accumulated[0],
                }
            )
        return all_reduce(tensor, *args, **kwargs)

    torch.autograd.backward = flagged_backward  # type: ignore[assignment]
    dist.all_reduce = logged_all_reduce  # type: ignore[assignment]
    steps, losses = [], []
    for step in range(2):
        calls.clear()
        losses.append(trainer.train_step(step, NO_STOP).loss)
        steps.append(list(calls))
    out.write_text(json.dumps({"steps": steps, "params": len(params), "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
