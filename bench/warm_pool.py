"""How long a node takes to fill its warm pool: exec'd workers against workers forked from the
worker template (elasticpp.train.worker.forkserver), in one run, on this machine.

Three ways to get `count` warm workers (torch imported, one update run, waiting for an
assignment), each timed from the request to the last worker's "ready":

- exec: `count` new interpreters import torch at once (every spawn before the template);
- refill: forked from a template that is already running (what a node does after every
  generation takes its spares);
- cold: a template started now, then `count` forks (an agent's start).

Runs alternate within a repetition, so drift on a shared machine hits each alike; the table
gives medians and the ratio to exec within each repetition.

    python bench/warm_pool.py --workers 2,4,8 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from elasticpp.proctree import sigterm_as_interrupt
from elasticpp.train.worker.launch import kill_all, spawn_workers, start_template
from elasticpp.train.worker.procs import WorkerProcess, WorkerTemplate

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _fill(count: int, logs: Path, template: WorkerTemplate | None) -> float:
    started = time.monotonic()
    workers: list[WorkerProcess] = []
    try:
        workers = spawn_workers(count, logs, env=ENV, template=template)
        if template is not None and not all(w.forked for w in workers):
            raise RuntimeError(f"not forked: {template.why_not}")
        for w in workers:
            w.wait_ready(600)
        return time.monotonic() - started
    finally:
        kill_all(workers)


def exec_fill(count: int, logs: Path) -> float:
    return _fill(count, logs, None)


def refill(count: int, logs: Path, template: WorkerTemplate) -> float:
    return _fill(count, logs, template)


def cold_fill(count: int, logs: Path) -> float:
    started = time.monotonic()
    template = start_template(logs, env=ENV)
    try:
        if not template.usable():
            raise RuntimeError(f"template not usable: {template.why_not}")
        _fill(count, logs, template)
        return time.monotonic() - started
    finally:
        template.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4,8", help="pool sizes, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.workers.split(",")]
    rows: dict[tuple[int, str], list[float]] = {}
    ratios: dict[tuple[int, str], list[float]] = {}
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="elasticpp-warm-") as tmp:
        logs = Path(tmp)
        template = start_template(logs / "running", env=ENV)
        if not template.usable():
            print(f"the template is not usable here: {template.why_not}", file=sys.stderr)
            return 1
        try:
            for rep in range(args.repeat):
                for count in counts:
                    order = ["exec", "refill", "cold"]
                    if rep % 2:
                        order.reverse()
                    got: dict[str, float] = {}
                    for how in order:
                        if how == "exec":
                            got[how] = exec_fill(count, logs)
                        elif how == "refill":
                            got[how] = refill(count, logs, template)
                        else:
                            got[how] = cold_fill(count, logs / f"cold-{rep}-{count}")
                    for how, s in got.items():
                        rows.setdefault((count, how), []).append(s)
                        ratios.setdefault((count, how), []).append(got["exec"] / s)
                    print(
                        f"rep {rep} count {count}: "
                        + ", ".join(f"{h} {got[h]:.2f} s" for h in ("exec", "refill", "cold")),
                        flush=True,
                    )
        finally:
            template.close()
    print()
    print("| warm workers | how | time to all ready, median [min–max] (s) | faster than exec |")
    print("|---:|---|---|---|")
    for count in counts:
        for how in ("exec", "refill", "cold"):
            t = rows[(count, how)]
            r = ratios[(count, how)]
            print(
                f"| {count} | {how} | {statistics.median(t):.2f} [{min(t):.2f}–{max(t):.2f}] "
                f"| {'baseline' if how == 'exec' else f'{statistics.median(r):.1f}×'} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
