"""LocalStore: reports, commits, retention, pins, replicas, restart, resume directories."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from elasticpp.checkpoint.manifest import PieceEntry, PieceKey, step_dirname, verify_step_dir
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.plan.specs import default_units
from elasticpp.store.holdings import NodeHoldings
from elasticpp.store.local import LocalStore, PieceNotFoundError

UNITS = default_units(1)  # embed, block.0000, head

NAMES = ["embed.tp0-1.safetensors", "block.0000.tp0-1.safetensors"]


def write_step(store: LocalStore, step: int, names=NAMES, size: int = 1000) -> list[dict]:
    """What a worker does: write pieces into own_dir/step-k/ and build its report."""
    d = store.own_dir / step_dirname(step)
    d.mkdir(parents=True, exist_ok=True)
    report = []
    for name in names:
        data = hashlib.sha256(f"{name}{step}".encode()).digest() * (size // 32 + 1)
        data = data[:size]
        (d / name).write_bytes(data)
        report.append({"name": name, "size": size, "sha256": hashlib.sha256(data).hexdigest()})
    return report


def commit_step(store: LocalStore, step: int, names=NAMES) -> None:
    store.record_pieces(step, write_step(store, step, names))
    store.commit(step, units=UNITS)


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
        assert store.committed_steps() == [1, 2]
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
