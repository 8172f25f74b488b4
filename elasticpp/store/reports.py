"""The pieces a node's workers reported of its own steps, before the store commits them.

A worker writes a step's pieces into its generation's snapshot directory and reports each
(name, size, sha256). Until the step is committed the reports are kept here, by (epoch,
generation, step). A report is checked with a stat only (the sha256 the worker computed
while writing is trusted until the piece's first use); two reports of one piece
(data-parallel twins on one node write the same file) must agree, or the file's own hash
decides. Not thread-safe: the store's lock guards it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from elasticpp.checkpoint.manifest import PieceEntry, PieceKey, sha256_file
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.store.holdings import PieceInfo

Order = tuple[int, int, int]  # (epoch, generation, step)


def entry_info(entry: PieceEntry | Mapping[str, Any]) -> tuple[str, PieceInfo]:
    """A piece report's name and (size, sha256); `ConfigError` naming what is wrong."""
    if isinstance(entry, PieceEntry):
        return entry.key.filename, PieceInfo(entry.size, entry.sha256)
    try:
        name = str(entry["name"])
        size, sha = int(entry["size"]), str(entry["sha256"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"piece report: expected name, size and sha256, got {entry!r}") from exc
    PieceKey.parse(name)
    if size < 0 or len(sha) != 64:
        raise ConfigError(f"piece report {name}: bad size {size} or sha256 {sha!r}")
    return name, PieceInfo(size, sha.lower())


class PieceReports:
    """Reported pieces of uncommitted own steps, by (epoch, generation, step)."""

    def __init__(self) -> None:
        self._by_order: dict[Order, dict[str, PieceInfo]] = {}

    def record(
        self, order: Order, step_dir: Path, entries: Iterable[PieceEntry | Mapping[str, Any]]
    ) -> list[str]:
        """Record reports of pieces in `step_dir`; returns the names whose bytes were hashed
        here (two reports disagreed): those are verified. `CheckpointError` for a piece
        missing, of another size than reported, or matching neither of two reports."""
        step = order[2]
        reported = self._by_order.setdefault(order, {})
        hashed = []
        for entry in entries:
            name, info = entry_info(entry)
            path = step_dir / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise CheckpointError(f"step {step}: reported piece {name} is missing") from None
            if size != info.size:
                raise CheckpointError(
                    f"step {step}: piece {name} has {size} bytes, the report says {info.size}"
                )
            prior = reported.get(name)
            if prior is not None and prior != info:
                actual = sha256_file(path)
                if actual not in (prior.sha256, info.sha256):
                    raise CheckpointError(f"step {step}: piece {name} matches no report")
                info = PieceInfo(size, actual)
                hashed.append(name)
            reported[name] = info
        return hashed

    def of(self, order: Order) -> dict[str, PieceInfo]:
        """A copy of what was reported of `order`'s step."""
        return dict(self._by_order.get(order, {}))

    def take(self, order: Order) -> dict[str, PieceInfo]:
        """What was reported of `order`'s step, forgotten here (it is being committed)."""
        return self._by_order.pop(order, {})

    def forget(self, order: Order) -> None:
        """Its directory is gone: what was reported of it goes too."""
        self._by_order.pop(order, None)

    def orders(self) -> Iterator[Order]:
        """The steps with reports, in no order."""
        return iter(list(self._by_order))
