"""One rank of one training step that counts the sent tensors still alive:
`python sends_rank.py RANK WORLD PORT PLAN.json OUT.json`.

Every tensor handed to `isend` (alone or in a `batch_isend_irecv`) is tracked by a weak
reference; at each p2p call the rank counts how many of the tensors it sent earlier are still
referenced by anything. OUT gets {"sent": total, "peak_alive": most alive at once}.
"""

from __future__ import annotations

import json
import sys
import weakref
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

sent: list[weakref.ref[torch.Tensor]] = []
peak = [0]


def _count(new: list[torch.Tensor]) -> None:
    sent.extend(weakref.ref(t) for t in new)
    peak[0] = max(peak[0], sum(1 for r in sent if r() is not None))


def _instrument() -> None:
    isend, batch, p2p_op = dist.isend, dist.batch_isend_irecv, dist.P2POp

    def counting_isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = isend(tensor, *args, **kwargs)
        _count([tensor])
        return work

    def counting_batch(ops: list[Any]) -> Any:
        works = batch(ops)
        _count([op.tensor for op in ops if op.op is isend])
        return works

    def op_of_the_original(op: Any, *args: Any, **kwargs: Any) -> Any:
        # P2POp accepts torch's own isend only; the batch wrapper counts its sends.
        return p2p_op(isend if op is counting_isend else op, *args, **kwargs)

    dist.isend = counting_isend  # type: ignore[assignment]
    dist.P2POp = op_of_the_original  # type: ignore[assignment,misc]
    dist.batch_isend_irecv = counting_batch  # type: ignore[assignment]


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    plan = Plan.from_json(Path(sys.argv[4]).read_text())
    out = Path(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    job = TrainConfig(steps=1)
    model = build_model(plan.model)
    groups = ParallelGroups.build(plan, rank, 60.0, tie_stages(model, plan))
    corpus = open_corpus(job, plan.model.seq_len, plan.model.vocab_size)
    trainer = Trainer(plan, job, groups, corpus, torch.device("cpu"), model)
    trainer.init_fresh()
    trainer.agree_stop(NO_STOP)  # as a worker does: a collective before the first p2p
    _instrument()
    trainer.train_step(0, NO_STOP)
    out.write_text(json.dumps({"sent": len(sent), "peak_alive": peak[0]}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
