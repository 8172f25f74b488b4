"""The data-parallel gradient reduction, overlapped with the step's last backward in buckets
(as DDP does): a bucket's all-reduce is on the wire while backward computes the next ones.

Invariants:
- Every parameter's gradient is a view into one flat bucket buffer (`param.grad`), so the
  micro-batches accumulate into it in place and a bucket is reduced without a copy in or out.
- Buckets hold parameters in reverse declaration order (the order backward finishes them),
  one dtype and device each, up to `cap_bytes` (a larger parameter gets a bucket to itself).
- Hooks count only while armed, i.e. during the step's last backward, when each parameter's
  accumulated gradient becomes final. A bucket is launched (an asynchronous SUM all-reduce over
  the replicas) once all its parameters are final, and buckets launch strictly in index order:
  every replica issues the same collectives in the same order whatever order autograd runs the
  hooks in (NCCL and gloo both match collectives by issue order).
- `finish` launches what the last backward left (a parameter it gave no gradient) and waits on
  every bucket: afterwards each gradient is the sum over the replicas, exactly the sum the
  unbucketed reduction gave (SUM is elementwise), and no work is outstanding.
- Tied parameters (`sum_tied`) are summed after the replicas' reduction: every copy and its
  original end with the sum of all their gradients, across stages through the tie group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20  # DDP's default


def assign_buckets(
    sizes: Sequence[int], kinds: Sequence[object], cap_bytes: int
) -> list[list[int]]:
    """Parameter indices per bucket: reverse order, consecutive, at most `cap_bytes` of one
    kind (dtype and device) each, except a single parameter larger than the cap."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes))):
        if current and (filled + sizes[i] > cap_bytes or kinds[i] != kinds[current[0]]):
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += sizes[i]
    if current:
        buckets.append(current)
    return buckets


class GradReducer:
    """Owns the gradients of `params` (flat bucket buffers) and their reduction over `group`."""

    def __init__(
        self, params: Sequence[torch.Tensor], group: Any, cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES
    ) -> None:
        self.group = group
        members = assign_buckets(
            [p.numel() * p.element_size() for p in params],
            [(p.dtype, p.device) for p in params],
            cap_bytes,
        )
        self.buffers: list[torch.Tensor] = []
        self._bucket_of = [0] * len(params)
        self._size = [len(m) for m in members]
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        for k, idx in enumerate(members):
            first = params[idx[0]]
            buf = torch.zeros(
                sum(params[i].numel() for i in idx), dtype=first.dtype, device=first.device
            )
            offset = 0
            for i in idx:
                p = params[i]
                view = buf[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                self._views.append((p, view))
                self._bucket_of[i] = k
            self.buffers.append(buf)
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(i))  # type: ignore[no-untyped-call]
            for i, p in enumerate(params)
        ]
        self._armed = False
        self._final = [False] * len(params)
        self._pending = list(self._size)
        self._next = 0
        self._works: list[Any] = []

    def zero_grad(self) -> None:
        """Start a step: every gradient zero, each a view into its bucket again."""
        for buf in self.buffers:
            buf.zero_()
        for p, view in self._views:
            p.grad = view

    def arm(self) -> None:
        """The next backward is the step's last: launch each bucket as it becomes final."""
        self._armed = True
        self._final = [False] * len(self._final)
        self._pending = list(self._size)
        self._next = 0
        self._works = []

    def finish(self) -> None:
        """Launch the buckets backward did not, then wait for all of them."""
        if not self._armed:
            raise RuntimeError("finish() without arm(): no step's last backward was announced")
        self._armed = False
        while self._next < len(self.buffers):
            self._launch()
        works, self._works = self._works, []
        for work in works:
            work.wait()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, i: int) -> Any:
        def ready(_: torch.Tensor) -> None:
            if not self._armed or self._final[i]:
                return
            self._final[i] = True
            self._pending[self._bucket_of[i]] -= 1
            while self._next < len(self.buffers) and self._pending[self._next] == 0:
                self._launch()

        return ready

    def _launch(self) -> None:
        buf = self.buffers[self._next]
        self._works.append(dist.all_reduce(buf, group=self.group, async_op=True))
        self._next += 1


def sum_tied(
    grads: Sequence[torch.Tensor],
    tied_to: Sequence[str | None],
    shapes: dict[str, tuple[int, ...]],
    group: Any,
) -> None:
    """Give every tied parameter (and its original) the sum of their gradients, across
    stages through the tie group: shared values get one shared update. `tied_to[i]` is the
    original's key of `grads[i]` (None if untied); `shapes` holds every tied key of the model,
    held here or not, in the same order on every rank: the group's buffers must match."""
    local = [i for i, key in enumerate(tied_to) if key is not None]
    dtype = grads[0].dtype if grads else torch.float32
    device = grads[0].device if grads else torch.device("cpu")
    sums = {k: torch.zeros(shape, dtype=dtype, device=device) for k, shape in shapes.items()}
    for i in local:
        sums[str(tied_to[i])] += grads[i]
    if group is not None:
        flat = torch.cat([t.reshape(-1) for t in sums.values()])
        dist.all_reduce(flat, group=group)
        offset = 0
        for k, t in sums.items():
            sums[k] = flat[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
    for i in local:
        grads[i].copy_(sums[str(tied_to[i])])
