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


@dataclass(frozen=True)
class Phase:
    """One batched exchange (a single `batch_isend_irecv`), then at most one op.

    The send an op owes (a forward's output to the next stage, a backward's input gradient to
    the previous one) is made together with the receive the following op needs, as
    Megatron's `send_forward_recv_backward` does: NCCL orders the p2p of a communicator on one
    stream, so a receive that blocks while a send to the same neighbour is still queued could
    wait on a peer that waits on us. The engine finishes a phase's send before it posts the
    next phase, so each sent buffer is freed one phase after it was made, whatever the
    micro-batch count.
    """

    send: Op | None  # the op whose output is sent now
    recv: Op | None  # the op whose input is received now
    run: Op | None  # the op computed after the exchange; None in a final, send-only phase


def sends(op: Op, stage: int, pp: int) -> bool:
    """Whether `op` on `stage` sends its result to a neighbour."""
    return stage < pp - 1 if op.kind == FORWARD else stage > 0


def receives(op: Op, stage: int, pp: int) -> bool:
    """Whether `op` on `stage` needs its input from a neighbour."""
    return stage > 0 if op.kind == FORWARD else stage < pp - 1


def p2p_phases(kind: str, pp: int, stage: int, microbatches: int) -> list[Phase]:
    """The schedule of `schedule_ops` as phases: each op's receive batched with the send the
    op before it owes; a final phase sends what the last op owes."""
    phases: list[Phase] = []
    owed: Op | None = None
    for op in schedule_ops(kind, pp, stage, microbatches):
        phases.append(Phase(owed, op if receives(op, stage, pp) else None, op))
        owed = op if sends(op, stage, pp) else None
    if owed is not None:
        phases.append(Phase(owed, None, None))
    return phases
