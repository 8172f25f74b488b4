"""The worker process: `python -m elasticpp.train.worker.main`. The narrow interface between a
supervisor (the node agent, `elasticpp train`) and the training engine.

Protocol: JSON lines, one object per line, flushed. See docs/train.md for the full
description; in short:

events: one JSON object per line on the pipe whose descriptor `ELASTICPP_EVENT_FD` names
(stdout when it is not set; with it set, stdout is the log's, like stderr)
    {"event": "ready", "pid": N}                      torch imported, idle, waiting
    {"event": "started", "generation", "rank", "start_step", "setup_seconds", "setup",
     "device_name"}                                    the CUDA device's name, or "cpu"
    {"event": "step", "step", "loss", "lr", "grad_norm", "samples", "step_seconds",
     "max_in_flight", "generation", "rank", "busy_seconds", "pipeline_seconds",
     "peak_activation_bytes"}
    {"event": "snapshot", "step", "dir", "pieces": [{"name", "size", "sha256"}],
     "generation", "rank"}
    {"event": "snapshot_failed", "step", "message", "generation", "rank"}
    {"event": "stopped", "step"} | {"event": "done", "step"}
    {"event": "error", "message", "peer"}             peer: the error followed a peer's loss
                                                       (elasticpp.train.worker.peerloss)
    {"event": "halted", "step", "message"}             the step's loss or gradient norm is
                                                       not finite: nothing after it is written

stdin
    first line: the assignment (`Assignment`); later lines: {"cmd": "stop_at", "step": S}.
    EOF does not stop training.

A snapshot that cannot be written (a full disk, an I/O error) is reported by
"snapshot_failed" and training goes on: the step is simply not committed. A step whose loss or
gradient norm is not finite ends the assignment with "halted": its state, and every later one,
is poisoned, so nothing from it is ever written; the last finite state is the newest
snapshot. Exit code 0 after "done", "stopped" or "halted", 1 after "error". The process
ends with `os._exit` so that a peer that died cannot hold it in process-group teardown.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from elasticpp.errors import ConfigError
from elasticpp.train.config import rendezvous_timeout_s
from elasticpp.train.engine.profiler import StepProfile
from elasticpp.train.worker.assignment import Assignment
from elasticpp.train.worker.peerloss import followed_a_peer
from elasticpp.train.worker.procs import WORKER_DEVICE_ENV
from elasticpp.train.worker.snapshots import SnapshotWriter, is_snapshot_writer

if TYPE_CHECKING:
    from elasticpp.train.worker.hostcopy import HostPiece

log = logging.getLogger("elasticpp.train.worker")


class EventWriter:
    """One JSON object per line on stdout, whole lines only (threads share it)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def emit(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, sort_keys=True)
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()


