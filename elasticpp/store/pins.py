"""Which of a store's commits are in use, and which of those are to go when they are free.

A transfer or a link reads a commit's files while the store may prune or replace that commit
(`LocalStore.pinned`, `open_piece`, `materialize`). A commit that leaves the holdings while
pinned is doomed: its files stay until its last pin is released, then they are deleted. The
table is pure (no I/O) and not thread-safe: the store's lock guards it.
"""

from __future__ import annotations

from collections import Counter

# A commit's identity on disk: (origin, step, epoch, generation).
CommitKey = tuple[str, int, int, int]


class Pins:
    """Pin counts per commit, and the doomed ones (see the module)."""

    def __init__(self) -> None:
        self._count: Counter[CommitKey] = Counter()
        self._doomed: set[CommitKey] = set()

    def pin(self, key: CommitKey) -> None:
        self._count[key] += 1

    def unpin(self, key: CommitKey) -> bool:
        """Release one pin; True when it was the last of a doomed commit: delete it now."""
        self._count[key] -= 1
        if self._count[key] > 0:
            return False
        del self._count[key]
        return key in self._doomed

    def retire(self, key: CommitKey) -> bool:
        """`key` left the holdings: True if nothing pins it (delete it now), else it is
        doomed until its last unpin."""
        if self._count[key] > 0:
            self._doomed.add(key)
            return False
        return True

    def deleted(self, key: CommitKey) -> None:
        """`key`'s files are gone: it is doomed no more."""
        self._doomed.discard(key)

    def doomed(self) -> frozenset[CommitKey]:
        """The commits waiting for their last unpin (their directories are still in use)."""
        return frozenset(self._doomed)
