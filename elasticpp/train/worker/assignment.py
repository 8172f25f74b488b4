"""What a warm worker is handed (`Assignment`, the first line on its stdin): its plan, rank,
rendezvous, job and the state to start from, as versioned JSON; and its snapshot rule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from elasticpp.errors import ConfigError
from elasticpp.plan import Plan
from elasticpp.train.config import TrainConfig

ASSIGNMENT_FORMAT_VERSION = 1
BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")

SNAPSHOT_WHEN_BUSY = ("wait", "skip")


@dataclass(frozen=True)
class Assignment:
    """What a warm worker is handed: its plan, rank, rendezvous, job and state to start from."""

    plan: Plan
    rank: int
    store_host: str
    store_port: int
    store_prefix: str
    job: TrainConfig
    start_step: int = 0
    resume_dir: str | None = None
    snapshot_dir: str | None = None
    snapshot_every: int = 1  # every N steps; 0 = no step rule
    # Also (or instead) a snapshot on the first step divisible by `snapshot_align` once every
    # rank's writer has been free this long (s) since its last write ended; 0 = no time
    # rule. Neither rule: only after the last step and at a stop.
    snapshot_every_s: float = 0.0
    snapshot_align: int = 1
    # A periodic snapshot due while a rank's writer is still busy: "wait" for it (every due
    # step is written), or "skip" the step on every rank (training never waits for the disk).
    snapshot_when_busy: str = "wait"
    backend: str = "gloo"
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    # The physical GPU to use; None = the plan's local rank. The agent maps local ranks onto
    # the node's healthy GPUs, so a node that lost GPU 3 keeps using 0-2 and 4-7.
    gpu_index: int | None = None

    def __post_init__(self) -> None:
        world = self.plan.gpus_used
        if not 0 <= self.rank < world:
            raise ConfigError(f"assignment: rank {self.rank} not in [0, {world})")
        if not 0 < self.store_port < 65536:
            raise ConfigError(f"assignment: store_port {self.store_port} not in [1, 65535]")
        if not self.store_prefix:
            raise ConfigError("assignment: store_prefix must be non-empty")
        if self.start_step < 0 or self.start_step > self.job.steps:
            raise ConfigError(
                f"assignment: start_step {self.start_step} not in [0, {self.job.steps}]"
            )
        if self.resume_dir is None and self.start_step != 0:
            raise ConfigError("assignment: start_step > 0 needs a resume_dir")
        if self.snapshot_every < 0:
            raise ConfigError("assignment: snapshot_every must be >= 0")
        if not (math.isfinite(self.snapshot_every_s) and self.snapshot_every_s >= 0):
            raise ConfigError(
                f"assignment: snapshot_every_s must be a number >= 0, got {self.snapshot_every_s}"
            )
        if self.snapshot_align < 1:
            raise ConfigError(f"assignment: snapshot_align must be >= 1, got {self.snapshot_align}")
        if self.snapshot_when_busy not in SNAPSHOT_WHEN_BUSY:
            raise ConfigError(
                f"assignment: snapshot_when_busy must be one of {', '.join(SNAPSHOT_WHEN_BUSY)}"
            )
        if self.backend not in BACKENDS:
            raise ConfigError(f"assignment: backend must be one of {', '.join(BACKENDS)}")
        if self.device not in DEVICES:
            raise ConfigError(f"assignment: device must be one of {', '.join(DEVICES)}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ConfigError("assignment: num_threads must be positive or null")
        if self.gpu_index is not None and self.gpu_index < 0:
            raise ConfigError("assignment: gpu_index must be >= 0 or null")

    def snapshot_due(self, step: int, rested_s: float) -> bool:
        """Whether the state after `step` steps is a periodic snapshot: every
        `snapshot_every`-th step, or a step divisible by `snapshot_align` once every rank's
        writer has been free for `snapshot_every_s` (`rested_s`: the shortest such time over
        the ranks, the same on every rank, so every rank decides alike). The time rule never
        makes training wait for a write in flight: a write takes what it takes, and the
        interval starts when it ends."""
        if self.snapshot_every > 0 and step % self.snapshot_every == 0:
            return True
        return (
            self.snapshot_every_s > 0
            and rested_s >= self.snapshot_every_s
            and step % self.snapshot_align == 0
        )

    def to_dict(self) -> dict[str, Any]:
        """As the worker reads it (`from_dict`); the plan's and the job's dicts are the
        shared ones of their objects (made once, not once per rank)."""
        return {
            "format_version": ASSIGNMENT_FORMAT_VERSION,
            "plan": self.plan.shared_dict,
            "rank": self.rank,
            "store_host": self.store_host,
            "store_port": self.store_port,
            "store_prefix": self.store_prefix,
            "job": self.job.shared_dict,
            "start_step": self.start_step,
            "resume_dir": self.resume_dir,
            "snapshot_dir": self.snapshot_dir,
            "snapshot_every": self.snapshot_every,
            "snapshot_every_s": self.snapshot_every_s,
            "snapshot_align": self.snapshot_align,
            "snapshot_when_busy": self.snapshot_when_busy,
            "backend": self.backend,
            "device": self.device,
            "num_threads": self.num_threads,
            "gpu_index": self.gpu_index,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Assignment:
        if not isinstance(data, dict):
            raise ConfigError("assignment: expected a JSON object")
        if data.get("format_version") != ASSIGNMENT_FORMAT_VERSION:
            raise ConfigError(
                f"assignment: format_version {data.get('format_version')!r} is not "
                f"{ASSIGNMENT_FORMAT_VERSION}"
            )
        try:
            return cls(
                plan=Plan.from_dict(data["plan"]),
                rank=int(data["rank"]),
                store_host=str(data["store_host"]),
                store_port=int(data["store_port"]),
                store_prefix=str(data["store_prefix"]),
                job=TrainConfig.from_dict(data["job"], source="assignment.job"),
                start_step=int(data.get("start_step", 0)),
                resume_dir=_opt_str(data.get("resume_dir")),
                snapshot_dir=_opt_str(data.get("snapshot_dir")),
                snapshot_every=int(data.get("snapshot_every", 1)),
                snapshot_every_s=float(data.get("snapshot_every_s", 0.0)),
                snapshot_align=int(data.get("snapshot_align", 1)),
                snapshot_when_busy=str(data.get("snapshot_when_busy", "wait")),
                backend=str(data.get("backend", "gloo")),
                device=str(data.get("device", "cpu")),
                num_threads=None if data.get("num_threads") is None else int(data["num_threads"]),
                gpu_index=None if data.get("gpu_index") is None else int(data["gpu_index"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"assignment: malformed field: {exc!r}") from exc


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)