class StopControl:
    """The smallest stop step any command asked for (commands arrive on another thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stop: int | None = None

    def request(self, step: int) -> None:
        with self._lock:
            self._stop = step if self._stop is None else min(self._stop, step)

    def value(self, default: int) -> int:
        with self._lock:
            return default if self._stop is None else self._stop


def read_commands(stream: TextIO, control: StopControl) -> None:
    """Read command lines until EOF; EOF itself does not stop training."""
    for line in stream:
        line = line.strip()
        if not line:
            continue
        try:
            cmd = json.loads(line)
            if cmd.get("cmd") == "stop_at":
                control.request(int(cmd["step"]))
                log.info("stop requested at step %s", cmd["step"])
            else:
                log.warning("ignoring unknown command %r", cmd.get("cmd"))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring malformed command line %r: %s", line[:200], exc)


def run_assignment(a: Assignment, out: EventWriter, control: StopControl) -> str:
    """Train as assigned; returns "done", "stopped" or "halted" (after emitting it)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from elasticpp.train.data.samples import open_corpus
    from elasticpp.train.engine.kernels import device_name
    from elasticpp.train.engine.parallel import ParallelGroups
    from elasticpp.train.engine.trainer import NO_STOP, Trainer, tie_stages
    from elasticpp.train.model.families import build_model

    t0 = time.monotonic()
    plan, job, rank = a.plan, a.job, a.rank
    gen = plan.generation
    if a.num_threads is not None:
        torch.set_num_threads(a.num_threads)
    timeout = timedelta(seconds=job.pg_timeout_s)
    if a.device == "cuda":
        index = a.gpu_index if a.gpu_index is not None else plan.slot(rank).local_rank
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    setup: dict[str, float] = {}  # where the setup time went (the "started" event says)
    mark = time.monotonic()

    def took(what: str) -> None:
        nonlocal mark
        now = time.monotonic()
        setup[what] = round(now - mark, 4)
        mark = now

    store = dist.TCPStore(  # type: ignore[attr-defined]
        a.store_host,
        a.store_port,
        is_master=False,
        timeout=timedelta(seconds=rendezvous_timeout_s(job.pg_timeout_s, plan.gpus_used)),
    )
    prefixed = dist.PrefixStore(a.store_prefix, store)  # type: ignore[attr-defined]
    dist.init_process_group(
        a.backend, store=prefixed, rank=rank, world_size=plan.gpus_used, timeout=timeout
    )
    took("rendezvous_s")
    model = build_model(plan.model)
    took("model_s")
    groups = ParallelGroups.build(plan, rank, job.pg_timeout_s, tie_stages(model, plan))
    took("groups_s")
    corpus = open_corpus(job, plan.model.seq_len, plan.model.vocab_size)
    trainer = Trainer(plan, job, groups, corpus, device, model)
    took("trainer_s")
    if a.resume_dir is not None:
        trainer.load(Path(a.resume_dir), a.start_step)
    else:
        trainer.init_fresh()
    took("state_s")
    writer = None
    if a.snapshot_dir is not None and is_snapshot_writer(plan, rank):
        from elasticpp.train.worker.hostcopy import HostBuffers

        writer = SnapshotWriter(Path(a.snapshot_dir), out.emit, {"generation": gen, "rank": rank})
        host = HostBuffers(device)
        host.reserve(trainer)  # pinned on a thread of its own while training starts

        def capture() -> list[HostPiece]:
            return host.capture(trainer)

    out.emit(
        {
            "event": "started",
            "generation": gen,
            "rank": rank,
            "start_step": a.start_step,
            "setup_seconds": time.monotonic() - t0,
            "setup": setup,
            "device_name": device_name(device),
        }
    )
    log.info(
        "rank %d (pp=%d tp=%d dp=%d) generation %d starts at step %d",
        rank,
        groups.coord.pp,
        groups.coord.tp,
        groups.coord.dp,
        gen,
        a.start_step,
    )

    step = a.start_step
    stop = trainer.agree_stop(control.value(NO_STOP))
    profile = StepProfile.from_env(rank, a.start_step)
    skip_busy = writer is not None and a.snapshot_when_busy == "skip"
    skipped = 0  # periodic snapshots skipped because some rank's writer was busy

    # The state this generation starts from is the newest one on disk: the time rule counts
    # from the start of training.
    last_snapshot = time.monotonic()

    def writer_idle() -> bool:
        return not skip_busy or writer is None or writer.idle()

    def writer_rested() -> float:
        if writer is None:
            return math.inf  # this rank writes no snapshot: it never holds one back
        idle_at = writer.idle_since()
        return 0.0 if idle_at is None else time.monotonic() - max(idle_at, last_snapshot)

    while step < job.steps and step < stop:
        with profile.around(step):
            res = trainer.train_step(step, control.value(NO_STOP), writer_idle, writer_rested)
        out.emit(
            {
                "event": "step",
                "step": step,
                "loss": res.loss,
                "lr": res.lr,
                "grad_norm": res.grad_norm,
                "samples": res.samples,
                "step_seconds": res.step_seconds,
                "max_in_flight": res.max_in_flight,
                "generation": gen,
                "rank": rank,
                "busy_seconds": res.busy_seconds,
                "pipeline_seconds": res.pipeline_seconds,
                "peak_activation_bytes": res.peak_activation_bytes,
            }
        )
        if not (math.isfinite(res.loss) and math.isfinite(res.grad_norm)):
            # Every rank sees the same global loss and norm, so every rank halts here. The
            # optimizer has applied a poisoned update: no state from here on is written.
            message = (
                f"step {step}: loss {res.loss} / gradient norm {res.grad_norm} is not finite; "
                "training halts at the last finite state"
            )
            if writer is not None:
                writer.flush()
            log.error("rank %d %s", rank, message)
            out.emit({"event": "halted", "step": step, "message": message})
            return "halted"
        step += 1
        stop = res.stop_at
        if writer is not None:
            writer.check()
            periodic = a.snapshot_due(step, res.writers_rested_s)
            if periodic and step < job.steps and step < stop:
                if res.writers_idle:  # the same answer on every rank: see Trainer.train_step
                    writer.submit(step, capture)
                    last_snapshot = time.monotonic()
                else:
                    skipped += 1
                    if skipped in (1, 10, 100) or skipped % 1000 == 0:
                        log.info(
                            "rank %d: %d snapshot(s) skipped so far, a writer was busy "
                            "(snapshot_when_busy: skip)",
                            rank,
                            skipped,
                        )
    outcome = "done" if step >= job.steps else "stopped"
    if writer is not None and writer.last_step != step:
        # The final state, and the state at a stop, are written before the event says so.
        writer.write_now(step, capture)
    elif writer is not None:
        writer.flush()
    log.info("rank %d %s at step %d", rank, outcome, step)
    out.emit({"event": outcome, "step": step})
    return outcome


