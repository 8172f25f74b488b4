"""One pipeline stage of any model on the contract (`elasticpp.train.model.contract`).

A stage holds a dict `unit -> name -> tensor` of this rank's slices (units as the model
declares them); the forward runs the stage's units in order over those dicts, so the state a
piece stores is exactly what the stage trains, with no module tree to map. The first stage
takes token ids; the last returns the summed per-sample loss (or, without targets, the last
unit's output: the logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from elasticpp.plan import ModelSpec
from elasticpp.train.model.contract import DropoutKey, ModelDef, Unit, UnitContext


@dataclass(frozen=True)
class Stage:
    """The units one pipeline stage holds, and its forward pass."""

    model: ModelDef
    units: tuple[Unit, ...]
    is_first: bool
    is_last: bool
    # Full activation recomputation: keep only each block's input and run the block's forward
    # again in the backward pass. Dropout masks are keyed by sample, so the re-run is exact.
    recompute: bool = False
    compiled: bool = False  # blocks run through torch.compile (`TrainConfig.compile`)

    @classmethod
    def for_stage(
        cls,
        model: ModelDef,
        spec: ModelSpec,
        stages: tuple[tuple[int, int], ...],
        pp: int,
        recompute: bool = False,
        compiled: bool = False,
    ) -> Stage:
        names = spec.stage_units(stages, pp)
        return cls(
            model,
            tuple(model.unit(n) for n in names),
            pp == 0,
            pp == len(stages) - 1,
            recompute,
            compiled,
        )

    @property
    def unit_names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units)

    def forward(
        self,
        params: dict[str, dict[str, torch.Tensor]],
        x: torch.Tensor,
        tp_rank: int,
        tp_size: int,
        tp_group: Any,
        key: DropoutKey | None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens (first stage) or a boundary activation in; the next boundary activation, the
        loss sum (last stage, with targets) or the logits (last stage, without) out."""
        ctx = None
        for unit in self.units:
            ctx = UnitContext(unit.name, tp_rank, tp_size, tp_group, self.model.vocab_size, key)
            block = self.model.is_block(unit.name)
            forward = _compiled(unit.forward) if self.compiled and block else unit.forward
            if self.recompute and torch.is_grad_enabled() and block:
                x = torch.utils.checkpoint.checkpoint(
                    forward, ctx, params[unit.name], x, use_reentrant=False
                )
            else:
                x = forward(ctx, params[unit.name], x)
        if self.is_last and targets is not None:
            assert ctx is not None  # a stage holds at least one unit
            return self.model.loss(ctx, x, targets).sum()
        return x


_COMPILED: dict[Any, Any] = {}


def _compiled(forward: Any) -> Any:
    """One compiled function per block function: every block of a model shares its graph
    (the unit's name is not traced), so a stage compiles once per shape."""
    if forward not in _COMPILED:
        _COMPILED[forward] = torch.compile(forward)
    return _COMPILED[forward]
