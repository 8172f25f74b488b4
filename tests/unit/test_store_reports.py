"""A node's piece reports before commit (elasticpp.store.reports) on real files: a report is
checked by a stat; twin reports must agree or the file's hash decides; what is taken or
forgotten is gone; a malformed report is refused by name."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.store.holdings import PieceInfo
from elasticpp.store.reports import PieceReports, entry_info

NAME = "embed.tp0-1.safetensors"


def _piece(step_dir: Path, data: bytes) -> dict[str, object]:
    step_dir.mkdir(parents=True, exist_ok=True)
    (step_dir / NAME).write_bytes(data)
    return {"name": NAME, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_report_is_kept_by_step_until_taken(tmp_path: Path) -> None:
    reports = PieceReports()
    entry = _piece(tmp_path, b"abc")
    assert reports.record((0, 1, 5), tmp_path, [entry]) == []  # a stat, nothing hashed
    info = PieceInfo(3, str(entry["sha256"]))
    assert reports.of((0, 1, 5)) == {NAME: info}
    assert list(reports.orders()) == [(0, 1, 5)]
    assert reports.take((0, 1, 5)) == {NAME: info}
    assert reports.of((0, 1, 5)) == {} and list(reports.orders()) == []


def test_a_missing_or_resized_piece_is_refused(tmp_path: Path) -> None:
    reports = PieceReports()
    with pytest.raises(CheckpointError, match="missing"):
        reports.record((0, 1, 5), tmp_path, [{"name": NAME, "size": 3, "sha256": "0" * 64}])
    entry = _piece(tmp_path, b"abc")
    with pytest.raises(CheckpointError, match="has 3 bytes, the report says 4"):
        reports.record((0, 1, 5), tmp_path, [{**entry, "size": 4}])


def test_twin_reports_that_disagree_are_settled_by_the_file(tmp_path: Path) -> None:
    reports = PieceReports()
    entry = _piece(tmp_path, b"abc")
    wrong = {**entry, "sha256": "f" * 64}
    assert reports.record((0, 1, 5), tmp_path, [wrong]) == []
    assert reports.record((0, 1, 5), tmp_path, [entry]) == [NAME]  # hashed: verified
    assert reports.of((0, 1, 5))[NAME].sha256 == entry["sha256"]
    (tmp_path / NAME).write_bytes(b"xyz")  # now matches neither report
    with pytest.raises(CheckpointError, match="matches no report"):
        reports.record((0, 1, 5), tmp_path, [wrong])


def test_forget_drops_a_steps_reports(tmp_path: Path) -> None:
    reports = PieceReports()
    reports.record((0, 1, 5), tmp_path, [_piece(tmp_path, b"abc")])
    reports.forget((0, 1, 5))
    reports.forget((0, 1, 6))  # never reported: nothing to do
    assert list(reports.orders()) == []


@pytest.mark.parametrize(
    "entry, match",
    [
        ({"name": NAME, "size": 3}, "expected name, size and sha256"),
        ({"name": NAME, "size": -1, "sha256": "0" * 64}, "bad size"),
        ({"name": NAME, "size": 3, "sha256": "abc"}, "bad size 3 or sha256"),
    ],
)
def test_a_malformed_report_is_refused_by_name(entry: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        entry_info(entry)
