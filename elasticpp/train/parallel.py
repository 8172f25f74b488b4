"""Explicit process groups of one plan generation, and the tensor-parallel f/g operators.

No module-level state: a `ParallelGroups` is built for a plan and a rank, passed to
whatever needs it, and thrown away with the generation. Every rank of the world creates
every group in the same order (torch.distributed requires it); groups of one rank are
not created at all, since every rank knows the layout and skips them alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elasticpp.plan import Coord, Plan, coord_of, rank_of


@dataclass(frozen=True)
class ParallelGroups:
    rank: int
    world_size: int
    coord: Coord
    tp_size: int
    pp_size: int
    dp_size: int
    tp: Any  # ProcessGroup of this rank's TP group, or None when tp == 1
    dp: Any  # ProcessGroup of the replicas of this (pp, tp), or None when dp == 1
    prev_rank: int | None  # same (tp, dp) on stage pp - 1; None on the first stage
    next_rank: int | None  # same (tp, dp) on stage pp + 1; None on the last stage

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.pp_size - 1

    @classmethod
    def build(cls, plan: Plan, rank: int, timeout_s: float) -> ParallelGroups:
        """Create the groups; the default group must already be initialised."""
        L = plan.layout
        coord = coord_of(L, rank)
        timeout = timedelta(seconds=timeout_s)
        tp_group = dp_group = None
        if L.tp > 1:
            for dp in range(L.dp):
                for pp in range(L.pp):
                    ranks = [rank_of(L, Coord(pp, t, dp)) for t in range(L.tp)]
                    group = dist.new_group(ranks, timeout=timeout)
                    if rank in ranks:
                        tp_group = group
        if L.dp > 1:
            for pp in range(L.pp):
                for tp in range(L.tp):
                    ranks = [rank_of(L, Coord(pp, tp, d)) for d in range(L.dp)]
                    group = dist.new_group(ranks, timeout=timeout)
                    if rank in ranks:
                        dp_group = group
        prev_rank = rank_of(L, Coord(coord.pp - 1, coord.tp, coord.dp)) if coord.pp > 0 else None
        next_rank = (
            rank_of(L, Coord(coord.pp + 1, coord.tp, coord.dp)) if coord.pp < L.pp - 1 else None
        )
        return cls(
            rank=rank,
            world_size=L.world_size,
            coord=coord,
            tp_size=L.tp,
            pp_size=L.pp,
            dp_size=L.dp,
            tp=tp_group,
            dp=dp_group,
            prev_rank=prev_rank,
            next_rank=next_rank,
        )


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (sums the row-parallel partial products), identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)  # type: ignore[no-untyped-call]


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)  # type: ignore[no-untyped-call]
