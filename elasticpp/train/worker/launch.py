"""Run one plan on local worker processes: host the store, assign, collect events.

Used by `elasticpp train`, the tests and the schedule benchmark. The store is a TCPStore
hosted here (the launcher outlives every worker); workers connect as clients under the
prefix `gen<G>`. Any worker error or unexpected exit raises `WorkerError`; the caller
kills the workers (see `spawn_workers` / `kill_all`), so nothing is left behind.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticpp.plan import Plan
from elasticpp.train.config import TrainConfig
from elasticpp.train.worker.assignment import Assignment
from elasticpp.train.worker.procs import (
    EXITED,
    WORKER_DEVICE_ENV,
    WorkerError,
    WorkerProcess,
    WorkerTemplate,
)

log = logging.getLogger(__name__)


def spawn_workers(
    count: int,
    log_dir: Path,
    *,
    tag: str = "worker",
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    device: str = "cpu",
    template: WorkerTemplate | None = None,
) -> list[WorkerProcess]:
    """Start `count` warm workers (they import torch, and initialise CUDA for a CUDA
    `device`, and wait for an assignment): forked from `template` when it is usable
    (see `start_template`), else exec'd."""
    env = {**(env if env is not None else os.environ), WORKER_DEVICE_ENV: device}
    workers: list[WorkerProcess] = []
    try:
        for i in range(count):
            workers.append(
                WorkerProcess(
                    log_dir / f"{tag}-{i}.log",
                    python=python,
                    env=env,
                    name=f"{tag}-{i}",
                    template=template,
                )
            )
    except BaseException:
        kill_all(workers)
        raise
    return workers


def start_template(
    log_dir: Path,
    *,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    device: str = "cpu",
    timeout_s: float = 120.0,
) -> WorkerTemplate:
    """A worker template (elasticpp.train.worker.forkserver) for `spawn_workers`, once it is ready
    or failed (then it is not used: workers are exec'd), or `timeout_s` passed (then it is
    given up). The caller closes it after its workers."""
    env = {**(env if env is not None else os.environ), WORKER_DEVICE_ENV: device}
    template = WorkerTemplate(log_dir / "template.log", python=python, env=env)
    if not template.wait_settled(timeout_s):
        template.give_up(f"not ready within {timeout_s:.0f} s")
    return template


def kill_all(workers: Sequence[WorkerProcess]) -> None:
    for w in workers:
        w.kill()


@dataclass
class RunResult:
    outcome: str  # "done" or "stopped"
    final_step: int  # steps applied at the end
    records: list[dict[str, Any]] = field(default_factory=list)  # one per step, see merge_step
    step_events: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # by rank
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    started: list[dict[str, Any]] = field(default_factory=list)


def merge_step(plan: Plan, events: Mapping[int, dict[str, Any]]) -> dict[str, Any]:
    """One record of a step from every rank's step event: rank 0's values plus per-stage
    maxima of in-flight micro-batches and activation bytes, and per-stage busy time."""
    first = events[0]
    stages = range(plan.pp)
    by_stage: dict[int, list[dict[str, Any]]] = {s: [] for s in stages}
    for rank, ev in events.items():
        by_stage[plan.slot(rank).coord.pp].append(ev)
    return {
        "step": first["step"],
        "loss": first["loss"],
        "lr": first["lr"],
        "grad_norm": first["grad_norm"],
        "samples": first["samples"],
        "step_seconds": max(ev["step_seconds"] for ev in events.values()),
        "layout": str(plan.layout),
        "micro_batch": plan.micro_batch,
        "microbatches": list(plan.microbatches),
        "generation": plan.generation,
        "stage_max_in_flight": [max(e["max_in_flight"] for e in by_stage[s]) for s in stages],
        "stage_busy_seconds": [max(e["busy_seconds"] for e in by_stage[s]) for s in stages],
        "stage_peak_activation_bytes": [
            max(e["peak_activation_bytes"] for e in by_stage[s]) for s in stages
        ],
    }


