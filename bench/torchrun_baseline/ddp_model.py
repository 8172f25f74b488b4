"""elasticpp's tiny model as a plain `nn.Module` for DDP, and a safetensors checkpoint.

Imported by `train_ddp.py` after it has noted its start time, so the import of torch that
this module pulls in counts as part of a torchrun restart.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from elasticpp.plan import load_model_spec
from elasticpp.train.model.contract import init_unit
from elasticpp.train.model.families import build_model
from elasticpp.train.model.stage import Stage


class TinyGPT(torch.nn.Module):
    """elasticpp's functional model on one stage, its tensors as registered parameters."""

    def __init__(self, model_name: str, seed: int) -> None:
        super().__init__()
        self.spec = load_model_spec(model_name)
        self.stage = Stage.for_stage(
            build_model(self.spec), self.spec, ((0, self.spec.num_layers),), 0
        )
        # ParameterDict keys may not contain '.', so units and names are flattened.
        self.flat = torch.nn.ParameterDict()
        self.names: list[tuple[str, str]] = []
        for unit in self.stage.units:
            for name, tensor in init_unit(unit, seed, 0, 1).items():
                self.flat[_key(unit.name, name)] = torch.nn.Parameter(tensor)
                self.names.append((unit.name, name))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        params: dict[str, dict[str, torch.Tensor]] = {}
        for unit, name in self.names:
            params.setdefault(unit, {})[name] = self.flat[_key(unit, name)]
        return self.stage.forward(params, tokens, 0, 1, None, None, targets)


def _key(unit: str, name: str) -> str:
    return f"{unit}__{name}".replace(".", "_")


def save_checkpoint(path: Path, model: TinyGPT, opt: torch.optim.Optimizer, next_step: int) -> None:
    """Parameters and AdamW moments; tmp + rename: a kill never leaves half a checkpoint."""
    tensors: dict[str, torch.Tensor] = {}
    for key, p in model.flat.items():
        tensors[f"param/{key}"] = p.detach().clone()
        state = opt.state.get(p, {})
        if state:
            tensors[f"exp_avg/{key}"] = state["exp_avg"].clone()
            tensors[f"exp_avg_sq/{key}"] = state["exp_avg_sq"].clone()
            tensors[f"adam_step/{key}"] = torch.as_tensor(state["step"]).reshape(1).clone()
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"next_step": str(next_step)})
    os.replace(tmp, path)


def load_checkpoint(path: Path, model: TinyGPT, opt: torch.optim.Optimizer) -> int:
    """Restore the newest checkpoint, if any; returns the step to train next."""
    if not path.is_file():
        return 0
    with safe_open(str(path), framework="pt") as f:
        next_step = int((f.metadata() or {})["next_step"])
    tensors = load_file(str(path))
    with torch.no_grad():
        for key, p in model.flat.items():
            p.copy_(tensors[f"param/{key}"])
            if f"exp_avg/{key}" in tensors:
                opt.state[p] = {
                    "step": tensors[f"adam_step/{key}"].reshape(()).clone(),
                    "exp_avg": tensors[f"exp_avg/{key}"].clone(),
                    "exp_avg_sq": tensors[f"exp_avg_sq/{key}"].clone(),
                }
    return next_step
