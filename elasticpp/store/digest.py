"""A node's holdings in a few hundred bytes, and which detail the leader must pull. Pure.

At `stopped-G` a node publishes a `HoldingsDigest` instead of its full `NodeHoldings`: per
group of committed steps with the same commit (epoch, generation), model (a fingerprint of
its units) and coverage (which tp slices of which units), the step numbers, as arithmetic
runs. A node running one pipeline stage holds two groups (its own steps and the replicas of
its ring predecessor's), so the digest is bounded by what one node holds, never by the
cluster: ~300 bytes where the holdings were 105-301 KiB (bench/records.py).

`pull_wants` says, from the digests alone, which steps the resolver can reach: it orders
steps as `resolver.resolve` does (newest commit, then number) and stops at the first step
whose every unit has a complete tp slice set among the live nodes (and the checkpoint). Only
the nodes holding those steps are asked for detail, and only of those steps: `resolve` over
what they return chooses exactly what it would over everything held (a step after the first
complete one is never reached). The detail comes over gRPC (`StateService.ListHoldings`).

Invariants: a digest names no piece, size or checksum (those come with the detail, from the
node that holds them); a digest of another format is refused by name; coverage runs are
sorted and within the model's units.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.errors import ConfigError
from elasticpp.store.holdings import DISK_SOURCE, NodeHoldings, StepHolding

DIGEST_FORMAT = 1
# (first unit index, unit count, tp size, tp ranks held as a bit mask)
Run = tuple[int, int, int, int]
# (newest step, count, stride): steps newest, newest - stride, ... (count of them)
Steps = tuple[int, int, int]
# A run longer than this is refused: no node holds that many steps, and a reader must not
# be made to list billions.
MAX_RUN = 4096


def units_fingerprint(units: Iterable[str]) -> str:
    """A short hash of a model's units, in order: steps of another model never resolve."""
    return hashlib.sha256("\n".join(units).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class HeldGroup:
    """Committed steps with one commit, one model and one coverage."""

    epoch: int
    generation: int
    units: str  # units_fingerprint of the steps' model
    coverage: tuple[Run, ...]
    steps: tuple[Steps, ...]

    @property
    def commit(self) -> tuple[int, int]:
        return (self.epoch, self.generation)

    def step_numbers(self) -> list[int]:
        return [hi - k * stride for hi, count, stride in self.steps for k in range(count)]

    def to_list(self) -> list[Any]:
        return [
            self.epoch,
            self.generation,
            self.units,
            [list(r) for r in self.coverage],
            [list(s) for s in self.steps],
        ]


@dataclass(frozen=True)
class HoldingsDigest:
    """What one node holds committed, without piece detail; `address` serves the detail."""

    address: str
    groups: tuple[HeldGroup, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": DIGEST_FORMAT,
            "address": self.address,
            "held": [g.to_list() for g in self.groups],
        }

    @classmethod
    def from_dict(cls, data: Any) -> HoldingsDigest:
        if not isinstance(data, Mapping):
            raise ConfigError("holdings digest: expected an object")
        if data.get("format") != DIGEST_FORMAT:
            raise ConfigError(
                f"holdings digest: format {data.get('format')!r} is not {DIGEST_FORMAT} "
                "(written by an agent of another release)"
            )
        address = data.get("address")
        if not isinstance(address, str) or not address.rpartition(":")[2].isdigit():
            raise ConfigError(f"holdings digest: address must be HOST:PORT, got {address!r}")
        try:
            groups = tuple(_group(g) for g in data["held"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"holdings digest: malformed held: {exc!r}") from exc
        return cls(address, groups)


def _int(value: Any, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def _group(raw: Any) -> HeldGroup:
    epoch, generation, units, coverage, steps = raw
    if not isinstance(units, str):
        raise ValueError(f"units fingerprint must be a string, got {units!r}")
    runs = []
    for first, count, size, mask in coverage:
        size = _int(size, "tp size", 1)
        mask = _int(mask, "tp rank mask", 1)
        if mask >= 1 << size:
            raise ValueError(f"tp rank mask {mask} has ranks past tp size {size}")
        runs.append((_int(first, "unit index"), _int(count, "unit count", 1), size, mask))
    stepruns = []
    for newest, count, stride in steps:
        newest, count = _int(newest, "step"), _int(count, "count", 1)
        stride = _int(stride, "stride", 1)
        if count > MAX_RUN or newest - (count - 1) * stride < 0:
            raise ValueError(f"steps {newest} - {count - 1} x {stride}: too many or below 0")
        stepruns.append((newest, count, stride))
    return HeldGroup(
        _int(epoch, "epoch"), _int(generation, "generation"), units, tuple(runs), tuple(stepruns)
    )


def _coverage(holding: StepHolding) -> tuple[Run, ...]:
    index = {u: i for i, u in enumerate(holding.units)}
    per_unit: dict[int, dict[int, int]] = {}
    for name in holding.pieces:
        key = PieceKey.parse(name)
        i = index.get(key.unit)
        if i is not None:  # a piece of no unit of the model can complete nothing
            sizes = per_unit.setdefault(i, {})
            sizes[key.tp_size] = sizes.get(key.tp_size, 0) | 1 << key.tp_rank
    runs: list[Run] = []
    open_runs: dict[tuple[int, int], int] = {}  # (size, mask) -> index in runs, if still open
    for i in sorted(per_unit):
        now = per_unit[i]
        extended: dict[tuple[int, int], int] = {}
        for size, mask in sorted(now.items()):
            at = open_runs.get((size, mask))
            if at is not None and runs[at][0] + runs[at][1] == i:
                first, count, _, _ = runs[at]
                runs[at] = (first, count + 1, size, mask)
                extended[(size, mask)] = at
            else:
                runs.append((i, 1, size, mask))
                extended[(size, mask)] = len(runs) - 1
        open_runs = extended
    return tuple(sorted(runs))


def _step_runs(steps: Iterable[int]) -> tuple[Steps, ...]:
    """Newest first, greedily as arithmetic runs: 4 consecutive steps, or anchors every k."""
    left = sorted(set(steps), reverse=True)
    out: list[Steps] = []
    i = 0
    while i < len(left):
        if i + 1 == len(left):
            out.append((left[i], 1, 1))
            break
        stride = left[i] - left[i + 1]
        j = i + 1
        while j + 1 < len(left) and left[j] - left[j + 1] == stride:
            j += 1
        out.append((left[i], j - i + 1, stride))
        i = j + 1
    return tuple(out)


def digest_of(holdings: NodeHoldings, address: str) -> HoldingsDigest:
    """The digest of `holdings`, served at `address`."""
    grouped: dict[tuple[int, int, str, tuple[Run, ...]], set[int]] = {}
    fingerprints: dict[tuple[str, ...], str] = {}
    for holding in holdings.steps.values():
        fp = fingerprints.get(holding.units)
        if fp is None:
            fp = fingerprints[holding.units] = units_fingerprint(holding.units)
        key = (holding.epoch, holding.generation, fp, _coverage(holding))
        grouped.setdefault(key, set()).add(holding.step)
    groups = tuple(
        HeldGroup(epoch, generation, fp, coverage, _step_runs(steps))
        for (epoch, generation, fp, coverage), steps in sorted(grouped.items())
    )
    return HoldingsDigest(address, groups)


@dataclass(frozen=True)
class PullWants:
    """What the leader pulls: node -> the steps whose detail it needs from it."""

    steps: Mapping[str, tuple[int, ...]]
    held: bool  # some live node holds a committed step (of any model)
    resumable: int | None  # the step the digests say resolves, if any


def _complete(coverages: Iterable[tuple[Run, ...]], unit_count: int) -> bool:
    masks: dict[tuple[int, int], int] = {}
    for coverage in coverages:
        for first, count, size, mask in coverage:
            for i in range(first, min(first + count, unit_count)):
                masks[(i, size)] = masks.get((i, size), 0) | mask
    whole = {i for (i, size), mask in masks.items() if mask == (1 << size) - 1}
    return len(whole) == unit_count


def pull_wants(
    digests: Mapping[str, HoldingsDigest],
    units: tuple[str, ...],
    live_nodes: Iterable[str],
    disk: NodeHoldings | None = None,
) -> PullWants:
    """The steps `resolve` can reach, per live node holding them (see the module docstring).
    `disk`, the checkpoint's holdings, takes part in the order and completeness only."""
    live = set(live_nodes)
    fp = units_fingerprint(units)
    sources = [(n, d) for n, d in sorted(digests.items()) if n in live]
    if disk is not None:
        sources.append((DISK_SOURCE, digest_of(disk, "disk:0")))
    newest: dict[int, tuple[int, int]] = {}
    coverages: dict[int, set[tuple[Run, ...]]] = {}
    holders: dict[int, list[str]] = {}
    held = False
    for node, digest in sources:
        held = held or (node != DISK_SOURCE and bool(digest.groups))
        for group in digest.groups:
            if group.units != fp:
                continue
            for step in group.step_numbers():
                newest[step] = max(newest.get(step, (0, 0)), group.commit)
                coverages.setdefault(step, set()).add(group.coverage)
                if node != DISK_SOURCE:
                    holders.setdefault(step, []).append(node)
    wanted: list[int] = []
    resumable = None
    for step in sorted(newest, key=lambda s: (newest[s], s), reverse=True):
        wanted.append(step)
        if _complete(coverages[step], len(units)):
            resumable = step
            break
    out: dict[str, set[int]] = {}
    for step in wanted:
        for node in holders.get(step, ()):
            out.setdefault(node, set()).add(step)
    steps = {n: tuple(sorted(s, reverse=True)) for n, s in sorted(out.items())}
    return PullWants(steps, held, resumable)


def restricted(holdings: NodeHoldings, steps: Iterable[int]) -> NodeHoldings:
    """`holdings` with only the step numbers `steps` (of every origin)."""
    keep = set(steps)
    return NodeHoldings(holdings.node_id, {k: h for k, h in holdings.steps.items() if k[1] in keep})