def run_local(
    plan: Plan,
    job: TrainConfig,
    workers: Sequence[WorkerProcess],
    *,
    start_step: int = 0,
    resume_dir: Path | None = None,
    snapshot_dir: Path | None = None,
    snapshot_every: int = 0,
    snapshot_every_s: float = 0.0,
    snapshot_align: int = 1,
    snapshot_when_busy: str = "wait",
    backend: str = "gloo",
    device: str = "cpu",
    num_threads: int | None = None,
    stop_at: int | None = None,
    stop_ranks: Sequence[int] | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    on_snapshot: Callable[[dict[str, Any]], None] | None = None,
    ready_timeout_s: float = 180.0,
    idle_timeout_s: float = 300.0,
) -> RunResult:
    """Train `plan` on `workers` (one per rank, warm) until every one exits.

    `stop_at` sends `{"cmd": "stop_at"}` to `stop_ranks` (default: all) right after the
    assignments. Raises `WorkerError` if a worker reports an error or exits unexpectedly.
    """
    import torch.distributed as dist

    world = plan.gpus_used
    if len(workers) != world:
        raise WorkerError(f"{len(workers)} workers for a world of {world}")
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False
    )
    for w in workers:
        w.wait_ready(ready_timeout_s)
    events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
    rank_of = {id(w): r for r, w in enumerate(workers)}
    for w in workers:
        w.listen(lambda worker, ev: events.put((rank_of[id(worker)], ev)))
    for rank, w in enumerate(workers):
        w.assign(
            Assignment(
                plan=plan,
                rank=rank,
                store_host="127.0.0.1",
                store_port=store.port,
                store_prefix=f"gen{plan.generation}",
                job=job,
                start_step=start_step,
                resume_dir=None if resume_dir is None else str(resume_dir),
                snapshot_dir=None if snapshot_dir is None else str(snapshot_dir),
                snapshot_every=snapshot_every,
                snapshot_every_s=snapshot_every_s,
                snapshot_align=snapshot_align,
                snapshot_when_busy=snapshot_when_busy,
                backend=backend,
                device=device,
                num_threads=num_threads,
            ).to_dict()
        )
    if stop_at is not None:
        for rank in stop_ranks if stop_ranks is not None else range(world):
            workers[rank].stop_at(stop_at)

    result = RunResult(outcome="", final_step=start_step)
    pending: dict[int, dict[int, dict[str, Any]]] = {}
    finished: dict[int, tuple[str, int]] = {}
    exited: set[int] = set()
    while len(exited) < world:
        try:
            rank, ev = events.get(timeout=idle_timeout_s)
        except queue.Empty:
            raise WorkerError(f"no event from any worker in {idle_timeout_s:.0f} s") from None
        kind = ev.get("event")
        if kind == "step":
            result.step_events.setdefault(rank, []).append(ev)
            got = pending.setdefault(int(ev["step"]), {})
            got[rank] = ev
            if len(got) == world:
                record = merge_step(plan, pending.pop(int(ev["step"])))
                result.records.append(record)
                if on_record is not None:
                    on_record(record)
        elif kind == "snapshot":
            result.snapshots.append(ev)
            if on_snapshot is not None:
                on_snapshot(ev)
        elif kind == "started":
            result.started.append(ev)
        elif kind in ("done", "stopped"):
            finished[rank] = (str(kind), int(ev["step"]))
        elif kind == "error":
            raise WorkerError(f"rank {rank}: {ev.get('message')} (log: {workers[rank].log_path})")
        elif kind == EXITED:
            exited.add(rank)
            if ev.get("returncode") != 0 or rank not in finished:
                raise WorkerError(
                    f"rank {rank} (pid {workers[rank].pid}) exited with code "
                    f"{ev.get('returncode')} (log: {workers[rank].log_path})"
                )
    outcomes = set(finished.values())
    if len(outcomes) != 1:
        raise WorkerError(f"ranks ended differently: {sorted(outcomes)}")
    result.outcome, result.final_step = outcomes.pop()
    return result


def default_threads(world: int) -> int:
    """Intra-op threads per worker so that the workers together use the CPU cores once."""
    return max(1, (os.cpu_count() or 1) // world)


def wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    """The pids still alive after waiting up to `timeout_s` (for tests and shutdown checks)."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.05)  # polling a condition with a deadline
    return alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True
