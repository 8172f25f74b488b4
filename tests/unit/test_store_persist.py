"""Persistent checkpoints: several nodes write one step; the manifest appears only when the
step is whole; loading refuses incomplete or corrupt steps and falls back."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from elasticpp.checkpoint.manifest import (
    MANIFEST_NAME,
    PieceKey,
    step_dirname,
    verify_step_dir,
)
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.plan.layout import Layout, build_plan
from elasticpp.plan.specs import DEVICE_PRESETS, ClusterSpec, ModelSpec, NodeSpec, default_units
from elasticpp.store.holdings import DISK_SOURCE
from elasticpp.store.local import LocalStore
from elasticpp.store.persist import (
    PersistPolicy,
    checkpoint_holdings,
    finalize_checkpoint,
    find_latest_checkpoint,
    load_latest_checkpoint,
    persist_pieces,
    prune_checkpoints,
)
from elasticpp.store.resolver import FetchKind, resolve
from elasticpp.store.resume import prepare_resume

NUM_LAYERS = 2
UNITS = default_units(NUM_LAYERS)  # embed, block.0000, block.0001, head
STAGE0 = [PieceKey(u, r, 2).filename for u in UNITS[:2] for r in (0, 1)]
STAGE1 = [PieceKey(u, r, 2).filename for u in UNITS[2:] for r in (0, 1)]


def commit_step(store: LocalStore, step: int, names: list[str]) -> None:
    d = store.own_dir / step_dirname(step)
    d.mkdir(parents=True, exist_ok=True)
    report = []
    for name in names:
        data = f"{name}@{step}".encode() * 300
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


def test_policy_validates_and_schedules():
    assert [s for s in range(1, 10) if PersistPolicy(every_steps=3).due(s)] == [3, 6, 9]
    assert not PersistPolicy().due(5)
    with pytest.raises(ConfigError, match="keep"):
        PersistPolicy(every_steps=1, keep=0)
