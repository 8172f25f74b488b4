"""The persister: one worker thread persists submitted steps in order, keeps at most
`max_pending` waiting (a newer checkpoint supersedes an older one), and survives failures."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticpp.checkpoint.manifest import PieceKey, step_dirname
from elasticpp.errors import ConfigError
from elasticpp.plan.specs import ModelSpec
from elasticpp.store.checkpoints import checkpoint_holdings, find_latest_checkpoint
from elasticpp.store.holdings import DISK_SOURCE
from elasticpp.store.local import LocalStore
from elasticpp.store.persist import Persister
from elasticpp.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
MODEL = ModelSpec("t", 2, 16, 4, 32, 8)
PIECES = [PieceKey(u, r, 2).filename for u in MODEL.units for r in (0, 1)]


def commit_step(store: LocalStore, step: int) -> None:
    """Commit every piece of the model at `step`, as this node's workers would."""
    d = store.own_dir / step_dirname(step)
    d.mkdir(parents=True, exist_ok=True)
    report = []
    for name in PIECES:
        data = f"{name}@{step}".encode() * 300
        (d / name).write_bytes(data)
        report.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    store.record_pieces(step, report)
    store.commit(step, MODEL.units)


class GatedStore(LocalStore):
    """A real store that records the steps persisted from it, in order, and can hold one
    step's persistence (inside `pinned`) until the test opens the gate."""

    def __init__(self, root: Path, node_id: str, *, hold_step: int | None = None) -> None:
        super().__init__(root, node_id, keep_steps=100)
        self.hold_step = hold_step
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.persisted: list[int] = []

    @contextlib.contextmanager
    def pinned(self, origin: str, step: int) -> Iterator[None]:
        self.persisted.append(step)
        if step == self.hold_step:
            self.entered.set()
            if not self.gate.wait(WAIT_S):
                raise AssertionError("the test never opened the gate")
        with super().pinned(origin, step):
            yield


def whole_model_store(tmp_path: Path, steps: list[int], **kw: int) -> GatedStore:
    """One node holding every unit, so that each persisted step is finalised at once."""
    store = GatedStore(tmp_path / "a", "a", **kw)
    for step in steps:
        commit_step(store, step)
    return store


def disk_steps(root: Path) -> list[int]:
    return sorted(
        step for (origin, step) in checkpoint_holdings(root).steps if origin == DISK_SOURCE
    )


@contextlib.contextmanager
def no_thread_left() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    assert set(threading.enumerate()) - before == set()


def test_persister_persists_submitted_steps_in_order_and_prunes(tmp_path: Path):
    store = whole_model_store(tmp_path, [1, 2, 3])
    root = tmp_path / "ckpt"
    with no_thread_left():
        persister = Persister(store, root, keep=2, max_pending=3)
        assert all(persister.submit(step, MODEL) for step in (1, 2, 3))
        persister.close(WAIT_S)
    assert store.persisted == [1, 2, 3]
    assert disk_steps(root) == [2, 3]  # keep=2 pruned step 1 once step 3 was complete
    assert find_latest_checkpoint(root).manifest.model == MODEL
    assert (persister.failures, persister.dropped, persister.last_error) == (0, 0, None)


def test_a_failing_step_does_not_stop_later_steps(tmp_path: Path):
    store = whole_model_store(tmp_path, [1, 2, 3])
    root = tmp_path / "ckpt"
    store.path_of("a", 2, PIECES[-1]).unlink()  # lost from the store: an OSError when copied
    with no_thread_left():
        persister = Persister(store, root, keep=5, max_pending=4)
        for step in (1, 2, 3, 4):  # step 4 was never committed: a CheckpointError
            assert persister.submit(step, MODEL)
        persister.close(WAIT_S)
    assert store.persisted == [1, 2, 3]  # step 4 fails before it pins anything
    assert disk_steps(root) == [1, 3]
    assert persister.failures == 2
    assert persister.last_error is not None and "step 4" in persister.last_error
    assert find_latest_checkpoint(root).step == 3


def test_an_unwritable_root_is_a_counted_failure_and_the_thread_carries_on(tmp_path: Path):
    store = whole_model_store(tmp_path, [1, 2])
    root = tmp_path / "ckpt"
    root.write_text("a file where the checkpoint root should be")  # unwritable even for root
    with no_thread_left():
        persister = Persister(store, root)
        assert persister.submit(1, MODEL)
        assert wait_until(lambda: persister.failures == 1, WAIT_S)
        assert "step 1" in str(persister.last_error)
        root.unlink()  # the operator fixed the mount
        assert persister.submit(2, MODEL)
        persister.close(WAIT_S)
    assert disk_steps(root) == [2]
    assert persister.failures == 1


def test_at_most_max_pending_steps_wait_and_the_oldest_is_dropped(tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="elasticpp.store.persist")
    store = whole_model_store(tmp_path, [1, 2, 3, 4, 5], hold_step=1)
    root = tmp_path / "ckpt"
    with no_thread_left():
        persister = Persister(store, root, keep=5, max_pending=2)
        assert persister.submit(1, MODEL)
        assert store.entered.wait(WAIT_S)  # step 1 is running, held at the gate
        for step in (2, 3, 4, 5):
            assert persister.submit(step, MODEL)
        assert persister.pending == (4, 5)
        assert persister.dropped == 2
        store.gate.set()
        persister.close(WAIT_S)
    assert store.persisted == [1, 4, 5]
    assert disk_steps(root) == [1, 4, 5]
    assert persister.failures == 0
    dropped_lines = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert [("step 2" in r.getMessage(), "step 3" in r.getMessage()) for r in dropped_lines] == [
        (True, False),
        (False, True),
    ]


def test_close_joins_the_thread_and_later_submits_are_refused(tmp_path: Path):
    store = whole_model_store(tmp_path, [1])
    root = tmp_path / "ckpt"
    with no_thread_left():
        persister = Persister(store, root)
        persister.close(WAIT_S)
        persister.close(WAIT_S)  # idempotent
    assert persister.submit(1, MODEL) is False
    assert store.persisted == [] and not (root / step_dirname(1)).exists()


def test_persister_validates_its_settings(tmp_path: Path):
    store = LocalStore(tmp_path / "a", "a")
    with pytest.raises(ConfigError, match="max_pending"):
        Persister(store, tmp_path / "ckpt", max_pending=0)
    with pytest.raises(ConfigError, match="keep"):
        Persister(store, tmp_path / "ckpt", keep=0)


def test_each_steps_outcome_is_told_pending_persisted_failed_or_superseded(tmp_path: Path):
    store = whole_model_store(tmp_path, [1, 2, 3, 4], hold_step=1)
    root = tmp_path / "ckpt"
    with no_thread_left():
        persister = Persister(store, root, keep=5, max_pending=1)
        assert persister.outcome(1) == "unknown"
        assert persister.submit(1, MODEL)
        assert store.entered.wait(WAIT_S)
        assert persister.outcome(1) == "pending"  # being written
        assert persister.submit(2, MODEL) and persister.submit(3, MODEL)  # 3 supersedes 2
        assert persister.outcome(3) == "pending"  # waiting
        assert persister.outcome(2) == "failed: superseded by step 3 before it was written"
        store.path_of("a", 4, PIECES[-1]).unlink()
        store.gate.set()
        assert wait_until(lambda: persister.outcome(3) == "persisted", WAIT_S)
        assert persister.submit(4, MODEL)
        assert wait_until(lambda: persister.outcome(4).startswith("failed: "), WAIT_S)
        persister.close(WAIT_S)
    assert persister.outcome(1) == "persisted"
    assert disk_steps(root) == [1, 3]
