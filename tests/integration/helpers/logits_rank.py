"""One rank of a forward pass under a layout, for the tests that compare logits with
`transformers`: `python logits_rank.py RANK WORLD PORT PLAN.json STEP_DIR TOKENS OUT`.

It uses the engine's own parts (the plan's stages, `ParallelGroups`, `Stage`, the checkpoint
loader resharding a tp=1 save for this rank): the last stage's tp rank 0 writes the whole
logits (vocabulary slices gathered) to OUT as safetensors.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from elasticpp.checkpoint.tensors import load_units
from elasticpp.plan import Plan
from elasticpp.train.engine.parallel import ParallelGroups
from elasticpp.train.engine.trainer import tie_stages
from elasticpp.train.model.contract import UnitContext
from elasticpp.train.model.families import build_model
from elasticpp.train.model.stage import Stage


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    plan = Plan.from_json(Path(sys.argv[4]).read_text())
    step_dir, tokens_path, out = Path(sys.argv[5]), Path(sys.argv[6]), Path(sys.argv[7])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    model = build_model(plan.model)
    groups = ParallelGroups.build(plan, rank, 60.0, tie_stages(model, plan))
    c = groups.coord
    stage = Stage.for_stage(model, plan.model, plan.stages, c.pp)
    loaded = load_units(step_dir, stage.unit_names, c.tp, plan.tp)
    params = {
        u: {n.removeprefix("param/"): t for n, t in got.tensors.items() if n.startswith("param/")}
        for u, got in loaded.items()
    }
    tokens = load_file(str(tokens_path))["tokens"]
    with torch.no_grad():
        if groups.is_first_stage:
            x = tokens
        else:
            x = torch.empty(tokens.shape[0], *model.boundary.per_sample)
            dist.recv(x, src=groups.prev_rank)
        y = stage.forward(params, x, c.tp, plan.tp, groups.tp, None)
        if not groups.is_last_stage:
            dist.send(y.contiguous(), dst=groups.next_rank)
        else:
            ctx = UnitContext("logits", c.tp, plan.tp, groups.tp, model.vocab_size, None)
            logits = ctx.gather_vocab(y)
            if c.tp == 0 and c.dp == 0:
                save_file({"logits": logits.contiguous()}, str(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