def _die_with_parent() -> None:
    """A worker never outlives its supervisor: if the agent is killed (even with SIGKILL),
    its workers follow at once instead of lingering as orphans holding GPUs."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)

    def watch() -> None:
        # Also covers platforms without PR_SET_PDEATHSIG.
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _event_stream() -> TextIO:
    """The event pipe the supervisor handed over (not inherited by anything this process
    starts, so its end closes when this process does), else stdout."""
    fd = os.environ.pop("ELASTICPP_EVENT_FD", None)
    if fd is None:
        return sys.stdout
    os.set_inheritable(int(fd), False)
    return os.fdopen(int(fd), "w", encoding="utf-8", buffering=1)


def preload() -> None:
    """Import everything an assignment needs, and run nothing: no thread pool, no CUDA.
    The worker template (elasticpp.train.worker.forkserver) calls this once and forks warm workers
    from it; a fork copies only the thread that calls it."""
    import torch.distributed  # noqa: F401  (torch with it)


def prepare(cuda: bool) -> None:
    """Import and run once everything an assignment needs before saying "ready": a warm
    worker must never pay an import on the recovery path (tests/unit/test_worker_prepare.py
    checks that an assignment's optimizer and first step import nothing after this)."""
    preload()
    import torch

    from elasticpp.train.engine.kernels import warm_up

    torch.zeros(1)  # touch the allocator and the thread pool once
    warm_up()  # the optimizer's lazy imports and autograd's first backward
    if cuda:
        # The driver and CUDA's libraries; no context on a device until the assignment.
        torch.cuda.init()  # type: ignore[no-untyped-call]


def main() -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
    out = EventWriter(_event_stream())
    _die_with_parent()
    prepare(os.environ.get(WORKER_DEVICE_ENV) == "cuda")
    out.emit({"event": "ready", "pid": os.getpid()})
    try:
        line = sys.stdin.readline()
        if not line.strip():
            raise ConfigError("no assignment on stdin")
        try:
            data = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"assignment is not JSON: {exc}") from exc
        assignment = Assignment.from_dict(data)
        control = StopControl()
        threading.Thread(
            target=read_commands, args=(sys.stdin, control), name="commands", daemon=True
        ).start()
        run_assignment(assignment, out, control)
        code = 0
    except BaseException as exc:  # every failure becomes an event and a non-zero exit
        log.exception("worker failed")
        # If the supervisor is gone the write fails; the exit code still says it.
        with contextlib.suppress(OSError, ValueError):
            out.emit(
                {
                    "event": "error",
                    "message": f"{type(exc).__name__}: {exc}",
                    "peer": followed_a_peer(exc),  # a peer went away: it failed after it
                }
            )
        code = 1
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
