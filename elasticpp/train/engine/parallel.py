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
    tie: Any = None  # ProcessGroup across the stages holding tied parameters, or None

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.pp_size - 1

    @classmethod
    def build(
        cls, plan: Plan, rank: int, timeout_s: float, tie_stages: tuple[int, ...] = ()
    ) -> ParallelGroups:
        """Create the groups; the default group must already be initialised.

        `tie_stages`: the pipeline stages holding tied parameters (an embedding shared with
        the LM head); when there are two or more, each (tp, dp) gets a group across them.
        """
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
        tie_group = None
        stages = sorted(set(tie_stages))
        if len(stages) > 1:
            for dp in range(L.dp):
                for tp in range(L.tp):
                    ranks = [rank_of(L, Coord(pp, tp, dp)) for pp in stages]
                    group = dist.new_group(ranks, timeout=timeout)
                    if rank in ranks:
                        tie_group = group
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
            tie=tie_group,
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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits split along the vocabulary across the tp group.

    Each rank holds the logits of its vocabulary slice `[start, start + n)`. The softmax's
    max and normaliser and the target's logit are all-reduced, so no rank ever builds the
    whole `[tokens, vocab]` matrix; the gradient of a rank's slice is its own softmax slice
    minus the one-hot of the targets that fall in it.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, start: int, group: Any
    ) -> torch.Tensor:
        n = logits.shape[-1]
        peak = logits.detach().max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits.detach() - peak.unsqueeze(-1)
        local = targets - start
        outside = (local < 0) | (local >= n)
        index = local.masked_fill(outside, 0)
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(picked, group=group)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, outside)
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, index, outside = ctx.saved_tensors
        g = softmax.clone()
        hit = (~outside).to(g.dtype).unsqueeze(-1)
        g.scatter_add_(-1, index.unsqueeze(-1), -hit)
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, start: int, group: Any
) -> torch.Tensor:
    """Per-token cross-entropy `[...]` of this rank's vocabulary slice of the logits."""
    out: torch.Tensor = _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call]
        logits, targets, start, group
    )
    return out
