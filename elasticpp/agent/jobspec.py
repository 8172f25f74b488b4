"""The job spec: one YAML file given to every agent of a job.

A minimal spec is just the required keys:

    name: demo
    model: tiny            # a preset, a model spec file, a Hugging Face model directory,
                           # or package.module:function (see elasticpp.train.model.modelref)
    global_batch: 16
    micro_batch: 2
    steps: 40
    seed: 0
    min_nodes: 1
    max_nodes: 4

Optional keys and their defaults are the fields of `JobSpec` below; the optimizer and data
defaults are `TrainConfig`'s, so `elasticpp train` with the same settings trains the same model.
Relative `model` and `data` paths (each path of a list of shards too) are relative to the
spec file's directory; `data` is stored as absolute paths, which every node must be able to
read.
The first agent stores the canonical JSON form in etcd; an agent whose spec differs is refused
with the differing fields named (`diff`). The stored form records the model reference
resolved (paths against the spec file's directory) with a fingerprint of its files, so an
agent whose model files differ is refused with `model_ref` named.

The job's identity (`JobSpec.identity`) is its name and a fingerprint of what its state
depends on (invariant 1: the model and its files, seed, batch, steps, optimizer and data,
initial weights), not of how it runs (nodes, timeouts, replication, persistence). Every
step a store commits names it, so a node never resumes another job's state, also after the
job's etcd state started afresh.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from elasticpp.agent.sick import SickPolicy
from elasticpp.checkpoint.manifest import JobIdentity
from elasticpp.errors import ConfigError
from elasticpp.plan import DeviceSpec, ModelSpec, Plan, load_device_spec
from elasticpp.plan.flops import check_peak_tflops
from elasticpp.plan.specs import check_fields
from elasticpp.train.config import TrainConfig

JOBSPEC_FORMAT_VERSION = 1
# Periodic snapshots when a spec names neither `snapshot_every` nor `snapshot_every_s`: one
# each time every worker's snapshot writer has been free this long. 10 s keeps a snapshot's
# cost (its copy, write and replication) to a few per cent of training where the node's CPUs
# are busy, and a failure recomputes at most that much more; by Young's rule the best interval
# for a job that fails every few hours is a minute or more (docs/store.md, "How often state is
# saved").
SNAPSHOT_EVERY_S_DEFAULT = 10.0
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_OPTIMIZER_KEYS = ("lr", "min_lr", "warmup_steps", "weight_decay", "betas", "eps", "clip_grad")
# Top-level keys of the spec copied into its TrainConfig.
_TRAIN_KEYS = (
    "schedule",
    "precision",
    "compile",
    "data",
    "data_dtype",
    "data_shuffle",
    "dropout",
    "pg_timeout_s",
    "corpus_max_bytes",
)
_REQUIRED = (
    "name",
    "model",
    "global_batch",
    "micro_batch",
    "steps",
    "seed",
    "min_nodes",
    "max_nodes",
)


# A compiling first step (torch.compile of every block, Inductor) may take minutes.
FIRST_STEP_COMPILE_S = 600.0


@dataclass(frozen=True)
class JobSpec:
    name: str
    model: ModelSpec
    global_batch: int
    micro_batch: int
    steps: int
    seed: int
    min_nodes: int
    max_nodes: int
    train: TrainConfig = field(default_factory=TrainConfig)  # optimizer, schedule, data
    # The planner's cost model of one slot: a preset name (`cpu` on CPU nodes), or a mapping
    # of `DeviceSpec` fields for hardware without a preset.
    device: str | dict[str, Any] = "cpu"
    # The peak TFLOP/s of one slot in the job's precision that MFU (elasticpp_mfu) is measured
    # against; None: the peak table's figure for the GPU's name (elasticpp.plan.flops), and
    # no MFU where it has none (CPU slots, a GPU it does not know).
    peak_tflops: float | None = None
    # Periodic snapshots, the state a worker's failure resumes from and replication sends:
    # every `snapshot_every` steps, or (the default) on the first step once every worker's
    # writer has been free `snapshot_every_s` seconds. Give one of the two (the other is
    # stored as 0); neither: `snapshot_every_s` = SNAPSHOT_EVERY_S_DEFAULT.
    snapshot_every: int | None = None
    snapshot_every_s: float | None = None
    # A snapshot due while a worker's writer is still busy with the last one: "wait" (every
    # due step is written; training waits for the disk) or "skip" (every rank skips it alike;
    # training never waits, a crash recomputes the steps since the newest written one).
    snapshot_when_busy: str = "wait"
    replication_copies: int = 1  # peer nodes holding a copy of each node's pieces (ring order)
    replication_every: int = 1  # replicate committed steps divisible by N (see snapshot_every_s)
    persist_dir: str | None = None  # persistent checkpoints (a shared directory), or none
    persist_every: int = 0  # steps between persistent checkpoints; 0 = never
    lease_ttl_s: float = 5.0  # a lost node is detected after at most this long (whole s, >= 3)
    join_settle_s: float = 2.0  # wait this long after the last join before switching layouts
    hang_timeout_s: float = 30.0  # a worker without step progress this long is hung
    # A worker's first step of a generation (compiling with `compile: true`, cold caches,
    # the first collectives) may take this long before it counts as hung; 0 (the default):
    # FIRST_STEP_COMPILE_S with `compile: true`, else hang_timeout_s.
    first_step_timeout_s: float = 0.0
    # Deadlines of waits on a node (docs/cluster.md, "Deadlines"): old workers gone and the
    # node arrived at `stopped-G` this long after a new generation, else it is set aside;
    # a warm worker not ready this long after its start is replaced.
    stop_timeout_s: float = 30.0
    ready_timeout_s: float = 120.0
    # Quarantine (elasticpp.agent.sick): after this many failed generations in a row blamed
    # on a node, it is set aside for quarantine_s, doubling each time up to quarantine_max_s.
    quarantine_after: int = 3
    quarantine_s: float = 60.0
    quarantine_max_s: float = 3600.0
    # The failure budget: more failed generations than this within failure_window_s end the
    # job (status failed) instead of re-planning for ever.
    max_failures: int = 50
    failure_window_s: float = 3600.0
    # What `model:` named, resolved: {"kind", "ref", "files": {name: sha256}}
    # (elasticpp.train.model.modelref): agents whose model files differ are refused, naming them.
    model_ref: dict[str, Any] = field(default_factory=dict)
    # Weights a new job starts from: a Hugging Face directory or an elasticpp checkpoint.
    init_from: str | None = None

    def __post_init__(self) -> None:
        self._resolve_snapshot_cadence()
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ConfigError(
                f"job spec: name must be lowercase letters, digits and '-', got {self.name!r}"
            )
        for key in (
            "global_batch",
            "micro_batch",
            "steps",
            "min_nodes",
            "max_nodes",
            "replication_every",
            "quarantine_after",
            "max_failures",
        ):
            _check_int(key, getattr(self, key), minimum=1)
        for key in ("seed", "replication_copies", "persist_every"):
            _check_int(key, getattr(self, key), minimum=0)
        if self.snapshot_when_busy not in ("wait", "skip"):
            raise ConfigError(
                "job spec: snapshot_when_busy must be wait or skip, got "
                f"{self.snapshot_when_busy!r}"
            )
        if self.min_nodes > self.max_nodes:
            raise ConfigError(
                f"job spec: min_nodes ({self.min_nodes}) exceeds max_nodes ({self.max_nodes})"
            )
        if self.global_batch % self.micro_batch:
            raise ConfigError(
                f"job spec: global_batch {self.global_batch} is not a multiple of "
                f"micro_batch {self.micro_batch}"
            )
        self.device_spec()  # raises naming the presets or the bad field
        object.__setattr__(self, "peak_tflops", check_peak_tflops(self.peak_tflops, "job spec"))
        ttl = self.lease_ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl != int(ttl) or ttl < 3:
            # etcd grants whole seconds, at least 2; and an agent fences itself
            # max(2 s request timeout, ttl/3) before its lease could lapse, so 2 s would
            # leave it no time to act (it was refused only when the agent joined).
            raise ConfigError(
                f"job spec: lease_ttl_s must be a whole number of seconds >= 3, got {ttl!r}"
            )
        for key in ("join_settle_s", "hang_timeout_s", "first_step_timeout_s"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(f"job spec: {key} must be a number >= 0, got {v!r}")
        for key in (
            "stop_timeout_s",
            "ready_timeout_s",
            "quarantine_s",
            "quarantine_max_s",
            "failure_window_s",
        ):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"job spec: {key} must be a number > 0, got {v!r}")
        if self.quarantine_s > self.quarantine_max_s:
            raise ConfigError(
                f"job spec: quarantine_s ({self.quarantine_s}) exceeds quarantine_max_s "
                f"({self.quarantine_max_s})"
            )
        if self.persist_every and not self.persist_dir:
            raise ConfigError("job spec: persist_every is set but persist_dir is not")

    @property
    def first_step_deadline_s(self) -> float:
        """How long a worker's first step of a generation may take before the hang rule
        applies (`first_step_timeout_s`, resolved)."""
        if self.first_step_timeout_s:
            return float(self.first_step_timeout_s)
        return FIRST_STEP_COMPILE_S if self.train.compile else float(self.hang_timeout_s)

    def _resolve_snapshot_cadence(self) -> None:
        every, every_s = self.snapshot_every, self.snapshot_every_s
        if every is not None:
            _check_int("snapshot_every", every, minimum=0)
        if every_s is not None and (
            isinstance(every_s, bool)
            or not isinstance(every_s, (int, float))
            or not 0 <= every_s < float("inf")
        ):
            raise ConfigError(f"job spec: snapshot_every_s must be a number >= 0, got {every_s!r}")
        if every and every_s:
            raise ConfigError(
                f"job spec: give one of snapshot_every ({every} steps) and snapshot_every_s "
                f"({every_s} s), not both"
            )
        if every is not None and every_s is not None and not every and not every_s:
            raise ConfigError(
                "job spec: snapshot_every and snapshot_every_s are both 0: one of them must "
                "say how often state is saved"
            )
        if not every and not every_s:
            every_s = SNAPSHOT_EVERY_S_DEFAULT
        # Frozen: the resolved pair is what is stored, so a spec read back from etcd is equal.
        object.__setattr__(self, "snapshot_every", int(every or 0))
        object.__setattr__(self, "snapshot_every_s", float(every_s or 0.0))

    def worker_snapshots(self) -> dict[str, Any]:
        """The workers' snapshot rules (`train.worker.Assignment`). Under the time rule a
        snapshot waits for a step divisible by `replication_every` (when replicating), so
        every snapshot is an anchor and the anchors are the same steps on every node; the
        steps a persistent checkpoint is due at are always snapshots."""
        if self.snapshot_every:
            return {"snapshot_every": self.snapshot_every, "snapshot_every_s": 0.0}
        return {
            "snapshot_every": self.persist_every if self.persist_dir else 0,
            "snapshot_every_s": self.snapshot_every_s,
            "snapshot_align": self.replication_every if self.replication_copies else 1,
        }

    def sick_policy(self) -> SickPolicy:
        return SickPolicy(
            strikes_to_quarantine=self.quarantine_after,
            base_s=self.quarantine_s,
            max_s=self.quarantine_max_s,
            max_failures=self.max_failures,
            window_s=self.failure_window_s,
        )

    def device_spec(self) -> DeviceSpec:
        if isinstance(self.device, str):
            return load_device_spec(self.device)
        check_fields("job spec: device", self.device, DeviceSpec)
        try:
            return DeviceSpec(**{"name": "custom", **self.device})
        except TypeError as exc:
            raise ConfigError(f"job spec: device: {exc}") from exc

    def train_config(self) -> TrainConfig:
        """The worker's settings: the job's train section with its steps and seed."""
        return TrainConfig.from_dict(
            {**self.train.to_dict(), "steps": self.steps, "seed": self.seed}
        )

    @functools.cached_property
    def worker_train(self) -> TrainConfig:
        """`train_config()`, built once per spec (three conversions of the train config,
        ~1 ms; every node hands it to its workers at every assignment)."""
        return self.train_config()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format_version": JOBSPEC_FORMAT_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ModelSpec):
                value = value.to_dict()
            elif isinstance(value, TrainConfig):
                value = {k: v for k, v in value.to_dict().items() if k not in ("steps", "seed")}
            out[f.name] = value
        return out

    def fingerprint(self) -> str:
        """sha256 of what the job's state depends on (see the module docstring)."""
        d = self.to_dict()
        state = {
            key: d[key] for key in ("model", "seed", "global_batch", "steps", "train", "init_from")
        }
        state["model_files"] = (self.model_ref or {}).get("files", {})
        return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()

    @functools.cached_property
    def model_fingerprint(self) -> str:
        """sha256 of the model this spec trains: its canonical spec with the family's options,
        the files it references (`model_ref`), and the data it reads. A generation record's
        plan carries it instead of a model (`Plan.to_record`); a reader whose own differs
        refuses the plan, so nothing an etcd writer puts there is built or run."""
        model = {
            "model": self.model.to_dict(),
            "model_ref": self.model_ref or {},
            "data": {k: getattr(self.train, k) for k in ("data", "data_dtype", "data_shuffle")},
        }
        return hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()

    def plan_record(self, plan: Plan) -> dict[str, Any]:
        """`plan` as a generation record holds it (no model section: its fingerprint)."""
        return plan.to_record(self.model_fingerprint)

    def plan_of(self, record_plan: dict[str, Any]) -> Plan:
        """A generation record's plan with this spec's model; `ConfigError` if it was made
        for another model, options or data (`Plan.from_record`)."""
        return Plan.shared(record_plan, self.model, self.model_fingerprint)

    def identity(self) -> JobIdentity:
        return JobIdentity(self.name, self.fingerprint())

    def to_json(self) -> str:
        """Canonical form stored in etcd: equal specs give equal strings."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        """The canonical form read back (from etcd); `ConfigError` for anything else."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ConfigError("not a JSON object")
            if data.pop("format_version", None) != JOBSPEC_FORMAT_VERSION:
                raise ConfigError("unsupported format_version")
            data["model"] = ModelSpec.from_dict(data["model"], source="job spec model")
            data["train"] = TrainConfig.from_dict(
                {**data["train"], "steps": data["steps"], "seed": data["seed"]}
            )
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(f"job spec in etcd: {exc}") from None
        except (KeyError, TypeError, ValueError, RecursionError) as exc:
            raise ConfigError(f"job spec in etcd: unreadable ({type(exc).__name__})") from None


