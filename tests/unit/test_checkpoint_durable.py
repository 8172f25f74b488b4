"""`checkpoint.durable`, the one way a checkpoint file is written: a file appears whole or
not at all, and a write that fails leaves neither half a file nor a temporary one behind
(the piece writers left `.tmp-<pid>` files when the rename failed; a directory of them is
what a crash loop fills a disk with)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from elasticpp.checkpoint.durable import durable_file, durable_write, link_or_copy
from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.checkpoint.tensors import PieceMeta, write_piece, write_streamed
from elasticpp.errors import CheckpointError
from elasticpp.store.persist import copy_verified


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_file_appears_whole_and_alone(tmp_path: Path) -> None:
    durable_write(tmp_path / "a.json", b"{}")
    with durable_file(tmp_path / "b.bin") as f:
        f.write(b"12")
        assert _names(tmp_path) != ["a.json", "b.bin"]  # not under its name before the end
    assert _names(tmp_path) == ["a.json", "b.bin"]
    assert (tmp_path / "b.bin").read_bytes() == b"12"


def test_an_error_inside_leaves_the_old_file_and_no_temporary_one(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    target.write_bytes(b"old")
    with pytest.raises(CheckpointError, match="refused"), durable_file(target) as f:
        f.write(b"half of the new")
        raise CheckpointError("refused")
    assert _names(tmp_path) == ["manifest.json"] and target.read_bytes() == b"old"


@pytest.mark.parametrize("writer", [write_piece, write_streamed])
def test_a_piece_whose_rename_fails_leaves_no_temporary_file(tmp_path: Path, writer) -> None:
    key = PieceKey("embed", 0, 1)
    (tmp_path / key.filename).mkdir()  # the rename into place fails (a directory is there)
    tensors = {"param/w": torch.ones(4, 4)}
    with pytest.raises(OSError):
        writer(tmp_path, key, tensors, PieceMeta("embed", 0, 1, 3, {"param/w": None}))
    assert _names(tmp_path) == [key.filename]


def test_a_copy_that_fails_its_checksum_leaves_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="fails its checksum"):
        copy_verified(src, tmp_path / "dst", "0" * 64, 3)
    assert _names(tmp_path) == ["src"]


def test_link_or_copy_copies_where_links_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"piece")
    link_or_copy(src, tmp_path / "linked")
    assert os.stat(src).st_nlink == 2

    def refuse(*_: object) -> None:
        raise OSError("links not allowed")

    monkeypatch.setattr(os, "link", refuse)
    link_or_copy(src, tmp_path / "copied")
    assert (tmp_path / "copied").read_bytes() == b"piece" and os.stat(src).st_nlink == 2
    assert _names(tmp_path) == ["copied", "linked", "src"]
