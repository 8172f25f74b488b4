"""Which worker errors followed a peer's loss (elasticpp.train.worker.peerloss): the cases
from the backends' own texts, and a real gloo group whose peer process dies."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest

from elasticpp.train.worker.peerloss import followed_a_peer


def test_the_backends_errors_of_a_lost_peer_are_recognised_along_the_chain() -> None:
    gloo = RuntimeError(
        "[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:41891. This is typically caused by a remote worker crashing."
    )
    nccl = RuntimeError("NCCL error: remote process exited or there was a network error")
    assert followed_a_peer(gloo) and followed_a_peer(nccl)
    try:
        try:
            raise gloo
        except RuntimeError as exc:
            raise ValueError("the step failed") from exc
    except ValueError as wrapped:
        assert followed_a_peer(wrapped)  # the cause, not the wrapper, says so
    assert not followed_a_peer(RuntimeError("CUDA error: an illegal memory access"))
    assert not followed_a_peer(ZeroDivisionError("division by zero"))
    assert not followed_a_peer(None)
    timeout = RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete")
    assert not followed_a_peer(timeout)  # a hang is the hang rule's, not a peer's loss


def _rank(rank: int, rendezvous: str, out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(1)  # a peer that dies between two collectives
    try:
        dist.all_reduce(t)
        out.put("no error")
    except BaseException as exc:  # what a worker's main() catches
        out.put(followed_a_peer(exc))


@pytest.mark.timeout(120)
def test_a_real_gloo_collective_whose_peer_died_is_recognised(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rendezvous = str(tmp_path / "rendezvous")
    procs = [ctx.Process(target=_rank, args=(r, rendezvous, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert out.get(timeout=90) is True
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
