"""`TrainConfig`: the optimizer, schedule and data settings of a training job.

Pure Python (no torch), so the CLI and the node agent can build and validate it before any
worker starts. The node agent's job spec reuses these defaults, so `elasticpp train` and an
elastic job train the same model the same way. The model, the layout and the batch sizes
live in the `Plan`, not here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from pathlib import PurePath
from typing import Any

from elasticpp.errors import ConfigError
from elasticpp.plan.specs import check_fields

SCHEDULES = ("1f1b", "gpipe")
PRECISIONS = ("fp32", "bf16")  # of the compute; master weights and optimizer state stay fp32
DATA_DTYPES = ("uint16", "uint32")  # of a flat little-endian .bin token file
TOKEN_SUFFIXES = (".bin", ".npy")


@dataclass(frozen=True)
class TrainConfig:
    """Defaults are documented inline; every field is validated on construction.

    The learning rate warms up linearly over `warmup_steps` (step k uses
    `lr * (k + 1) / warmup_steps`), then follows a cosine from `lr` down to `min_lr` at
    step `steps`. AdamW decays weights of matrices (embeddings included), not biases or
    norms. Gradients are clipped to `clip_grad` by their global norm (0 = no clipping).
    """

    seed: int = 0
    steps: int = 20  # total optimizer steps of the job (also the cosine horizon)
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 2
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip_grad: float = 1.0
    dropout: float = 0.0  # on the embedding output and each block's two residual branches
    schedule: str = "1f1b"  # "1f1b" (PipeDream-flush) or "gpipe"
    # "bf16": forwards and backwards under bf16 autocast, stage boundaries sent as bf16;
    # parameters, gradients, AdamW moments and checkpoints stay fp32.
    precision: str = "fp32"
    # Compile every block's forward with torch.compile (Inductor): fused norms, rotations and
    # activations. A new worker compiles on its first step (tens of seconds; Inductor's
    # on-disk cache makes later starts of the same shapes quicker), so it is off by default.
    compile: bool = False
    # A token file (.npy, or .bin with a sidecar or data_dtype), a list of token shards
    # (absolute paths), a directory of token shards, a raw-byte file, or a directory of
    # raw-byte files; None = the stdlib .py corpus. See elasticpp.train.data.samples for the
    # formats.
    data: str | tuple[str, ...] | None = None
    # "uint16" or "uint32": read a .bin without a sidecar as token ids (a sidecar decides)
    data_dtype: str | None = None
    data_shuffle: bool = True  # token files: a seeded permutation of the windows per epoch
    # A raw-byte corpus larger than this is refused; the built-in corpus is capped at it.
    corpus_max_bytes: int = 4 << 20
    pg_timeout_s: float = 60.0  # bounds every collective and p2p wait of a worker

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ConfigError:
            return ConfigError(f"train: {name} must be {allowed}, got {getattr(self, name)!r}")

        for name in ("seed",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(name, "an integer >= 0")
        for name in ("steps", "corpus_max_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise bad(name, "a positive integer")
        if (
            isinstance(self.warmup_steps, bool)
            or not isinstance(self.warmup_steps, int)
            or self.warmup_steps < 0
        ):
            raise bad("warmup_steps", "an integer >= 0")
        for name in ("lr", "eps", "pg_timeout_s"):
            v = getattr(self, name)
            if not _is_number(v) or not v > 0:
                raise bad(name, "a positive number")
        for name in ("min_lr", "weight_decay", "clip_grad"):
            v = getattr(self, name)
            if not _is_number(v) or v < 0:
                raise bad(name, "a number >= 0")
        if self.min_lr > self.lr:
            raise ConfigError(f"train: min_lr {self.min_lr} must not exceed lr {self.lr}")
        if not _is_number(self.dropout) or not 0 <= self.dropout < 1:
            raise bad("dropout", "a number in [0, 1)")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in betas):
            raise bad("betas", "two numbers in [0, 1)")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if self.schedule not in SCHEDULES:
            raise bad("schedule", f"one of {', '.join(SCHEDULES)}")
        if self.precision not in PRECISIONS:
            raise bad("precision", f"one of {', '.join(PRECISIONS)}")
        if not isinstance(self.compile, bool):
            raise bad("compile", "true or false")
        if isinstance(self.data, (list, tuple)):
            object.__setattr__(self, "data", tuple(self.data))
            _check_shard_list(self.data)
        elif self.data is not None and (not isinstance(self.data, str) or not self.data):
            raise bad("data", "a non-empty path, a list of token files, or null")
        if self.data_dtype is not None and self.data_dtype not in DATA_DTYPES:
            raise bad("data_dtype", f"one of {', '.join(DATA_DTYPES)} or null")
        if not isinstance(self.data_shuffle, bool):
            raise bad("data_shuffle", "true or false")
        # What the path alone tells; a directory (of shards or of raw bytes) and a .bin without
        # a sidecar are told apart when the data is opened (elasticpp.train.data.samples).
        if self.data_dtype is not None and not self._may_be_tokens():
            raise ConfigError(
                f"train: data_dtype {self.data_dtype!r} applies to a token file (data ending in "
                f"{' or '.join(TOKEN_SUFFIXES)}, or a directory of them), got data {self.data!r}"
            )
        if not self.data_shuffle and not self._may_be_tokens():
            # Raw bytes are sampled at hashed offsets, which has no epoch order to keep.
            raise ConfigError(
                "train: data_shuffle false applies to token files only (a .npy file, a .bin "
                "file, or a directory of them); raw-byte data is sampled at hashed offsets"
            )

    def _may_be_tokens(self) -> bool:
        if self.data is None:
            return False
        if isinstance(self.data, tuple):
            return True
        return _suffix(self.data) in (*TOKEN_SUFFIXES, "")

    def lr_at(self, step: int) -> float:
        """The learning rate of 0-based step `step`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    @functools.cached_property
    def shared_dict(self) -> dict[str, Any]:
        """`to_dict()`, made once per config: every assignment of a job carries it (a
        conversion is ~75 us, and a node hands one to each rank of every generation).
        Callers must not change it."""
        return self.to_dict()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["betas"] = list(self.betas)
        if isinstance(self.data, tuple):
            data["data"] = list(self.data)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "train config") -> TrainConfig:
        check_fields(source, data, cls)
        values = dict(data)
        if "betas" in values:
            if not isinstance(values["betas"], (list, tuple)):
                raise ConfigError(f"{source}: betas must be two numbers in [0, 1)")
            values["betas"] = tuple(values["betas"])
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"{source}: {exc}") from exc


