"""LocalStore: reports, commits, retention, pins, replicas, restart, resume directories."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from elasticpp.checkpoint.manifest import (
    JobIdentity,
    PieceEntry,
    PieceKey,
    step_dirname,
    verify_step_dir,
)
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.store.holdings import NodeHoldings, StepHolding
from elasticpp.store.layout import epoch_dirname
from elasticpp.store.local import LocalStore, PieceNotFoundError
from elasticpp.store.replicate import _wanted
from elasticpp.store.retention import Retention
from tests.stores import NAMES, UNITS, commit_replica_step, commit_step, write_step


def test_commit_writes_a_verifiable_manifest_and_lists_the_step(tmp_path: Path):
    store = LocalStore(tmp_path, "n0")
    report = write_step(store, 3)
    store.record_pieces(3, report[:1])
    store.record_pieces(3, report[1:])
    assert store.holdings().steps == {}  # reported is not committed
    store.commit(3, units=UNITS)
    manifest = verify_step_dir(store.own_dir / step_dirname(3))
    assert {e.key.filename for e in manifest.pieces} == set(NAMES)
    held = store.holdings()
    assert list(held.steps) == [("n0", 3)]
    assert held.steps[("n0", 3)].pieces[NAMES[0]].sha256 == report[0]["sha256"]
    assert NodeHoldings.from_json(held.to_json()) == held
    assert store.commit(3, units=UNITS) == held.steps[("n0", 3)]  # idempotent


def test_record_refuses_missing_or_wrong_size_pieces_and_late_reports(tmp_path: Path):
    store = LocalStore(tmp_path, "n0")
    report = write_step(store, 1)
    with pytest.raises(CheckpointError, match="the report says 999"):
        store.record_pieces(1, [{**report[0], "size": 999}])
    with pytest.raises(CheckpointError, match="missing"):
        store.record_pieces(1, [{**report[0], "name": "head.tp0-1.safetensors"}])
    with pytest.raises(ConfigError, match="not a piece name"):
        store.record_pieces(1, [{**report[0], "name": "../escape.safetensors"}])
    store.record_pieces(1, report)
    store.commit(1, UNITS)
    with pytest.raises(CheckpointError, match="already committed"):
        store.record_pieces(1, report)


def test_conflicting_reports_are_settled_by_the_file(tmp_path: Path):
    store = LocalStore(tmp_path, "n0")
    report = write_step(store, 1)
    store.record_pieces(1, report[:1])
    store.record_pieces(1, [{**report[0], "sha256": "f" * 64}])  # a twin's differing claim
    assert store.reported(1)[NAMES[0]].sha256 == report[0]["sha256"]
    store.record_pieces(1, [{**report[1], "sha256": "e" * 64}])  # only sizes are checked here
    with pytest.raises(CheckpointError, match="matches no report"):
        store.record_pieces(1, [{**report[1], "sha256": "c" * 64}])


def test_keeps_newest_steps_and_drops_older_and_stale_uncommitted(tmp_path: Path):
    store = LocalStore(tmp_path, "n0", keep_steps=2)
    write_step(store, 1)  # a worker died before reporting: never committed
    for step in (2, 3, 4):
        commit_step(store, step)
    write_step(store, 5)  # in flight: newer than everything committed, must stay
    assert store.committed_steps() == [3, 4]
    on_disk = sorted(p.name for p in store.own_dir.iterdir())
    assert on_disk == [step_dirname(s) for s in (3, 4, 5)]


def test_pinned_step_is_hidden_at_once_but_deleted_only_after_release(tmp_path: Path):
    store = LocalStore(tmp_path, "n0", keep_steps=1)
    commit_step(store, 1)
    with store.open_piece("n0", 1, NAMES[0]) as (f, info):
        commit_step(store, 2)
        assert store.committed_steps() == [2]
        assert list(store.holdings().steps) == [("n0", 2)]
        assert (store.own_dir / step_dirname(1)).is_dir()
        assert len(f.read()) == info.size  # the reader is not disturbed
    assert store.committed_steps() == [2]
    assert not (store.own_dir / step_dirname(1)).exists()


def test_paths_cannot_leave_the_store(tmp_path: Path):
    store = LocalStore(tmp_path, "n0")
    for name in ("../x.safetensors", "block.0000.tp0-1.safetensors/..", "/etc/passwd", ""):
        with pytest.raises(ConfigError):
            store.path_of("n0", 1, name)
    for origin in ("..", "../n1", "a/b", "", ".hidden"):
        with pytest.raises(ConfigError):
            store.path_of(origin, 1, NAMES[0])
    with pytest.raises(ConfigError):
        LocalStore(tmp_path / "x", "../evil")


def test_open_piece_of_unknown_step_or_piece_is_not_found(tmp_path: Path):
    store = LocalStore(tmp_path, "n0")
    commit_step(store, 1)
    with pytest.raises(PieceNotFoundError), store.open_piece("n0", 2, NAMES[0]):
        pass
    with pytest.raises(PieceNotFoundError), store.open_piece("n0", 1, "head.tp0-1.safetensors"):
        pass


def test_restart_picks_up_committed_steps_and_replicas(tmp_path: Path):
    store = LocalStore(tmp_path, "n0")
    commit_step(store, 1)
    commit_step(store, 2)
    d = store.replica_step_dir("n9", 7)
    (d / NAMES[0]).write_bytes(b"abc")
    entry = PieceEntry(PieceKey.parse(NAMES[0]), 3, hashlib.sha256(b"abc").hexdigest())
    store.commit_replica("n9", 7, UNITS, [entry])
    write_step(store, 3)  # uncommitted at the crash
    again = LocalStore(tmp_path, "n0")
    assert again.holdings() == store.holdings()
    assert sorted(again.holdings().steps) == [("n0", 1), ("n0", 2), ("n9", 7)]


def test_materialize_links_verified_pieces_and_refuses_corrupt_ones(tmp_path: Path):
    store = LocalStore(tmp_path / "s", "n0")
    commit_step(store, 1)
    entries = store.materialize(tmp_path / "r", [("n0", 1, n) for n in NAMES])
    assert [e.key.filename for e in entries] == NAMES
    src = store.path_of("n0", 1, NAMES[0])
    assert (tmp_path / "r" / NAMES[0]).read_bytes() == src.read_bytes()
    assert os.stat(src).st_ino == os.stat(tmp_path / "r" / NAMES[0]).st_ino  # a hard link
    commit_step(store, 2)
    bad = store.path_of("n0", 2, NAMES[1])
    data = bytearray(bad.read_bytes())
    data[10] ^= 0xFF
    bad.unlink()  # a fresh inode, so step 1's links are not touched
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its checksum"):
        store.materialize(tmp_path / "r2", [("n0", 2, NAMES[1])])
    # The corrupt commit leaves the holdings: no resume is planned on it again.
    assert list(store.holdings().steps) == [("n0", 1)]
    assert not store.step_dir("n0", 2, 0).exists()


def test_replica_commit_checks_presence_and_keeps_newest_per_origin(tmp_path: Path):
    store = LocalStore(tmp_path, "n0", keep_steps=2)
    entry = PieceEntry(PieceKey.parse(NAMES[0]), 3, hashlib.sha256(b"abc").hexdigest())
    with pytest.raises(CheckpointError, match="missing or wrong size"):
        store.commit_replica("n1", 1, UNITS, [entry])
    for step in (1, 2, 3):
        (store.replica_step_dir("n1", step) / NAMES[0]).write_bytes(b"abc")
        store.commit_replica("n1", step, UNITS, [entry])
    assert store.committed_steps("n1") == [2, 3]
    assert not (tmp_path / "replicas" / "n1" / step_dirname(1)).exists()
    with pytest.raises(ConfigError, match="not a replica"):
        store.replica_step_dir("n0", 1)


def test_a_recomputed_step_is_a_new_commit_and_never_rewrites_the_committed_one(tmp_path: Path):
    store = LocalStore(tmp_path, "n0", keep_steps=2)
    commit_step(store, 5, generation=1)
    old_dir = store.step_dir("n0", 5)
    old_bytes = (old_dir / NAMES[0]).read_bytes()
    # Generation 2 recomputes step 5 after a rollback: its worker writes elsewhere.
    report = write_step(store, 5, generation=2)
    assert (old_dir / NAMES[0]).read_bytes() == old_bytes
    verify_step_dir(old_dir)  # the committed step still matches its manifest
    store.record_pieces(5, report, 2)
    held = store.commit(5, UNITS, generation=2)
    assert held.generation == 2 and store.holdings().steps[("n0", 5)] == held
    assert store.step_dir("n0", 5) != old_dir and not old_dir.exists()
    assert verify_step_dir(store.step_dir("n0", 5)).generation == 2
    store.verify_piece("n0", 5, NAMES[0])
    # A late report or commit of the older generation cannot take the step back.
    with pytest.raises(CheckpointError, match="generation 2"):
        store.record_pieces(5, write_step(store, 5, generation=1), 1)
    with pytest.raises(CheckpointError, match="older generation 1"):
        store.commit(5, UNITS, generation=1)


def test_pruning_keeps_the_newest_commits_by_generation_then_step(tmp_path: Path):
    store = LocalStore(tmp_path, "n0", keep_steps=2)
    for step in (8, 9, 10):
        commit_step(store, step, generation=1)
    write_step(store, 11, generation=1)  # in flight when the job rolled back
    # Rolled back to step 5: generation 2 recomputes 6 and 7, which must survive their commit.
    commit_step(store, 6, generation=2)
    assert store.committed_steps() == [6, 10]
    commit_step(store, 7, generation=2)
    assert store.committed_steps() == [6, 7]
    assert store.holdings().newest_step_of("n0") == 7
    assert not (store.snapshot_dir(1)).exists()  # the abandoned timeline is gone from disk
    again = LocalStore(tmp_path, "n0", keep_steps=2)
    assert again.holdings() == store.holdings()


def test_a_restart_keeps_the_newer_generation_of_a_step_found_twice_on_disk(tmp_path: Path):
    store = LocalStore(tmp_path, "n0", keep_steps=2)
    commit_step(store, 3, generation=1)
    kept = store.step_dir("n0", 3)
    # A crash between the new commit's manifest and the old directory's deletion.
    import shutil

    saved = tmp_path / "saved"
    shutil.copytree(kept, saved)
    commit_step(store, 3, generation=2)
    shutil.copytree(saved, kept)
    again = LocalStore(tmp_path, "n0", keep_steps=2)
    assert again.holdings().steps[("n0", 3)].generation == 2
    assert not kept.exists()


def test_replicas_of_a_recomputed_step_replace_the_older_generation(tmp_path: Path):
    store = LocalStore(tmp_path, "n0", keep_steps=2)
    for gen, payload in ((1, b"abc"), (2, b"xyz")):
        entry = PieceEntry(PieceKey.parse(NAMES[0]), 3, hashlib.sha256(payload).hexdigest())
        (store.replica_step_dir("n1", 4, gen) / NAMES[0]).write_bytes(payload)
        store.commit_replica("n1", 4, UNITS, [entry], gen)
    assert store.holdings().steps[("n1", 4)].generation == 2
    assert store.path_of("n1", 4, NAMES[0]).read_bytes() == b"xyz"
    assert not (tmp_path / "replicas" / "n1" / "gen-00000001").exists()


def test_anchors_at_or_above_the_floor_outlive_the_newest_steps(tmp_path: Path):
    store = LocalStore(tmp_path, "n0", keep_steps=2, anchor_every=2)
    assert store.set_floor(4, 0)
    for step in range(1, 11):
        commit_step(store, step)
        commit_replica_step(store, "n1", step)
    # 4, 6, 8, 10 are anchors at or above the floor; 9 and 10 the newest two.
    assert store.committed_steps() == [4, 6, 8, 9, 10]
    assert store.committed_steps("n1") == [4, 6, 8, 9, 10]
    assert store.anchors("n0") == [10, 8, 6, 4] and store.anchors("n1", 1) == []
    assert not store.step_dir("n0", 2).exists() and not store.step_dir("n0", 5).exists()
    again = LocalStore(tmp_path, "n0", keep_steps=2, anchor_every=2)
    assert again.committed_steps() == [4, 6, 8, 9, 10]  # no floor known yet: all anchors stay


def test_the_floor_only_rises_in_commit_order_and_releases_older_anchors(tmp_path: Path):
    store = LocalStore(tmp_path, "n0", keep_steps=1, anchor_every=1)
    for step in range(1, 6):
        commit_step(store, step)
    assert store.floor is None and store.committed_steps() == [1, 2, 3, 4, 5]
    assert store.set_floor(3, 0)
    assert store.committed_steps() == [3, 4, 5]
    assert not store.set_floor(2, 0) and not store.set_floor(3, 0)  # lower or equal: ignored
    assert store.floor == (0, 3) and store.committed_steps() == [3, 4, 5]
    # A newer generation's safe step is newer in commit order even when its number is lower
    # (after a rollback): it only keeps more, here the recomputed step 2.
    commit_step(store, 2, generation=1)
    assert store.set_floor(2, 1)
    assert store.floor == (1, 2) and store.committed_steps() == [2]


def test_anchors_above_the_floor_are_capped_per_origin_and_the_floor_is_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    store = LocalStore(tmp_path, "n0", keep_steps=2, anchor_every=1, anchor_cap=3)
    commit_step(store, 2)
    store.set_floor(2, 0)
    for step in range(3, 13):
        commit_step(store, step)
        commit_replica_step(store, "n1", step)
    assert store.committed_steps() == [2, 10, 11, 12]  # the floor, then the newest three
    assert store.committed_steps("n1") == [10, 11, 12]
    assert any("anchor step 9 dropped" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="anchor_every"):
        LocalStore(tmp_path, "n0", anchor_every=0)
    with pytest.raises(ConfigError, match="anchor_cap"):
        LocalStore(tmp_path, "n0", anchor_cap=0)


# ----- job epochs: generation numbers restart at 1 when the job's etcd state starts afresh

JOB = JobIdentity("demo", "f" * 64)


def test_after_an_etcd_wipe_the_new_epoch_commits_are_kept_and_its_floor_applies(
    tmp_path: Path,
):
    # Appendix A4 of the review: the job reached generation 5 in epoch 1, then etcd was wiped.
    store = LocalStore(tmp_path, "n0", keep_steps=2, anchor_every=1, job=JOB, epoch=1)
    for step in (100, 101):
        commit_step(store, step, generation=5)
    store.set_floor(100, 5)
    store.set_epoch(2)  # the fresh etcd: generation 1 again
    for step in (102, 103, 104):
        commit_step(store, step, generation=1)
    held = {k[1]: (h.epoch, h.generation) for k, h in store.holdings().steps.items()}
    # Nothing of epoch 2 is pruned by epoch 1's numbering; the old floor keeps its anchors.
    assert held == {100: (1, 5), 101: (1, 5), 102: (2, 1), 103: (2, 1), 104: (2, 1)}
    assert store.set_floor(103, 1)  # the new epoch's safe step rises over (5, 100)
    assert store.floor == (1, 103) and store.committed_steps() == [103, 104]
    # A step recomputed in the new epoch is accepted and replaces the old commit.
    commit_step(store, 104, generation=2)
    assert store.committed("n0", 104).commit == (2, 2)  # type: ignore[union-attr]
    assert verify_step_dir(store.step_dir("n0", 104)).epoch == 2
    # A restart rebuilds the same order from the disk alone.
    again = LocalStore(tmp_path, "n0", keep_steps=2, anchor_every=1, job=JOB, epoch=2)
    assert again.holdings() == store.holdings()
    assert store.step_dir("n0", 104).parent.parent.name == epoch_dirname(2)


def test_a_recomputed_step_of_a_new_epoch_is_accepted_over_a_higher_generation(tmp_path: Path):
    store = LocalStore(tmp_path, "n0", keep_steps=2, job=JOB, epoch=1)
    commit_step(store, 100, generation=5)
    commit_step(store, 101, generation=5)
    store.set_epoch(2)
    store.record_pieces(101, write_step(store, 101, generation=1), 1)
    held = store.commit(101, UNITS, generation=1)
    assert held.commit == (2, 1) and store.committed_steps() == [100, 101]
    with pytest.raises(CheckpointError, match="older than epoch 2"):
        store.set_epoch(1)  # never back below its own commits


def test_a_store_opened_before_its_epoch_is_known_keeps_the_older_epochs_steps(tmp_path: Path):
    old = LocalStore(tmp_path, "n0", keep_steps=2, job=JOB, epoch=7)
    for step in (10, 11):
        commit_step(old, step, generation=3)
    # An agent restarts (epoch 0 until it has joined), then learns the new epoch.
    store = LocalStore(tmp_path, "n0", keep_steps=2, job=JOB)
    assert store.newest_epoch() == 7 and store.committed_steps() == [10, 11]
    store.set_epoch(9)
    commit_step(store, 12, generation=1)
    assert store.committed_steps() == [11, 12]
    assert store.holdings().newest_step_of("n0") == 12


def test_replicas_keep_the_epoch_of_their_origin_and_order_by_it(tmp_path: Path):
    store = LocalStore(tmp_path, "n0", keep_steps=2, job=JOB, epoch=2)
    for epoch, gen, step in ((1, 5, 100), (1, 5, 101), (2, 1, 102)):
        entry = PieceEntry(PieceKey.parse(NAMES[0]), 3, hashlib.sha256(b"abc").hexdigest())
        (store.replica_step_dir("n1", step, gen, epoch) / NAMES[0]).write_bytes(b"abc")
        store.commit_replica("n1", step, UNITS, [entry], gen, epoch)
    assert store.committed_steps("n1") == [101, 102]
    assert store.committed("n1", 102).order == (2, 1, 102)  # type: ignore[union-attr]
    assert verify_step_dir(store.step_dir("n1", 102)).job == JOB


def test_a_store_never_reports_serves_or_deletes_another_jobs_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    other = LocalStore(tmp_path, "n0", keep_steps=5, job=JobIdentity("demo", "0" * 64), epoch=3)
    for step in (1, 2, 3):
        commit_step(other, step, generation=1)
    theirs = other.step_dir("n0", 3)
    legacy = LocalStore(tmp_path / "legacy", "n0")  # an older release: no job recorded
    commit_step(legacy, 4, generation=2)
    # The same node id and model, another job (another fingerprint): its steps are invisible.
    store = LocalStore(tmp_path, "n0", keep_steps=1, job=JOB, epoch=4)
    assert store.holdings().steps == {} and store.newest_epoch() == 0
    assert sum("of another job left untouched" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(PieceNotFoundError):
        store.piece_info("n0", 3, NAMES[0])
    assert store.find_piece(3, NAMES[0], other.piece_info("n0", 3, NAMES[0]).sha256) is None
    for step in (5, 6, 7):
        commit_step(store, step, generation=1)
    assert store.committed_steps() == [7]
    verify_step_dir(theirs)  # left on disk as it was
    theirs_again = LocalStore(tmp_path, "n0", keep_steps=5, job=other.job)
    assert theirs_again.committed_steps() == [1, 2, 3]
    # A step of an older release names no job: taken as this job's (epoch 0).
    assert LocalStore(tmp_path / "legacy", "n0", job=JOB).committed_steps() == [4]


def test_retention_orders_by_epoch_before_generation_and_step():
    def h(epoch: int, gen: int, step: int) -> StepHolding:
        return StepHolding("n0", step, UNITS, {}, gen, epoch)

    held = [h(1, 5, 100), h(1, 5, 101), h(2, 1, 3), h(2, 1, 4)]
    kept, _ = Retention(keep_steps=2).kept(held, None)
    assert [x.order for x in kept] == [(2, 1, 3), (2, 1, 4)]
    # Anchors at or above a floor of the old epoch stay; one of the new epoch releases them.
    anchors = Retention(keep_steps=1, anchor_every=1)
    assert len(anchors.kept(held, (1, 5, 101))[0]) == 3
    assert [x.step for x in anchors.kept(held, (2, 1, 3))[0]] == [3, 4]


def test_replication_wants_the_origins_anchors_of_a_new_epoch(tmp_path: Path):
    store = LocalStore(tmp_path, "n1", keep_steps=2, job=JOB, epoch=1)
    for step in (100, 101):
        (store.replica_step_dir("n0", step, 5, 1) / NAMES[0]).write_bytes(b"abc")
        entry = PieceEntry(PieceKey.parse(NAMES[0]), 3, hashlib.sha256(b"abc").hexdigest())
        store.commit_replica("n0", step, UNITS, [entry], 5, 1)
    theirs = {
        ("n0", s): StepHolding("n0", s, UNITS, {}, g, e)
        for e, g, s in ((1, 5, 101), (2, 1, 102), (2, 1, 103))
    }
    wanted = _wanted(store, NodeHoldings("n0", theirs), "n0", 1)
    assert [w.order for w in wanted] == [(2, 1, 102), (2, 1, 103)]


def test_a_store_of_an_earlier_release_is_epoch_0_and_ranks_below_every_epoch(tmp_path: Path):
    old = LocalStore(tmp_path, "n0", keep_steps=2)
    for step in (20, 21):
        commit_step(old, step, generation=6)
    for step in (20, 21):  # as an earlier release wrote it: format 3, no epoch, no job
        path = old.step_dir("n0", step) / "manifest.json"
        data = json.loads(path.read_text())
        del data["epoch"]
        path.write_text(json.dumps({**data, "format_version": 3}))
    assert old.step_dir("n0", 21).parent.name == "gen-00000006"  # own/gen-<G>/step-<k>/
    store = LocalStore(tmp_path, "n0", keep_steps=2, job=JOB, epoch=3)
    assert [(h.epoch, h.generation) for h in store.holdings().steps.values()] == [(0, 6)] * 2
    commit_step(store, 5, generation=1)  # a lower number, a newer epoch
    assert store.committed_steps() == [5, 21]
    assert store.holdings().newest_step_of("n0") == 5


def test_uncommitted_steps_beyond_the_newest_few_are_dropped_and_commits_stay(tmp_path: Path):
    """A fenced node commits nothing (so nothing is pruned) while its workers write a step
    per step: the store keeps the newest few uncommitted ones."""
    store = LocalStore(tmp_path, "n0")
    commit_step(store, 1, generation=2)
    for step in range(2, 102):
        store.record_pieces(step, write_step(store, step, generation=2), 2)
        store.drop_uncommitted(3)
    on_disk = sorted(step for _, _, step, _ in store.layout.step_dirs("n0"))
    assert on_disk == [1, 99, 100, 101]
    assert sorted(store._reports.orders()) == [(0, 2, 99), (0, 2, 100), (0, 2, 101)]
    assert store.drop_uncommitted(3) == []
    store.commit(101, UNITS, generation=2)  # committing again: the kept report commits
    verify_step_dir(store.step_dir("n0", 101))
    assert store.committed_steps() == [1, 101]
    with pytest.raises(ConfigError, match="keep must be"):
        store.drop_uncommitted(0)
