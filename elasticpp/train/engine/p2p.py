"""A pipeline stage's point-to-point exchange with its neighbours: one phase of
`schedule.p2p_phases` (at most a send and a receive) posted as one `batch_isend_irecv`.

The receive is waited on before the phase's op runs; the send is waited on after it, before
the next exchange is posted, so the transfer (which gloo makes only once the peer has posted
its receive) overlaps the op's compute, as torch's 1F1B does with its warm-up and cool-down
sends. A backend that coalesces the batch into one work (NCCL) has that work waited on whole
before the op. No receive is posted while a send of an earlier phase is unfinished (NCCL
orders p2p per communicator), and the sent tensor is held until its send is finished, then
dropped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# A tensor and the global rank of the neighbour it goes to or comes from; None where the
# stage has no such neighbour (the first stage's input, the last stage's output).
Peer = tuple[torch.Tensor, int | None]


class Sending:
    """A phase's send in flight: its tensor, kept alive until `finish` has waited on it."""

    def __init__(self, tensor: torch.Tensor | None = None, works: list[Any] | None = None) -> None:
        self.tensor, self.works = tensor, works or []

    def finish(self) -> None:
        for work in self.works:
            work.wait()
        self.tensor, self.works = None, []


def exchange(send: Peer | None, recv: Peer | None) -> Sending:
    """Post one phase's p2p. When it returns the received tensor is filled; the send may
    still be in flight, and the caller finishes it before its next exchange."""
    ops = []
    for item, op in ((send, dist.isend), (recv, dist.irecv)):
        if item is None:
            continue
        if item[1] is None:  # p2p_phases pairs no first stage's input, no last stage's output
            raise RuntimeError("a pipeline exchange with a neighbour this stage does not have")
        ops.append(dist.P2POp(op, item[0], item[1]))
    if not ops:
        return Sending()
    works = list(dist.batch_isend_irecv(ops))
    if send is None:
        later: list[Any] = []
    elif recv is None:
        later = works  # a send alone: finished after the op
    elif len(works) == len(ops):
        later = works[:1]  # the send's own work (posted first); the receive's is waited on now
    else:
        later = []  # coalesced (NCCL): one work for both, waited on now
    for work in works[len(later) :]:
        work.wait()
    return Sending(send[0] if send is not None and later else None, later)