# The workers' rendezvous (every rank meets at the leader's store) waits at least
# `pg_timeout_s`, and longer in a large world: the store serves the ranks' connections and
# requests one at a time (bench/rendezvous.py measures what it sustains).
RENDEZVOUS_S_PER_RANK = 0.01


def rendezvous_timeout_s(pg_timeout_s: float, world_size: int) -> float:
    """How long a worker waits for its rendezvous (connecting to the store and every rank's
    arrival): `pg_timeout_s`, plus 10 ms a rank (+164 s at 16,384 ranks)."""
    return pg_timeout_s + RENDEZVOUS_S_PER_RANK * max(0, world_size)


def _check_shard_list(shards: tuple[object, ...]) -> None:
    if not shards:
        raise ConfigError("train: data is an empty list; name at least one token file")
    for item in shards:
        if not isinstance(item, str) or _suffix(item) not in TOKEN_SUFFIXES:
            raise ConfigError(
                f"train: data: a list names token files (ending in "
                f"{' or '.join(TOKEN_SUFFIXES)}), got {item!r}"
            )
        if not PurePath(item).is_absolute():
            # A list is not resolved against a spec file's directory as a single path is;
            # a relative shard would be read relative to whatever the worker's cwd is.
            raise ConfigError(
                f"train: data: a list of token files takes absolute paths, got {item!r}"
            )


def _suffix(path: str) -> str:
    return PurePath(path).suffix.lower()


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
