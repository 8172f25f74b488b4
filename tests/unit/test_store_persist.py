"""Persistent checkpoints: several nodes write one step; the manifest appears only when the
step is whole; loading refuses incomplete or corrupt steps and falls back."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from elasticpp.checkpoint.manifest import (
    MANIFEST_NAME,
    JobIdentity,
    PieceKey,
    read_manifest,
    sha256_file,
    step_dirname,
    verify_step_dir,
    write_manifest,
)
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.plan.layout import Layout, build_plan
from elasticpp.plan.specs import DEVICE_PRESETS, ClusterSpec, ModelSpec, NodeSpec, default_units
from elasticpp.store.checkpoints import (
    checkpoint_holdings,
    find_latest_checkpoint,
    load_latest_checkpoint,
    prune_checkpoints,
)
from elasticpp.store.holdings import DISK_SOURCE
from elasticpp.store.local import LocalStore
from elasticpp.store.persist import PersistPolicy, finalize_checkpoint, persist_pieces
from elasticpp.store.resolver import FetchKind, resolve
from elasticpp.store.resume import prepare_resume

NUM_LAYERS = 2
UNITS = default_units(NUM_LAYERS)  # embed, block.0000, block.0001, head
STAGE0 = [PieceKey(u, r, 2).filename for u in UNITS[:2] for r in (0, 1)]
STAGE1 = [PieceKey(u, r, 2).filename for u in UNITS[2:] for r in (0, 1)]


def piece_bytes(name: str, step: int) -> bytes:
    return f"{name}@{step}".encode() * 300


def recomputed_bytes(name: str, step: int) -> bytes:
    """The same size as `piece_bytes`, other bytes: the step computed again after a rollback."""
    return f"{name}@{step}".upper().encode() * 300


def commit_step(
    store: LocalStore,
    step: int,
    names: list[str],
    make: Callable[[str, int], bytes] = piece_bytes,
) -> None:
    d = store.own_dir / step_dirname(step)
    d.mkdir(parents=True, exist_ok=True)
    report = []
    for name in names:
        data = make(name, step)
        (d / name).write_bytes(data)
        report.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    store.record_pieces(step, report)
    store.commit(step, UNITS)


@pytest.fixture
def two_nodes(tmp_path: Path) -> tuple[LocalStore, LocalStore]:
    a = LocalStore(tmp_path / "a", "a")  # stage 0
    b = LocalStore(tmp_path / "b", "b")  # stage 1
    return a, b


def persist_step(a: LocalStore, b: LocalStore, root: Path, step: int) -> None:
    commit_step(a, step, STAGE0)
    commit_step(b, step, STAGE1)
    persist_pieces(a, root, step)
    assert finalize_checkpoint(root, step, UNITS) is None  # b's units still missing
    persist_pieces(b, root, step)
    assert finalize_checkpoint(root, step, UNITS) is not None  # the last writer finalises


def test_manifest_is_written_last_only_when_every_unit_is_there(two_nodes, tmp_path: Path):
    a, b = two_nodes
    root = tmp_path / "ckpt"
    persist_step(a, b, root, 10)
    manifest = verify_step_dir(root / step_dirname(10))
    assert manifest.is_full_model() and len(manifest.pieces) == 8
    assert finalize_checkpoint(root, 10, UNITS) == manifest  # idempotent
    assert load_latest_checkpoint(root) == (10, root / step_dirname(10))


def test_partially_written_checkpoint_is_refused_and_previous_used(two_nodes, tmp_path, caplog):
    a, b = two_nodes
    root = tmp_path / "ckpt"
    persist_step(a, b, root, 10)
    # Step 20: only a wrote its pieces (b died): no manifest, so never read.
    commit_step(a, 20, STAGE0)
    persist_pieces(a, root, 20)
    assert finalize_checkpoint(root, 20, UNITS) is None
    # Step 30: complete once, then a piece was truncated on disk.
    persist_step(a, b, root, 30)
    victim = root / step_dirname(30) / STAGE1[0]
    victim.write_bytes(victim.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        choice = find_latest_checkpoint(root)
    assert choice.step == 10
    assert any(STAGE1[0] in r and step_dirname(30) in r for r in choice.refused)
    assert any(step_dirname(20) in r and "incomplete" in r for r in choice.refused)
    assert step_dirname(30) in caplog.text
    assert load_latest_checkpoint(root)[0] == 10


def test_manifest_that_lies_about_completeness_is_refused(two_nodes, tmp_path: Path):
    a, b = two_nodes
    root = tmp_path / "ckpt"
    persist_step(a, b, root, 10)
    text = (root / step_dirname(10) / MANIFEST_NAME).read_text()
    (root / step_dirname(10) / MANIFEST_NAME).write_text(
        text.replace('"head"', '"block.0002",\n  "head"')
    )
    with pytest.raises(CheckpointError, match=r"no usable checkpoint.*units missing: block\.0002"):
        load_latest_checkpoint(root)


def test_no_checkpoint_at_all_raises(tmp_path: Path):
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        load_latest_checkpoint(tmp_path / "nothing")
    (tmp_path / "c" / step_dirname(3)).mkdir(parents=True)
    with pytest.raises(CheckpointError, match="incomplete"):
        load_latest_checkpoint(tmp_path / "c")


def test_persist_refuses_a_corrupt_source_piece(two_nodes, tmp_path: Path):
    a, _ = two_nodes
    commit_step(a, 5, STAGE0)
    src = a.path_of("a", 5, STAGE0[0])
    src.write_bytes(b"x" * src.stat().st_size)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        persist_pieces(a, tmp_path / "ckpt", 5)
    assert not (tmp_path / "ckpt" / step_dirname(5) / STAGE0[0]).exists()
    with pytest.raises(CheckpointError, match="not committed"):
        persist_pieces(a, tmp_path / "ckpt", 6)


def test_disk_holdings_feed_the_resolver_and_resume_copies_verified(two_nodes, tmp_path: Path):
    a, b = two_nodes
    root = tmp_path / "ckpt"
    persist_step(a, b, root, 10)
    commit_step(a, 20, STAGE0)
    persist_pieces(a, root, 20)  # never finalised: not offered
    disk = checkpoint_holdings(root)
    assert list(disk.steps) == [(DISK_SOURCE, 10)]
    fresh = LocalStore(tmp_path / "c", "c")
    cluster = ClusterSpec((NodeSpec("c", 1),), DEVICE_PRESETS["cpu"])
    model = ModelSpec("t", NUM_LAYERS, 16, 4, 32, 8)
    target = build_plan(model, cluster, Layout(1, 1, 1), global_batch=2, micro_batch=1)
    rp = resolve({}, target, live_nodes=["c"], disk=disk)
    assert rp.step == 10 and {f.kind for f in rp.fetches[0]} == {FetchKind.DISK}
    manifests = prepare_resume(fresh, rp, {0: tmp_path / "r0"}, peers={}, checkpoint_root=root)
    assert verify_step_dir(tmp_path / "r0") == manifests[0]
    assert len(manifests[0].pieces) == 8  # every tp=2 slice, to reshard to tp=1


def test_prune_keeps_newest_complete_checkpoints(two_nodes, tmp_path: Path):
    a, b = two_nodes
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        persist_step(a, b, root, step)
    commit_step(a, 4, STAGE0)
    persist_pieces(a, root, 4)  # unfinished, newer: kept
    assert prune_checkpoints(root, keep=2) == [1]
    assert sorted(p.name for p in root.iterdir()) == [step_dirname(s) for s in (2, 3, 4)]


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def assert_bytes_match_manifest(step_dir: Path) -> None:
    manifest = verify_step_dir(step_dir)
    for e in manifest.pieces:
        assert sha256_file(step_dir / e.key.filename) == e.sha256


def test_persist_rewrites_a_same_size_piece_whose_bytes_differ(two_nodes, tmp_path: Path):
    a, b = two_nodes
    root = tmp_path / "ckpt"
    commit_step(a, 10, STAGE0)
    commit_step(b, 10, STAGE1)
    persist_pieces(a, root, 10)
    # Torn or corrupted in place before the step was final: the right size, wrong bytes.
    victim = root / step_dirname(10) / STAGE0[0]
    victim.write_bytes(b"\0" * victim.stat().st_size)
    persist_pieces(a, root, 10)  # the node persists again (a retry, a restart)
    persist_pieces(b, root, 10)
    assert finalize_checkpoint(root, 10, UNITS) is not None
    assert find_latest_checkpoint(root).step == 10
    assert_bytes_match_manifest(root / step_dirname(10))
    assert victim.read_bytes() == piece_bytes(STAGE0[0], 10)


def test_a_step_recomputed_after_a_rollback_replaces_the_unfinished_old_bytes(
    two_nodes, tmp_path: Path
):
    a, b = two_nodes
    root = tmp_path / "ckpt"
    commit_step(a, 10, STAGE0)
    persist_pieces(a, root, 10)  # the old timeline: b never persisted, no manifest
    again = LocalStore(tmp_path / "a2", "a")  # node a after the rollback
    commit_step(again, 10, STAGE0, recomputed_bytes)
    commit_step(b, 10, STAGE1, recomputed_bytes)
    persist_pieces(again, root, 10)
    persist_pieces(b, root, 10)
    assert finalize_checkpoint(root, 10, UNITS) is not None
    assert find_latest_checkpoint(root).step == 10
    assert_bytes_match_manifest(root / step_dirname(10))
    for name in STAGE0:
        assert (root / step_dirname(10) / name).read_bytes() == recomputed_bytes(name, 10)


def test_a_complete_checkpoint_is_never_rewritten(two_nodes, tmp_path: Path):
    a, b = two_nodes
    root = tmp_path / "ckpt"
    persist_step(a, b, root, 10)
    before = snapshot(root / step_dirname(10))
    other = LocalStore(tmp_path / "a2", "a")
    commit_step(other, 10, STAGE0, lambda name, step: b"other" * 999)
    same_size = LocalStore(tmp_path / "a3", "a")
    commit_step(same_size, 10, STAGE0, recomputed_bytes)
    contributed = [persist_pieces(other, root, 10), persist_pieces(same_size, root, 10)]
    assert snapshot(root / step_dirname(10)) == before
    assert_bytes_match_manifest(root / step_dirname(10))
    assert contributed == [[], []]  # nothing written: the complete checkpoint stands


def test_finalize_refuses_parts_that_disagree_on_a_piece(two_nodes, tmp_path: Path, caplog):
    a, b = two_nodes
    root = tmp_path / "ckpt"
    twin = LocalStore(tmp_path / "c", "c")  # a data-parallel twin of a, with other bytes
    commit_step(a, 10, STAGE0)
    commit_step(twin, 10, STAGE0, recomputed_bytes)
    commit_step(b, 10, STAGE1)
    persist_pieces(a, root, 10)
    persist_pieces(twin, root, 10)
    persist_pieces(b, root, 10)
    with caplog.at_level(logging.INFO, logger="elasticpp.store.persist"):
        assert finalize_checkpoint(root, 10, UNITS) is None
    assert not (root / step_dirname(10) / MANIFEST_NAME).exists()
    assert "disagree" in caplog.text and STAGE0[0] in caplog.text


def test_finalize_refuses_a_piece_file_of_the_wrong_size(two_nodes, tmp_path: Path, caplog):
    a, b = two_nodes
    root = tmp_path / "ckpt"
    commit_step(a, 10, STAGE0)
    commit_step(b, 10, STAGE1)
    persist_pieces(a, root, 10)
    persist_pieces(b, root, 10)
    victim = root / step_dirname(10) / STAGE1[1]
    victim.write_bytes(victim.read_bytes()[:-1])
    with caplog.at_level(logging.INFO, logger="elasticpp.store.persist"):
        assert finalize_checkpoint(root, 10, UNITS) is None
    assert not (root / step_dirname(10) / MANIFEST_NAME).exists()
    assert STAGE1[1] in caplog.text  # the log names the piece, not only its unit


def test_policy_validates_and_schedules():
    assert [s for s in range(1, 10) if PersistPolicy(every_steps=3).due(s)] == [3, 6, 9]
    assert not PersistPolicy().due(5)
    with pytest.raises(ConfigError, match="keep"):
        PersistPolicy(every_steps=1, keep=0)


def test_another_jobs_checkpoints_are_never_resumed_or_pruned(two_nodes, tmp_path: Path):
    a, b = two_nodes
    root = tmp_path / "ckpt"
    theirs, ours = JobIdentity("demo", "0" * 64), JobIdentity("demo", "f" * 64)
    for step in (1, 2, 3):  # another job with the same model wrote into this directory
        persist_step(a, b, root, step)
        manifest = read_manifest(root / step_dirname(step))
        write_manifest(root / step_dirname(step), replace(manifest, job=theirs))
    assert checkpoint_holdings(root, ours).steps == {}
    assert sorted(checkpoint_holdings(root, theirs).steps) == [(DISK_SOURCE, s) for s in (1, 2, 3)]
    commit_step(a, 7, STAGE0)
    commit_step(b, 7, STAGE1)
    persist_pieces(a, root, 7)
    persist_pieces(b, root, 7)
    mine = finalize_checkpoint(root, 7, UNITS, job=ours, epoch=4, generation=2)
    assert mine is not None and (mine.job, mine.epoch, mine.generation) == (ours, 4, 2)
    assert prune_checkpoints(root, keep=1, job=ours) == []  # theirs are not ours to delete
    assert list(checkpoint_holdings(root, ours).steps) == [(DISK_SOURCE, 7)]
    assert checkpoint_holdings(root, ours).steps[(DISK_SOURCE, 7)].order == (4, 2, 7)
    assert sorted(prune_checkpoints(root, keep=1, job=theirs)) == [1, 2]
