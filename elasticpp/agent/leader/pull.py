"""The leader's pull of holdings detail: the I/O half of a resume (`step` decides).

At `stopped-G` nodes publish digests (elasticpp.store.digest). Once they arrived, the leader's
step asks for a `PullHoldings`; the executor runs `pull_holdings` on a thread of its own and
the result comes back to the step as an observation (`LeaderObservation.pulled`). It reads
what the persistent checkpoint holds, works out from the digests which nodes may be a source
of the steps the resume can reach (`digest.pull_wants`), and lists those steps' pieces from
each of them (`StateClient.list_holdings`, paged), at most `parallel` nodes at a time, all
within `deadline_s`.

Invariants:
- the whole pull ends by its deadline: each listing gets the time left, and a node whose
  listing is not back by then is "unanswered", like a node missing at `stopped-G`;
- a node the deadline left unasked (its turn never came: the leader was too slow) is
  "not asked", never blamed; the step pulls again;
- a node on a newer generation (FAILED_PRECONDITION) is "moved on", never unanswered: it is
  healthy, and the leader's own view is what is behind;
- nothing here raises: an error becomes the result's `error`, which the step reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from pathlib import Path
from typing import Protocol

from elasticpp.agent.leader.state import PulledHoldings
from elasticpp.checkpoint.manifest import JobIdentity
from elasticpp.errors import ElasticppError, StaleGenerationError
from elasticpp.store.checkpoints import checkpoint_holdings
from elasticpp.store.client import StateClient
from elasticpp.store.digest import HoldingsDigest, digest_of, pull_wants
from elasticpp.store.holdings import NodeHoldings

log = logging.getLogger("elasticpp.agent")


class _Lister(Protocol):
    def list_holdings(
        self, generation: int, steps: tuple[int, ...], *, epoch: int, timeout_s: float
    ) -> NodeHoldings: ...

    def close(self) -> None: ...


def pull_holdings(
    generation: int,
    epoch: int,
    digests: Mapping[str, HoldingsDigest],
    units: tuple[str, ...],
    live_nodes: tuple[str, ...],
    persist_dir: str | None,
    job: JobIdentity | None,
    *,
    known: Mapping[str, NodeHoldings] | None = None,
    parallel: int,
    node_timeout_s: float,
    deadline_s: float,
    connect: Callable[[str], _Lister] = StateClient,
    clock: Callable[[], float] = time.monotonic,
) -> PulledHoldings:
    """Pull the detail the resume needs (see the module docstring). `known`: nodes whose
    detail arrived in full at `stopped-G` (an agent of the previous release): they count
    among the holders, and are not asked."""
    start = clock()
    try:
        disk = None
        if persist_dir and Path(persist_dir).is_dir():
            disk = checkpoint_holdings(Path(persist_dir), job)
        everyone = dict(digests)
        for node, held in (known or {}).items():
            everyone[node] = digest_of(held, "known:0")
        wants = pull_wants(everyone, units, live_nodes, disk)
        asked = {n: s for n, s in wants.steps.items() if n in digests}
        listed = _list_all(
            generation,
            epoch,
            digests,
            asked,
            parallel,
            node_timeout_s,
            start + deadline_s,
            connect,
            clock,
        )
    except (ElasticppError, OSError, ValueError) as exc:
        return PulledHoldings(generation, error=f"{type(exc).__name__}: {exc}")
    holdings, unanswered, not_asked, moved_on = listed
    seconds = clock() - start
    log.info(
        "leader: holdings of generation %d pulled from %d of %d node(s) in %.2f s "
        "(%d unanswered, %d not asked, %d on a newer generation)",
        generation,
        len(holdings),
        len(asked),
        seconds,
        len(unanswered),
        len(not_asked),
        len(moved_on),
    )
    holdings.update((n, h) for n, h in (known or {}).items() if n in live_nodes)
    return PulledHoldings(
        generation,
        holdings,
        unanswered,
        tuple(sorted(not_asked)),
        moved_on,
        disk,
        wants.held,
        seconds,
    )


def _list_all(
    generation: int,
    epoch: int,
    digests: Mapping[str, HoldingsDigest],
    wants: Mapping[str, tuple[int, ...]],
    parallel: int,
    node_timeout_s: float,
    deadline: float,
    connect: Callable[[str], _Lister],
    clock: Callable[[], float],
) -> tuple[dict[str, NodeHoldings], dict[str, str], set[str], dict[str, str]]:
    holdings: dict[str, NodeHoldings] = {}
    unanswered: dict[str, str] = {}
    not_asked: set[str] = set()
    moved_on: dict[str, str] = {}
    if not wants:
        return holdings, unanswered, not_asked, moved_on

    def one(node: str, steps: tuple[int, ...]) -> NodeHoldings:
        # A node gets `node_timeout_s` at most: a few that hang must not take every slot
        # until the deadline and leave the others unasked.
        left_s = min(node_timeout_s, deadline - clock())
        if left_s <= 0:
            raise _NotAsked()
        client = connect(digests[node].address)
        try:
            return client.list_holdings(generation, steps, epoch=epoch, timeout_s=left_s)
        finally:
            client.close()

    pool = futures.ThreadPoolExecutor(min(parallel, len(wants)), thread_name_prefix="pull")
    try:
        running = {pool.submit(one, n, s): n for n, s in wants.items()}
        done, late = futures.wait(running, timeout=max(0.0, deadline - clock()))
        for f in done:
            node = running[f]
            exc = f.exception()
            if exc is None:
                held = f.result()
                if held.node_id == node:
                    holdings[node] = held
                else:
                    unanswered[node] = f"answered as {held.node_id!r}"
            elif isinstance(exc, _NotAsked):
                not_asked.add(node)
            elif isinstance(exc, StaleGenerationError):
                moved_on[node] = str(exc)
            else:
                unanswered[node] = f"{type(exc).__name__}: {exc}"
        for f in late:
            if f.cancel():
                not_asked.add(running[f])
            else:
                unanswered[running[f]] = "no answer before the pull's deadline"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return holdings, unanswered, not_asked, moved_on


class _NotAsked(Exception):
    """The pull's deadline passed before this node's turn."""
