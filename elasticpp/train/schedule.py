"""Pipeline schedules as pure lists of operations (no torch).

Both schedules flush at every step (synchronous optimizer semantics):

- GPipe: all m forwards, then all m backwards; m micro-batches in flight.
- 1F1B (PipeDream-flush): stage s of p runs min(p - s - 1, m) warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards; at most
  min(p - s, m) micro-batches in flight. Same bubble as GPipe, far less activation memory.
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True)
class Op:
    kind: str  # FORWARD or BACKWARD
    microbatch: int


def schedule_ops(kind: str, pp: int, stage: int, microbatches: int) -> list[Op]:
    """The order in which stage `stage` of `pp` runs its `microbatches` forwards and backwards."""
    m = microbatches
    if kind == "gpipe":
        return [Op(FORWARD, i) for i in range(m)] + [Op(BACKWARD, i) for i in range(m)]
    if kind != "1f1b":
        raise ValueError(f"unknown schedule {kind!r}")
    warmup = min(pp - stage - 1, m)
    ops = [Op(FORWARD, i) for i in range(warmup)]
    for i in range(m - warmup):
        ops.append(Op(FORWARD, warmup + i))
        ops.append(Op(BACKWARD, i))
    ops += [Op(BACKWARD, i) for i in range(m - warmup, m)]
    return ops


def max_in_flight(ops: list[Op]) -> int:
    """The most micro-batches whose forward is done and backward is not."""
    live = peak = 0
    for op in ops:
        live += 1 if op.kind == FORWARD else -1
        peak = max(peak, live)
    return peak
