"""The pipeline baseline of `bench/steady.py`: torch's own `Schedule1F1B` on gloo.

Launched by `python -m torch.distributed.run --nproc-per-node=P`, one process per stage. The
model is elasticpp's functional model (parameters initialised from `(seed, unit, name)`) cut
at the same unit boundaries as elasticpp's planner cuts it for `pp=P`, each stage wrapped in
an `nn.Module`; the data is the same byte windows addressed by global sample index. A step is
`Schedule1F1B.step` over the global batch `B` in `B / b` micro-batches, a clip of the true
global gradient norm (one all-reduce of the squared norms) and torch's AdamW: what a torch
user writes for synchronous 1F1B. The loss of a micro-batch is its summed per-sample loss
divided by `B` and the schedule does not rescale gradients, so a step's gradient is the
gradient of Σ per-sample loss / B, as in elasticpp.

Every rank appends JSON lines to `--metrics`: `ready` once the stage is built, then one `step`
line per finished step with the time (unix), rank and world size.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--metrics", type=Path, required=True, help="JSON lines, appended")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from elasticpp.plan import ClusterSpec, Layout, build_plan, load_device_spec, load_model_spec
    from elasticpp.train.data.samples import Corpus, load_corpus
    from elasticpp.train.model.contract import init_unit
    from elasticpp.train.model.families import build_model
    from elasticpp.train.model.stage import Stage

    torch.set_num_threads(1)  # as elasticpp's CPU workers: one thread per worker
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base: dict[str, Any] = {"rank": rank, "world": world, "pid": os.getpid()}

    def emit(event: str, **extra: Any) -> None:
        line = json.dumps({"event": event, "time": time.time(), **base, **extra}) + "\n"
        with args.metrics.open("a", encoding="utf-8") as f:
            f.write(line)

    spec = load_model_spec(args.model)
    B, b = args.global_batch, args.micro_batch
    if B % b:
        raise SystemExit(f"global batch {B} is not a multiple of micro-batch {b}")
    # The same cut as elasticpp's planner makes for this layout.
    plan = build_plan(
        spec,
        ClusterSpec.uniform(1, world, load_device_spec("cpu")),
        Layout(pp=world, tp=1, dp=1),
        global_batch=B,
        micro_batch=b,
    )
    stage = Stage.for_stage(build_model(spec), spec, plan.stages, rank)

    class StageModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # ParameterDict keys may not contain '.', so units and names are flattened.
            self.flat = torch.nn.ParameterDict()
            self.names: list[tuple[str, str]] = []
            for unit in stage.units:
                for name, tensor in init_unit(unit, args.seed, 0, 1).items():
                    self.flat[f"{unit.name}__{name}".replace(".", "_")] = torch.nn.Parameter(tensor)
                    self.names.append((unit.name, name))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            params: dict[str, dict[str, torch.Tensor]] = {}
            for unit, name in self.names:
                params.setdefault(unit, {})[name] = self.flat[f"{unit}__{name}".replace(".", "_")]
            return stage.forward(params, x, 0, 1, None, None, None)  # last stage: logits

    module = StageModule()

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Per sample the mean token cross-entropy (elasticpp's default loss), summed, / B.
        per_token = F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), reduction="none"
        )
        return per_token.view(targets.shape).mean(dim=1).sum() / B

    pipe_stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(pipe_stage, B // b, loss_fn=loss_fn, scale_grads=False)
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    corpus = Corpus(load_corpus(None, 4 << 20), spec.seq_len, args.seed)
    emit("ready")
    for step in range(args.steps):
        tokens, targets = corpus.batch(step * B, B)
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(tokens)
        elif rank == world - 1:
            schedule.step(target=targets)
        else:
            schedule.step()
        # Clip by the global norm: every stage's squared norm, summed over the pipeline.
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        sq = torch.stack([g.pow(2).sum() for g in grads]).sum().reshape(1)
        dist.all_reduce(sq)
        scale = min(1.0, 1.0 / (float(sq.sqrt()) + 1e-6))
        if scale < 1.0:
            torch._foreach_mul_(grads, scale)
        opt.step()
        emit("step", step=step)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