def _check_int(key: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"job spec: {key} must be an integer >= {minimum}, got {value!r}")


def parse_job_spec(
    data: object, *, source: str = "job spec", base_dir: Path | None = None
) -> JobSpec:
    """Validate a parsed YAML mapping; every message names the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys")
    allowed = {f.name for f in fields(JobSpec)} - {"train"}
    allowed |= {"optimizer", *_TRAIN_KEYS}
    allowed |= {"seq_len", "model_options"}
    allowed -= {"model_ref"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
    values = dict(data)
    _resolve_model(values, source, base_dir)
    train: dict[str, Any] = {}
    optimizer = values.pop("optimizer", None) or {}
    if not isinstance(optimizer, dict):
        raise ConfigError(f"{source}: optimizer must be a mapping")
    bad = sorted(set(optimizer) - set(_OPTIMIZER_KEYS))
    if bad:
        raise ConfigError(
            f"{source}: unknown optimizer key(s) {', '.join(bad)}; "
            f"allowed: {', '.join(_OPTIMIZER_KEYS)}"
        )
    train.update(optimizer)
    for key in _TRAIN_KEYS:
        if key in values:
            train[key] = values.pop(key)
    if base_dir is not None and "data" in train:
        train["data"] = _data_beside(base_dir, train["data"])
    train["steps"] = values["steps"]
    train["seed"] = values["seed"]
    if isinstance(train["steps"], int) and not isinstance(train["steps"], bool):
        values["train"] = TrainConfig.from_dict(train, source=f"{source}")
    else:
        _check_int("steps", train["steps"], minimum=1)
    try:
        return JobSpec(**values)
    except TypeError as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def _data_beside(base_dir: Path, data: object) -> object:
    """`data` with its relative path, or each relative path of a list of shards, resolved
    against the spec file's directory (as `model` is: not the agent's cwd). Anything else is
    returned as it is, for TrainConfig to refuse naming it."""

    def beside(ref: object) -> object:
        return os.path.abspath(base_dir / ref) if isinstance(ref, str) and ref else ref

    return [beside(ref) for ref in data] if isinstance(data, list) else beside(data)


def _resolve_model(values: dict[str, Any], source: str, base_dir: Path | None) -> None:
    """Replace `model` (and `seq_len`, `model_options`) by the resolved spec and reference;
    resolve `init_from` against the spec's directory."""
    from elasticpp.train.model.modelref import resolve_model

    ref = values.pop("model")
    if not isinstance(ref, str) or not ref:
        raise ConfigError(
            f"{source}: model must be a preset, a spec file, a model directory or "
            "package.module:function"
        )
    options = values.pop("model_options", None) or {}
    if not isinstance(options, dict):
        raise ConfigError(f"{source}: model_options must be a mapping")
    seq_len = values.pop("seq_len", None)
    try:
        resolved = resolve_model(ref, base_dir=base_dir, seq_len=seq_len, options=options)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    values["model"] = resolved.spec
    values["model_ref"] = {
        "kind": resolved.kind,
        "ref": resolved.ref,
        "files": dict(resolved.files),
    }
    init = values.get("init_from")
    if init is not None:
        if not isinstance(init, str) or not init:
            raise ConfigError(f"{source}: init_from must be a directory path")
        path = Path(init)
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        if not path.is_dir():
            raise ConfigError(f"{source}: init_from {init!r}: no such directory")
        values["init_from"] = str(path.resolve())
    elif resolved.init_dir is not None:
        values["init_from"] = resolved.init_dir


def load_job_spec(path: str | Path) -> JobSpec:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"job spec {p}: no such file")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"job spec {p}: not valid YAML: {exc}") from exc
    return parse_job_spec(data, source=f"job spec {p}", base_dir=p.parent)


def diff(a: JobSpec, b: JobSpec) -> list[str]:
    """The top-level (and train.*) fields whose values differ."""
    da, db = a.to_dict(), b.to_dict()
    out = []
    for key in sorted(set(da) | set(db)):
        if key == "train":
            ta, tb = da.get(key, {}), db.get(key, {})
            out += [f"{k}" for k in sorted(set(ta) | set(tb)) if ta.get(k) != tb.get(k)]
        elif key == "model_ref" and da.get(key) != db.get(key):
            ra, rb = da.get(key) or {}, db.get(key) or {}
            fa, fb = ra.get("files", {}), rb.get("files", {})
            if (ra.get("kind"), ra.get("ref")) != (rb.get("kind"), rb.get("ref")):
                out.append("model_ref")
            out += [f"model file {n}" for n in sorted(set(fa) | set(fb)) if fa.get(n) != fb.get(n)]
        elif da.get(key) != db.get(key):
            out.append(key)
    return out
