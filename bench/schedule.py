"""Pipeline schedule benchmark: measured bubble and activation memory, 1F1B vs GPipe.

For m in {4, 8, 16} micro-batches (b = 1, so B = m) it trains a few steps with pp = P
(tp = dp = 1) under each schedule on local CPU worker processes, and prints a markdown
table of:

- the measured bubble: per stage, 1 - (time computing forwards/backwards) / (time of the
  whole schedule), averaged over stages, median over the steps after the first two;
- the theoretical bubble (p - 1) / (m + p - 1);
- the most micro-batches in flight and the peak bytes autograd held saved for them, on
  stage 0 (the stage that holds the most under 1F1B).

Usage: python bench/schedule.py [--pp 2] [--model small] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from elasticpp.plan import ClusterSpec, Layout, build_plan, load_device_spec, load_model_spec
from elasticpp.train.config import TrainConfig
from elasticpp.train.worker.launch import RunResult, kill_all, run_local, spawn_workers


def measured_bubble(result: RunResult, skip: int) -> float:
    fractions = []
    for events in result.step_events.values():
        per_step = [
            1.0 - ev["busy_seconds"] / ev["pipeline_seconds"]
            for ev in events
            if ev["step"] >= skip and ev["pipeline_seconds"] > 0
        ]
        fractions.append(statistics.median(per_step))
    return statistics.mean(fractions)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--microbatches", default="4,8,16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = parser.parse_args()

    model = load_model_spec(args.model)
    layout = Layout(args.pp, 1, 1)
    cluster = ClusterSpec.uniform(1, layout.world_size, load_device_spec("cpu"))
    cases = [
        (m, schedule)
        for m in (int(x) for x in args.microbatches.split(","))
        for schedule in ("1f1b", "gpipe")
    ]
    logs = Path(tempfile.mkdtemp(prefix="elasticpp-bench-schedule-"))
    print(
        f"model {model.name} (layers {model.num_layers}, hidden {model.hidden_size}, seq "
        f"{model.seq_len}), {layout}, b=1, {args.steps} steps, {args.threads} thread(s) per "
        f"worker, gloo on CPU",
        file=sys.stderr,
    )
    rows = []
    upcoming = spawn_workers(layout.world_size, logs, tag="case0")
    try:
        for i, (m, schedule) in enumerate(cases):
            workers, upcoming = upcoming, []
            try:
                if i + 1 < len(cases):
                    upcoming = spawn_workers(layout.world_size, logs, tag=f"case{i + 1}")
                plan = build_plan(model, cluster, layout, global_batch=m, micro_batch=1)
                job = TrainConfig(steps=args.steps, schedule=schedule)
                result = run_local(plan, job, workers, num_threads=args.threads)
            finally:
                kill_all(workers)
            stage0 = result.step_events[0]
            p = layout.pp
            rows.append(
                (
                    m,
                    schedule,
                    measured_bubble(result, skip=2),
                    (p - 1) / (m + p - 1),
                    statistics.median(r["step_seconds"] for r in result.records[2:]),
                    max(ev["max_in_flight"] for ev in stage0),
                    max(ev["peak_activation_bytes"] for ev in stage0) / 2**20,
                )
            )
            print(f"done m={m} {schedule}", file=sys.stderr)
    finally:
        kill_all(upcoming)

    print(
        "| m | schedule | measured bubble | (p-1)/(m+p-1) | step s | stage-0 max in flight "
        "| stage-0 peak activations MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for m, schedule, bubble, theory, step_s, in_flight, act_mib in rows:
        print(
            f"| {m} | {schedule} | {bubble:.3f} | {theory:.3f} | {step_s:.3f} | {in_flight} "
            f"| {act_mib:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
