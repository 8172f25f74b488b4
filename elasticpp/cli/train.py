"""`elasticpp train`: train with a fixed (p, t, d) layout on local worker processes.

Everything is validated before any process starts (bad input: one line, exit code 2). A
worker that fails or dies ends the command within seconds with exit code 1; every worker
process group is killed on the way out, also on Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from elasticpp.checkpoint.manifest import find_step_dir
from elasticpp.cli import flagtypes
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.plan import ClusterSpec, Layout, ModelSpec, build_plan, load_device_spec
from elasticpp.train.config import DATA_DTYPES, PRECISIONS, SCHEDULES, TrainConfig

log = logging.getLogger("elasticpp.train")
_DEFAULTS = TrainConfig()


def add_parser(parser: argparse.ArgumentParser) -> None:
    positive, nonnegative = flagtypes.positive_int, flagtypes.nonnegative_float
    parser.add_argument(
        "--model",
        type=flagtypes.nonempty,
        default="tiny",
        help="preset, spec file, Hugging Face model directory, or package.module:function (tiny)",
    )
    parser.add_argument(
        "--seq-len", type=flagtypes.positive_int, default=None, help="sequence length (the model's)"
    )
    parser.add_argument(
        "--model-option",
        action="append",
        type=flagtypes.key_value,
        default=[],
        metavar="KEY=VALUE",
        help="a model family or user-function option (VALUE as JSON, else a string); repeatable",
    )
    parser.add_argument(
        "--init-from",
        type=flagtypes.path,
        default=None,
        help="start from the weights of an elasticpp step dir or a Hugging Face directory",
    )
    parser.add_argument(
        "--layout", type=flagtypes.layout, default="pp=1,tp=1,dp=1", help="pp=P,tp=T,dp=D"
    )
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="full activation recomputation: keep block inputs only, re-run blocks in backward",
    )
    parser.add_argument("--global-batch", type=positive, default=16, help="samples per step B (16)")
    parser.add_argument("--micro-batch", type=positive, default=2, help="micro-batch size b (2)")
    parser.add_argument("--steps", type=positive, default=_DEFAULTS.steps, help="total steps")
    parser.add_argument("--seed", type=flagtypes.nonnegative_int, default=_DEFAULTS.seed)
    parser.add_argument("--schedule", choices=SCHEDULES, default=_DEFAULTS.schedule)
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=_DEFAULTS.precision,
        help=f"compute precision, one of {', '.join(PRECISIONS)}; bf16 keeps fp32 weights, "
        "optimizer state and checkpoints (fp32)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile every block with torch.compile (a worker's first step compiles)",
    )
    parser.add_argument(
        "--lr", type=flagtypes.positive_float, default=_DEFAULTS.lr, help="peak learning rate"
    )
    parser.add_argument("--min-lr", type=nonnegative, default=_DEFAULTS.min_lr)
    parser.add_argument(
        "--warmup-steps", type=flagtypes.nonnegative_int, default=_DEFAULTS.warmup_steps
    )
    parser.add_argument("--weight-decay", type=nonnegative, default=_DEFAULTS.weight_decay)
    parser.add_argument(
        "--clip-grad", type=nonnegative, default=_DEFAULTS.clip_grad, help="0 = off"
    )
    parser.add_argument("--dropout", type=flagtypes.fraction, default=_DEFAULTS.dropout)
    parser.add_argument(
        "--data",
        nargs="+",
        type=flagtypes.nonempty,
        default=None,
        metavar="PATH",
        help="token file (.npy, or .bin with its sidecar or --data-dtype), token shards (several "
        "files, or a directory of them), raw-byte file or directory (default: stdlib .py)",
    )
    parser.add_argument(
        "--data-dtype",
        choices=DATA_DTYPES,
        default=None,
        help="read a .bin --data without a sidecar as flat little-endian token ids of this type",
    )
    parser.add_argument(
        "--no-shuffle",
        action="store_true",
        help="token files: read the windows in file order instead of a seeded order per epoch",
    )
    parser.add_argument(
        "--corpus-max-bytes",
        type=positive,
        default=_DEFAULTS.corpus_max_bytes,
        help="refuse a raw-byte --data larger than this (4 MiB)",
    )
    parser.add_argument(
        "--metrics", type=flagtypes.path, default=None, help="JSON lines, one per step"
    )
    parser.add_argument(
        "--save", type=flagtypes.path, default=None, help="write the final state here"
    )
    parser.add_argument(
        "--save-every",
        type=flagtypes.nonnegative_int,
        default=0,
        help="with --save: also every N steps (0 = off)",
    )
    parser.add_argument(
        "--resume", type=flagtypes.path, default=None, help="a saved step dir or root"
    )
    parser.add_argument(
        "--stop-at", type=flagtypes.nonnegative_int, default=None, help="stop after this many steps"
    )
    parser.add_argument(
        "--log-dir", type=flagtypes.path, default=None, help="worker logs (a temp dir)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=positive, default=None, help="torch threads per worker")
    parser.add_argument(
        "--pg-timeout",
        type=flagtypes.positive_float,
        default=_DEFAULTS.pg_timeout_s,
        help="seconds (60)",
    )


def parse_model_options(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` pairs; VALUE is read as JSON (true, 3, 1e-5) or else taken as a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--model-option {item!r}: expected KEY=VALUE")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        if not isinstance(value, (bool, int, float, str, type(None))):
            raise ConfigError(f"--model-option {item!r}: VALUE must be a number, bool or string")
        out[key] = value
    return out


# What names a model rather than defining it: a resumed run may rename its model directory.
_NOT_IDENTITY = ("name", "numbers")


def model_differences(saved: ModelSpec | None, model: ModelSpec) -> list[str]:
    """`field saved-value (checkpoint) vs value (--model)` for each field that differs; empty
    when they are the same model or the checkpoint did not record one (its units are checked)."""
    if saved is None:
        return []
    a, b = saved.to_dict(), model.to_dict()
    return [
        f"{key} {a.get(key)!r} (checkpoint) vs {b.get(key)!r} (--model)"
        for key in sorted(set(a) | set(b))
        if key not in _NOT_IDENTITY and a.get(key) != b.get(key)
    ]


def _data_arg(paths: list[str] | None) -> str | tuple[str, ...] | None:
    """One path as given (a file or a directory), several as a list of token shards."""
    if paths is None:
        return None
    resolved = [str(Path(p).resolve()) for p in paths]
    return resolved[0] if len(resolved) == 1 else tuple(resolved)


def _validate(
    args: argparse.Namespace,
) -> tuple[Any, TrainConfig, Path | None, int, Path | None]:
    from elasticpp.train.model.modelref import resolve_model

    ref = resolve_model(
        args.model, seq_len=args.seq_len, options=parse_model_options(args.model_option)
    )
    model = ref.spec
    init_from = args.init_from.resolve() if args.init_from is not None else None
    if init_from is not None and args.resume is not None:
        raise ConfigError("--init-from starts a new job; --resume continues one: give one")
    if init_from is None and ref.init_dir is not None and args.resume is None:
        # A Hugging Face directory defines the model and, for a new run, its first weights; a
        # resumed run takes its weights from the checkpoint, as torchtitan and the HF Trainer do.
        init_from = Path(ref.init_dir)
    if init_from is not None and not init_from.exists():
        raise ConfigError(f"--init-from {init_from}: no such directory")
    layout = Layout.parse(args.layout)
    for name in ("global_batch", "micro_batch"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    device = load_device_spec("cpu")
    plan = build_plan(
        model,
        ClusterSpec.uniform(1, layout.world_size, device),
        layout,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        recompute=args.recompute,
    )
    job = TrainConfig(
        seed=args.seed,
        steps=args.steps,
        lr=args.lr,
        min_lr=min(args.min_lr, args.lr),
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        dropout=args.dropout,
        schedule=args.schedule,
        precision=args.precision,
        compile=args.compile,
        data=_data_arg(args.data),
        data_dtype=args.data_dtype,
        data_shuffle=not args.no_shuffle,
        corpus_max_bytes=args.corpus_max_bytes,
        pg_timeout_s=args.pg_timeout,
    )
    missing = [p for p in args.data or () if not Path(p).exists()]
    if missing:
        raise ConfigError(f"--data {missing[0]}: no such file or directory")
    from elasticpp.train.data.samples import check_data  # numpy only: no torch in this process

    check_data(job, model.seq_len, model.vocab_size)
    if args.threads is not None and args.threads <= 0:
        raise ConfigError("--threads must be positive")
    if args.save_every < 0:
        raise ConfigError("--save-every must be >= 0")
    if args.stop_at is not None and args.stop_at < 0:
        raise ConfigError("--stop-at must be >= 0")
    resume_dir, start_step = None, 0
    if args.resume is not None:
        from elasticpp.checkpoint.manifest import verify_step_dir

        resume_dir = find_step_dir(args.resume, what="--resume").resolve()
        manifest = verify_step_dir(resume_dir)
        differ = model_differences(manifest.model, model)
        if differ:
            raise CheckpointError(
                f"--resume {resume_dir}: a checkpoint of another model than --model "
                f"{args.model}: {'; '.join(differ)}"
            )
        if manifest.units != model.units or not manifest.is_full_model():
            raise CheckpointError(
                f"--resume {resume_dir}: not a full state of {model.name} "
                f"({len(model.units)} units; missing: {', '.join(manifest.missing_units()[:6])}"
                f"{'' if manifest.units == model.units else '; the units differ'})"
            )
        start_step = manifest.step
        if start_step >= job.steps:
            raise ConfigError(
                f"--resume {resume_dir} is at step {start_step}; --steps {job.steps} leaves "
                "nothing to train"
            )
    return plan, job, resume_dir, start_step, init_from


class _Terminated(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    plan, job, resume_dir, start_step, init_from = _validate(args)

    from elasticpp.checkpoint.manifest import (
        Manifest,
        PieceKey,
        step_dirname,
        verify_step_dir,
        write_manifest,
    )
    from elasticpp.checkpoint.manifest import PieceEntry as Entry
    from elasticpp.train.worker.launch import (
        default_threads,
        kill_all,
        run_local,
        spawn_workers,
        start_template,
    )
    from elasticpp.train.worker.procs import WorkerError, WorkerTemplate
    from elasticpp.train.worker.snapshots import is_snapshot_writer

    # Worker logs go to --log-dir, or to a temporary directory that is removed when the run
    # ends well and kept (and named on stderr) when it does not.
    own_log_dir = args.log_dir is None
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="elasticpp-train-"))
    succeeded = False
    if init_from is not None:
        from elasticpp.train.model.hf import write_init_step

        resume_dir = write_init_step(plan.model, init_from, log_dir / "init")
    save_dir = None if args.save is None else args.save.resolve()
    metrics = None if args.metrics is None else args.metrics.open("w", encoding="utf-8")

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise _Terminated(f"signal {signum}")

    old_term = signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C stops the run whatever SIGINT's disposition was at start: a shell without job
    # control starts background commands with SIGINT ignored, and Python keeps it so.
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    workers: list[Any] = []
    template: WorkerTemplate | None = None
    started = time.monotonic()
    try:
        if plan.gpus_used > 1:
            # One process imports torch and forks the ranks (elasticpp.train.worker.forkserver);
            # where it cannot, the ranks are exec'd.
            template = start_template(log_dir, device=args.device)
        workers = spawn_workers(
            plan.gpus_used, log_dir, tag="rank", device=args.device, template=template
        )

        def on_record(record: dict[str, Any]) -> None:
            if metrics is not None:
                metrics.write(json.dumps(record, sort_keys=True) + "\n")
                metrics.flush()
            print(
                f"step {record['step']:5d}  loss {record['loss']:.6f}  lr {record['lr']:.3e}  "
                f"grad_norm {record['grad_norm']:.4f}  {record['step_seconds']:.3f} s",
                flush=True,
            )

        writers = sum(is_snapshot_writer(plan, r) for r in range(plan.gpus_used))
        by_step: dict[int, list[dict[str, Any]]] = {}
        saved: set[int] = set()

        def on_snapshot(event: dict[str, Any]) -> None:
            # The manifest goes last, once every writing rank has reported its pieces.
            step = int(event["step"])
            by_step.setdefault(step, []).append(event)
            if len(by_step[step]) < writers or save_dir is None:
                return
            step_dir = save_dir / step_dirname(step)
            entries = [
                Entry(PieceKey.parse(p["name"]), int(p["size"]), str(p["sha256"]))
                for ev in by_step.pop(step)
                for p in ev["pieces"]
            ]
            write_manifest(
                step_dir, Manifest(step, plan.model.units, tuple(entries), model=plan.model)
            )
            if not verify_step_dir(step_dir).is_full_model():
                raise CheckpointError(f"{step_dir}: the saved state is incomplete")
            saved.add(step)
            print(f"saved step {step} to {step_dir}", flush=True)

        result = run_local(
            plan,
            job,
            workers,
            start_step=start_step,
            resume_dir=resume_dir,
            snapshot_dir=save_dir,
            snapshot_every=args.save_every,
            backend="nccl" if args.device == "cuda" else "gloo",
            device=args.device,
            num_threads=args.threads or default_threads(plan.gpus_used),
            stop_at=args.stop_at,
            on_record=on_record,
            on_snapshot=on_snapshot,
        )
        if save_dir is not None and result.final_step not in saved:
            raise CheckpointError(f"step {result.final_step}: not every piece was written")
        print(
            f"{result.outcome} at step {result.final_step} ({plan.layout}, "
            f"{time.monotonic() - started:.1f} s)",
            flush=True,
        )
        succeeded = True
        return 0
    except WorkerError as exc:
        print(f"elasticpp train: error: {exc}", file=sys.stderr)
        return 1
    except _Terminated:
        print("elasticpp train: terminated", file=sys.stderr)
        return 143
    finally:
        kill_all(workers)
        if template is not None:
            template.close()
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
        if metrics is not None:
            metrics.close()
        if own_log_dir and succeeded:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif own_log_dir:
            print(f"elasticpp train: worker logs are in {log_dir}", file=sys.stderr)
