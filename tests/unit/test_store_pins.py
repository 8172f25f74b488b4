"""The store's pin table (elasticpp.store.pins): a commit in use is deleted at its last unpin,
not before; one nobody pins goes at once. The store's own tests (test_store_local) run it
with files."""

from __future__ import annotations

from elasticpp.store.pins import Pins

A = ("n0", 8, 1, 2)
B = ("n0", 9, 1, 2)


def test_a_commit_nobody_reads_is_deleted_when_it_leaves_the_holdings() -> None:
    pins = Pins()
    assert pins.retire(A) and pins.doomed() == frozenset()


def test_a_pinned_commit_is_doomed_and_deleted_at_its_last_unpin_only() -> None:
    pins = Pins()
    pins.pin(A)
    pins.pin(A)
    pins.pin(B)
    assert not pins.retire(A) and pins.doomed() == {A}
    assert not pins.unpin(A)  # one reader left
    assert pins.unpin(A)  # the last: delete it now
    pins.deleted(A)
    assert pins.doomed() == frozenset()
    assert not pins.unpin(B)  # never retired: stays
    assert pins.retire(B)  # and nobody reads it now
