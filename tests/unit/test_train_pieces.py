"""Pieces: encode/read with checksums, name checks, resharding between tp sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elasticpp.checkpoint.manifest import (
    Manifest,
    PieceKey,
    verify_step_dir,
    write_manifest,
)
from elasticpp.checkpoint.tensors import (
    Piece,
    PieceMeta,
    decode_piece,
    encode_piece,
    load_units,
    piece_path,
    read_piece,
    reshard,
    write_piece,
)
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.plan import ModelSpec
from elasticpp.train.model.contract import init_unit
from elasticpp.train.model.families import build_model

MODEL = ModelSpec("t", num_layers=2, hidden_size=16, num_heads=4, vocab_size=256, seq_len=8)
WHOLE = {
    "param/col": torch.arange(8 * 3, dtype=torch.float32).view(8, 3),
    "param/row": torch.arange(2 * 8, dtype=torch.float32).view(2, 8) * 0.5,
    "param/rep": torch.tensor([1.0, 2.0, 3.0]),
}
DIMS: dict[str, int | None] = {"param/col": 0, "param/row": 1, "param/rep": None}


def slices(tp_size: int, step: int = 7) -> list[Piece]:
    out = []
    for r in range(tp_size):
        tensors = {
            k: (v if DIMS[k] is None else v.chunk(tp_size, dim=DIMS[k])[r].clone())
            for k, v in WHOLE.items()
        }
        out.append(Piece(tensors, PieceMeta("block.0000", r, tp_size, step, DIMS)))
    return out


def test_reshard_round_trip_tp2_to_tp1_to_tp4_equals_the_whole_tensor() -> None:
    whole = reshard(slices(2), 0, 1)
    for k, v in WHOLE.items():
        assert torch.equal(whole[k], v)
    as_pieces = [Piece(whole, PieceMeta("block.0000", 0, 1, 7, DIMS))]
    four = [reshard(as_pieces, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([f["param/col"] for f in four], 0), WHOLE["param/col"])
    assert torch.equal(torch.cat([f["param/row"] for f in four], 1), WHOLE["param/row"])
    assert all(torch.equal(f["param/rep"], WHOLE["param/rep"]) for f in four)
    back = reshard(
        [Piece(f, PieceMeta("block.0000", r, 4, 7, DIMS)) for r, f in enumerate(four)], 0, 1
    )
    assert all(torch.equal(back[k], WHOLE[k]) for k in WHOLE)


def test_reshard_refuses_incomplete_sets_and_indivisible_targets() -> None:
    with pytest.raises(CheckpointError, match="complete"):
        reshard(slices(2)[:1], 0, 1)
    with pytest.raises(CheckpointError, match="not divisible"):
        reshard(slices(1), 0, 3)


def test_piece_bytes_keep_tensors_and_metadata(tmp_path: Path) -> None:
    key = PieceKey("block.0000", 1, 2)
    piece = slices(2)[1]
    entry = write_piece(tmp_path, key, piece.tensors, piece.meta)
    path = tmp_path / key.filename
    assert entry.size == path.stat().st_size
    got = read_piece(path, entry.sha256)
    assert got.meta == piece.meta
    assert all(torch.equal(got.tensors[k], piece.tensors[k]) for k in piece.tensors)
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary file was renamed away


def test_read_piece_refuses_a_corrupted_file(tmp_path: Path) -> None:
    key = PieceKey("head", 0, 1)
    piece = slices(1)[0]
    entry = write_piece(tmp_path, key, piece.tensors, PieceMeta("head", 0, 1, 7, DIMS))
    path = tmp_path / key.filename
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        read_piece(path, entry.sha256)


def test_read_piece_refuses_garbage_and_a_name_that_disagrees_with_the_metadata(
    tmp_path: Path,
) -> None:
    (tmp_path / "head.tp0-1.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError):
        read_piece(tmp_path / "head.tp0-1.safetensors", None)
    piece = slices(1)[0]
    (tmp_path / "embed.tp0-1.safetensors").write_bytes(encode_piece(piece.tensors, piece.meta))
    with pytest.raises(CheckpointError, match="metadata says"):
        read_piece(tmp_path / "embed.tp0-1.safetensors", None)


@pytest.mark.parametrize(
    "name",
    ["../block.0000.tp0-1.safetensors", "/etc/passwd", "x/../head.tp0-1.safetensors", "head"],
)
def test_a_piece_name_that_is_not_a_plain_piece_name_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError):
        piece_path(tmp_path, name)
    with pytest.raises((ConfigError, CheckpointError)):
        read_piece(tmp_path / name, None)


def test_encode_refuses_tensors_without_a_shard_dim() -> None:
    with pytest.raises(CheckpointError, match="no shard dim"):
        encode_piece({"param/x": torch.zeros(2)}, PieceMeta("head", 0, 1, 0, {}))
    with pytest.raises(CheckpointError):
        decode_piece(b"short", source="test")


def _save_model(step_dir: Path, tp: int, step: int) -> None:
    entries = []
    model = build_model(MODEL)
    for unit in MODEL.units:
        specs = {s.name: s.shard_dim for s in model.unit(unit).params}
        for r in range(tp):
            params = init_unit(model.unit(unit), 3, r, tp)
            tensors = {}
            dims: dict[str, int | None] = {}
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                for n, t in params.items():
                    tensors[f"{kind}/{n}"] = t if kind == "param" else t * 0 + r
                    dims[f"{kind}/{n}"] = specs[n]
            key = PieceKey(unit, r, tp)
            entries.append(write_piece(step_dir, key, tensors, PieceMeta(unit, r, tp, step, dims)))
    write_manifest(step_dir, Manifest(step, MODEL.units, tuple(entries)))


def test_load_units_reshards_a_tp2_save_for_tp4_and_matches_fresh_slices(tmp_path: Path) -> None:
    _save_model(tmp_path, tp=2, step=5)
    assert verify_step_dir(tmp_path).is_full_model()
    units = MODEL.units
    model = build_model(MODEL)
    for r in range(4):
        loaded = load_units(tmp_path, units, r, 4)
        for unit in units:
            fresh = init_unit(model.unit(unit), 3, r, 4)
            assert loaded[unit].step == 5
            for n, t in fresh.items():
                assert torch.equal(loaded[unit].tensors[f"param/{n}"], t), (unit, n)


def test_load_units_verifies_checksums_from_the_manifest(tmp_path: Path) -> None:
    _save_model(tmp_path, tp=1, step=2)
    path = tmp_path / PieceKey("block.0001", 0, 1).filename
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        load_units(tmp_path, ["block.0001"], 0, 2)
    with pytest.raises(CheckpointError, match="no complete set"):
        load_units(tmp_path, ["block.0009"], 0, 1)
