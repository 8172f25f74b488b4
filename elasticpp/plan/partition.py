"""Cost-balanced pipeline stages: contiguous block ranges minimising the slowest stage.

Every transformer block costs the same; the first stage also carries the embedding and
the last the final norm, LM head and loss (a vocabulary-sized matmul), so an even split
makes the last stage the bottleneck. `balanced_stages` finds the exact minimum of the
slowest stage: the optimum equals `extra + k * cost` for one of the three stage kinds
(first, middle, last) and some block count `k`, whether a bottleneck is reachable is
monotone in it, and it lies within one block cost of a simple lower bound, so a handful of
candidates is checked in O(1) each (the tests compare it with brute force).

Among the partitions that reach the optimum, the later stages take as many blocks as the
bottleneck allows and the first stage takes the rest: under 1F1B stage `s` keeps `p - s`
micro-batches of activations alive, so the early stages are the ones short of memory.
"""

from __future__ import annotations

import math

from elasticpp.errors import ConfigError, PlanError

# Costs are floats; a bottleneck computed as extra + k*cost must admit k blocks despite rounding.
_SLACK = 1e-9


def _capacity(bottleneck: float, extra: float, block_cost: float) -> int:
    room = (bottleneck - extra) / block_cost
    return max(0, math.floor(room + _SLACK * max(1.0, abs(room))))


def _reachable(
    bottleneck: float,
    num_layers: int,
    pp: int,
    block_cost: float,
    first_extra: float,
    last_extra: float,
) -> bool:
    first = _capacity(bottleneck, first_extra, block_cost)
    last = _capacity(bottleneck, last_extra, block_cost)
    middle = _capacity(bottleneck, 0.0, block_cost)
    if first < 1 or last < 1 or (pp > 2 and middle < 1):
        return False
    return first + last + (pp - 2) * middle >= num_layers


def balanced_stages(
    num_layers: int,
    pp: int,
    block_cost: float,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> tuple[tuple[int, int], ...]:
    """`pp` contiguous, non-empty `[first, end)` block ranges minimising the slowest stage.

    A stage's cost is `blocks * block_cost`, plus `first_extra` on stage 0 and `last_extra`
    on the last stage (both on the single stage when `pp == 1`).
    """
    if pp < 1 or num_layers < 1:
        raise ConfigError(f"stages: pp={pp} and num_layers={num_layers} must be positive")
    if pp > num_layers:
        raise PlanError(f"{pp} pipeline stages for {num_layers} layers: at most one stage a layer")
    if not block_cost > 0 or first_extra < 0 or last_extra < 0:
        raise ConfigError("stages: block_cost must be positive and the extras non-negative")
    if pp == 1:
        return ((0, num_layers),)
    # Every stage has at least one block and all stages carry at most the bottleneck, so it
    # is at least the average load and at least one block plus the larger extra; within one
    # block cost above that bound some stage kind always reaches it (each floor loses less
    # than one block), so only the few `extra + k * cost` values in that window are tried.
    low = max(
        (num_layers * block_cost + first_extra + last_extra) / pp,
        block_cost + max(first_extra, last_extra),
    )
    best = math.inf
    for extra in (first_extra, 0.0, last_extra):
        k = max(1, math.floor((low - extra) / block_cost))
        while extra + k * block_cost <= low + block_cost * (1 + _SLACK) + _SLACK * low:
            candidate = extra + k * block_cost
            if candidate < best and _reachable(
                candidate, num_layers, pp, block_cost, first_extra, last_extra
            ):
                best = candidate
                break
            k += 1
    if best == math.inf:  # unreachable by the argument above; kept as a plain safety net
        best = first_extra + last_extra + num_layers * block_cost
    middle = _capacity(best, 0.0, block_cost)
    counts = [0] * pp
    counts[-1] = min(_capacity(best, last_extra, block_cost), num_layers - (pp - 1))
    remaining = num_layers - counts[-1]
    for s in range(pp - 2, 0, -1):
        counts[s] = min(middle, remaining - s)  # leave one block for each earlier stage
        remaining -= counts[s]
    counts[0] = remaining
    stages, first = [], 0
    for n in counts:
        stages.append((first, first + n))
        first += n
    return tuple(stages)
