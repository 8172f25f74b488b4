"""The engine's device-dependent choices: the AdamW kernel.

Invariants:
- The optimizer is torch's AdamW, fused where the device has the kernel, else foreach, over
  the engine's own fp32 parameters and moments (updated in place, so snapshots and
  checkpoints read the same tensors). Its update is the per-parameter AdamW of the design:
  decoupled weight decay on the parameters flagged for it, bias-corrected moments, `eps`
  added after the square root.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Devices with torch's fused AdamW kernel (CPU's since torch 2.4).
FUSED_DEVICES = frozenset({"cuda", "cpu"})


class AdamW:
    """torch's AdamW over tensors the caller owns; `step` takes each step's lr and grads."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        exp_avg: Sequence[torch.Tensor],
        exp_avg_sq: Sequence[torch.Tensor],
        decay: Sequence[bool],
        *,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        step: int,
        fused: bool | None = None,
    ) -> None:
        """`fused`: torch's fused kernel (True) or its foreach one (False); by default the
        fused one where every parameter's device has it."""
        self.params = list(params)
        if fused is None:
            fused = {p.device.type for p in self.params} <= FUSED_DEVICES
        self.fused = fused
        groups: list[dict[str, Any]] = []
        for wd, flag in ((weight_decay, True), (0.0, False)):
            members = [p for p, d in zip(self.params, decay, strict=True) if d == flag]
            if members:
                groups.append({"params": members, "weight_decay": wd})
        self._opt = torch.optim.AdamW(
            groups,
            lr=0.0,
            betas=betas,
            eps=eps,
            fused=self.fused or None,
            foreach=None if self.fused else True,
        )
        for p, m1, m2 in zip(self.params, exp_avg, exp_avg_sq, strict=True):
            # The fused kernel reads the step count on the device; foreach on the host.
            where = p.device if self.fused else torch.device("cpu")
            self._opt.state[p] = {
                "step": torch.tensor(float(step), dtype=torch.float32, device=where),
                "exp_avg": m1,
                "exp_avg_sq": m2,
            }

    def step(self, grads: Sequence[torch.Tensor], lr: float, scale: float = 1.0) -> None:
        """One update with `grads` (the parameters' own `.grad` tensors, scaled in place)."""
        if scale != 1.0:
            torch._foreach_mul_(list(grads), scale)
        for p, g in zip(self.params, grads, strict=True):
            if p.grad is not g:
                p.grad = g
        for group in self._opt.param_groups:
            group["lr"] = lr
        self._opt.step()
