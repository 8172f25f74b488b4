"""What a node holds, as pure data: the input of the resolver and the payload of ListSteps.

A `NodeHoldings` lists, for each `(origin_node, step)` the node holds COMMITTED (its own
steps, whose origin is itself, and the replicas it keeps of peers), every piece name with its
size and sha256. It is plain data (no paths, no I/O), serialisable to versioned JSON, so the
agent can publish it anywhere and the resolver stays a pure function.

Node ids become directory names in a store, so they are restricted to a safe alphabet.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from elasticpp.checkpoint.manifest import Manifest, PieceEntry, PieceKey
from elasticpp.errors import ConfigError
from elasticpp.names import parse_name

# 4: each step names the job epoch that committed it; 3 (read as epoch 0): the generation;
# 2 (read as generation 0): units.
HOLDINGS_FORMAT_VERSION = 4
READABLE_HOLDINGS_VERSIONS = (2, 3, 4)

# The source/origin name of pieces in the persistent checkpoint; never a valid node id.
DISK_SOURCE = "<disk>"

_NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_node_id(node_id: str, *, field_name: str = "node_id") -> str:
    """`node_id` if it is safe as one path component; `ConfigError` naming the field if not."""
    if not isinstance(node_id, str) or not _NODE_ID_RE.fullmatch(node_id) or ".." in node_id:
        raise ConfigError(
            f"{field_name} {node_id!r:.80}: must be 1-128 characters of letters, digits, '.', '_' "
            "or '-', start with a letter or digit, and contain no '..'"
        )
    return node_id


class PieceInfo(NamedTuple):
    size: int
    sha256: str


@dataclass(frozen=True)
class StepHolding:
    """One committed step of one origin, as held by some node."""

    origin: str
    step: int
    units: tuple[str, ...]  # the model's units, in order (from the step's manifest)
    pieces: Mapping[str, PieceInfo]  # piece file name -> (size, sha256)
    # The plan generation whose workers computed the step. A step recomputed after a
    # rollback is a new commit of a newer generation.
    generation: int = 0
    # The job epoch of that generation: generation numbers start again at 1 when the job's
    # etcd state starts afresh, in a new, larger epoch. Commits order by (epoch,
    # generation, step).
    epoch: int = 0

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.epoch, self.generation, self.step)

    @property
    def commit(self) -> tuple[int, int]:
        """(epoch, generation): which commit of its step this is."""
        return (self.epoch, self.generation)

    @classmethod
    def from_manifest(cls, origin: str, manifest: Manifest) -> StepHolding:
        return cls(
            origin,
            manifest.step,
            manifest.units,
            {e.key.filename: PieceInfo(e.size, e.sha256) for e in manifest.pieces},
            manifest.generation,
            manifest.epoch,
        )

    def entries(self) -> tuple[PieceEntry, ...]:
        return tuple(
            PieceEntry(PieceKey.parse(name), info.size, info.sha256)
            for name, info in sorted(self.pieces.items())
        )


@dataclass(frozen=True)
class NodeHoldings:
    """Everything one node holds committed, keyed by `(origin_node, step)`."""

    node_id: str
    steps: Mapping[tuple[str, int], StepHolding] = field(default_factory=dict)

    def steps_of(self, origin: str) -> list[int]:
        return sorted(step for o, step in self.steps if o == origin)

    def newest_step_of(self, origin: str) -> int | None:
        """The origin's newest commit by (epoch, generation, step): after a rollback, the step the
        job recomputed, not the higher-numbered step of the abandoned timeline."""
        held = [h for (o, _), h in self.steps.items() if o == origin]
        return max(held, key=lambda h: h.order).step if held else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": HOLDINGS_FORMAT_VERSION,
            "node_id": self.node_id,
            "steps": [
                {
                    "origin_node": h.origin,
                    "step": h.step,
                    "generation": h.generation,
                    "epoch": h.epoch,
                    "units": list(h.units),
                    "pieces": [
                        {"name": n, "size": i.size, "sha256": i.sha256}
                        for n, i in sorted(h.pieces.items())
                    ],
                }
                for _, h in sorted(self.steps.items())
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeHoldings:
        if data.get("format_version") not in READABLE_HOLDINGS_VERSIONS:
            raise ConfigError(
                f"holdings: format_version {data.get('format_version')!r} is not one of "
                f"{', '.join(map(str, READABLE_HOLDINGS_VERSIONS))}"
            )
        try:
            steps: dict[tuple[str, int], StepHolding] = {}
            for s in data["steps"]:
                origin = check_node_id(str(s["origin_node"]), field_name="origin_node")
                pieces = {}
                for p in s["pieces"]:
                    PieceKey.parse(str(p["name"]))
                    pieces[str(p["name"])] = PieceInfo(int(p["size"]), str(p["sha256"]))
                units = tuple(parse_name(u, what="unit") for u in s["units"])
                generation, epoch = int(s.get("generation", 0)), int(s.get("epoch", 0))
                if generation < 0 or epoch < 0:
                    raise ValueError(f"generation {generation} or epoch {epoch} is negative")
                holding = StepHolding(origin, int(s["step"]), units, pieces, generation, epoch)
                steps[(origin, holding.step)] = holding
            return cls(check_node_id(str(data["node_id"])), steps)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"holdings: malformed field: {exc!r}") from exc

    @classmethod
    def from_json(cls, text: str) -> NodeHoldings:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"holdings: not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError("holdings: expected a JSON object")
        return cls.from_dict(data)
