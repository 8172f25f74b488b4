"""The engine's device-dependent choices: the AdamW kernel, TF32 matmuls, and step timers.

Invariants:
- The optimizer is torch's AdamW, fused where the device has the kernel, else foreach, over
  the engine's own fp32 parameters and moments (updated in place, so snapshots and
  checkpoints read the same tensors). Its update is the per-parameter AdamW of the design:
  decoupled weight decay on the parameters flagged for it, bias-corrected moments, `eps`
  added after the square root.
- TF32 is allowed for fp32 matmuls and convolutions on CUDA only, and only under fp32
  precision (bf16 autocast computes its matmuls in bf16 already); CPU runs never touch it.
- A timer measures what the device did: CUDA events on CUDA (the host only queues kernels,
  so its clock says when work was queued), the host's `perf_counter` elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim.adamw import adamw

# Devices with torch's fused AdamW kernel (CPU's since torch 2.4).
FUSED_DEVICES = frozenset({"cuda", "cpu"})


def set_tf32(device: torch.device, precision: str) -> bool:
    """Allow TF32 for fp32 matmuls on CUDA under fp32 precision; returns whether it is on."""
    if device.type != "cuda":
        return False
    on = precision == "fp32"
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    return on


def device_name(device: torch.device) -> str:
    """What the agent matches its peak table on: `torch.cuda.get_device_name` of a CUDA
    device ("NVIDIA H100 80GB HBM3"), "cpu" for the CPU."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return device.type


class AdamW:
    """torch's AdamW (its functional form, `torch.optim.adamw.adamw`) over tensors the caller
    owns; `step` takes each step's lr and grads. Not a `torch.optim.Optimizer`: building one
    imports torch's compiler stack (2-3 s of CPU, more on a busy machine), which a rank would
    pay at the start of every generation; the update is the same kernel with the same
    arguments the Optimizer passes it."""

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
        self.betas = betas
        self.eps = eps
        m1, m2, flags = list(exp_avg), list(exp_avg_sq), list(decay)
        if not len(self.params) == len(m1) == len(m2) == len(flags):
            raise ValueError(
                f"AdamW: {len(self.params)} parameters, {len(m1)} and {len(m2)} moments, "
                f"{len(flags)} decay flags"
            )
        # Per weight decay, built once: the indices of its parameters, their parameters and
        # moments, and their step counts (the fused kernel reads the count on the device,
        # foreach on the host). A step only gathers the gradients.
        self._groups: list[tuple[float, list[int], list[list[torch.Tensor]]]] = []
        for wd, flag in ((weight_decay, True), (0.0, False)):
            idx = [i for i, d in enumerate(flags) if d == flag]
            if idx:
                steps = [
                    torch.tensor(
                        float(step),
                        dtype=torch.float32,
                        device=self.params[i].device if fused else torch.device("cpu"),
                    )
                    for i in idx
                ]
                group = [[t[i] for i in idx] for t in (self.params, m1, m2)]
                self._groups.append((wd, idx, [*group, steps]))

    def step(self, grads: Sequence[torch.Tensor], lr: float, scale: float = 1.0) -> None:
        """One update with `grads` (the parameters' own `.grad` tensors, scaled in place)."""
        grads = list(grads)
        if scale != 1.0:
            torch._foreach_mul_(grads, scale)
        for p, g in zip(self.params, grads, strict=True):
            if p.grad is not g:
                p.grad = g
        with torch.no_grad():
            for wd, idx, (params, m1, m2, steps) in self._groups:
                adamw(
                    params,
                    [grads[i] for i in idx],
                    m1,
                    m2,
                    [],
                    steps,
                    foreach=None if self.fused else True,
                    fused=self.fused or None,
                    amsgrad=False,
                    beta1=self.betas[0],
                    beta2=self.betas[1],
                    lr=lr,
                    weight_decay=wd,
                    eps=self.eps,
                    maximize=False,
                )


def warm_up() -> None:
    """Run once what a rank's first step runs once (autograd starts its threads at the first
    backward; the update's kernel is looked up at its first call), so that a warm worker
    that calls this before it says ready pays none of it on the recovery path."""
    w = torch.zeros(2, 2, requires_grad=True)
    (w @ torch.ones(2, 1)).sum().backward()  # type: ignore[no-untyped-call]
    assert w.grad is not None
    opt = AdamW(
        [w],
        [torch.zeros_like(w)],
        [torch.zeros_like(w)],
        [True],
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        step=0,
    )
    opt.step([w.grad], lr=1e-3)


class PhaseTimer:
    """Seconds spent inside named spans of one step (summed per name)."""

    def __init__(
        self, device: torch.device, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.cuda = device.type == "cuda"
        self._clock = clock
        self._spans: dict[str, list[tuple[Any, Any]]] = {}
        self._open: dict[str, Any] = {}

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return self._clock()

    def start(self, name: str) -> None:
        self._open[name] = self._mark()

    def stop(self, name: str) -> None:
        self._spans.setdefault(name, []).append((self._open.pop(name), self._mark()))

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def seconds(self, name: str) -> float:
        """The summed time of `name`'s spans (on CUDA, waits until the last has run)."""
        spans = self._spans.get(name, [])
        if not self.cuda:
            return float(sum(end - start for start, end in spans))
        if spans:
            spans[-1][1].synchronize()
        return float(sum(start.elapsed_time(end) for start, end in spans)) / 1000.0
