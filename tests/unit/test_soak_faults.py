"""The soak's fault helpers on a real directory: a piece to corrupt is looked for in a
node's committed steps, and a job just started may have committed none yet."""

from __future__ import annotations

import threading
from pathlib import Path

from bench.soak import newest_committed

EPOCH = "epoch-01795593609902528304"


def _commit(own: Path, gen: int, step: int, epoch: str = EPOCH) -> Path:
    d = own / epoch / f"gen-{gen:08d}" / f"step-{step:010d}"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text("{}")
    return d


def test_the_newest_committed_step_is_the_one_with_a_manifest(tmp_path: Path) -> None:
    # The store's layout: store/own/epoch-<E>/gen-<G>/step-<S> (the epoch level came with
    # job epochs; the soak still looked for gen-*/step-* right under store/own, found
    # nothing on any node, and stopped at its first corrupt_piece).
    _commit(tmp_path, 1, 4)
    _commit(tmp_path, 2, 9)
    newest = _commit(tmp_path, 10, 8)  # numbers sort as numbers: the names are padded
    (newest.parent / "step-0000000011").mkdir()  # being written: no manifest yet
    assert newest_committed(tmp_path, 5.0) == newest


def test_a_step_committed_a_moment_later_is_waited_for(tmp_path: Path) -> None:
    # The soak's first fault came right after the job became steady: steps trained, none
    # committed yet. The harness took that for "nothing to corrupt" and stopped the soak.
    timer = threading.Timer(0.3, _commit, (tmp_path, 1, 4))
    timer.start()
    try:
        assert newest_committed(tmp_path, 30.0) == tmp_path / EPOCH / "gen-00000001" / (
            "step-0000000004"
        )
    finally:
        timer.cancel()
        timer.join()


def test_no_committed_step_within_the_deadline_is_none(tmp_path: Path) -> None:
    (tmp_path / EPOCH / "gen-00000001" / "step-0000000002").mkdir(parents=True)
    assert newest_committed(tmp_path, 0.2) is None
