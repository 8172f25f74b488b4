"""Which commits of one origin a store keeps: a pure rule, separate from the files.

- Commits order by (epoch, generation, step). The newest `keep_steps` in that order always
  stay, so a step recomputed after a rollback is kept over the higher-numbered steps of the
  timeline the job abandoned, and the commits of a new epoch (the job's etcd state started
  afresh, generation numbers restart at 1) are newer than every commit of an older one.
- Anchors and the floor (the replication guarantee, see `elasticpp.store.replicate`): with
  `anchor_every` set, a committed step divisible by it is an anchor. An anchor at or above
  the floor, the newest safe step the node has learnt (monotonic in commit order), stays.
  Before any floor is known every anchor counts as above it.
- Anchors strictly above the floor are capped at `cap` per origin (the oldest beyond it go):
  a stalled replication cannot fill the disk. The cap can break the guarantee only while the
  safe step lags the node's anchors by more than `cap`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from elasticpp.store.holdings import StepHolding

# Anchors kept per origin above the floor while the safe step stalls (a slow or dead node).
ANCHORS_ABOVE_FLOOR = 16

Order = tuple[int, int, int]  # (epoch, generation, step)
_BELOW_ALL: Order = (-1, -1, -1)


@dataclass(frozen=True)
class Retention:
    keep_steps: int = 2
    anchor_every: int | None = None  # None: no anchors, only the newest keep_steps
    cap: int = ANCHORS_ABOVE_FLOOR

    def is_anchor(self, step: int) -> bool:
        return self.anchor_every is not None and step % self.anchor_every == 0

    def kept(
        self, commits: Iterable[StepHolding], floor: Order | None
    ) -> tuple[list[StepHolding], list[StepHolding]]:
        """(the commits that stay, oldest first; the anchors dropped only by the cap)."""
        held = sorted(commits, key=lambda h: h.order)
        keep = {h.order for h in held[-self.keep_steps :]}
        at_or_above = floor or _BELOW_ALL
        above = [h for h in held if self.is_anchor(h.step) and h.order > at_or_above]
        keep |= {h.order for h in held if self.is_anchor(h.step) and h.order == at_or_above}
        keep |= {h.order for h in above[-self.cap :]}
        over_cap = [h for h in above[: -self.cap] if h.order not in keep]
        return [h for h in held if h.order in keep], over_cap
