"""Steady-state throughput: elasticpp against torch's own, and the agent's tax, phase by phase.

    python bench/steady.py [--repeats 2] [--sizes small,compute] [--pp 2,4] [--quick]

One invocation, one machine, the same data, global batch (B = 16) and process count on both
sides of every comparison, at two sizes: `small`, the tiny model of `bench/recovery.py`
(8 layers x 64, seq 32), where per-step overheads show, and `compute` (4 layers x 256,
seq 128), where compute dominates a step on this CPU. Every process runs one torch thread.

- dp: `elasticpp train` at `pp=1,tp=1,dp=2` (b = B/2, one micro-batch each, as DDP does)
  against torchrun + DDP (`torchrun_baseline/train_ddp.py`, no checkpoints);
- pp=P: `elasticpp train` at `pp=P` (b = 2) against torch.distributed.pipelining's
  `Schedule1F1B` over the same stage cut (`torchrun_baseline/train_pipe.py`); P = 2 and 4
  (4 processes) at both sizes;
- agent: a job under the agent (`LocalCluster`: real etcd, 2 agent processes of 1 slot, the
  defaults: a snapshot once every writer has been free `snapshot_every_s` (10 s), each one
  replicated to the peer; runs long enough for three of them) against `elasticpp train` at the
  layout the agent's planner chose (b = 2); in between, one phase at a time: the same training
  with the workers' snapshots on the same time rule but no agent, the agent with no snapshots
  (`snapshot_every` past the end), and the agent with snapshots but no replication
  (`replication_copies: 0`). A phase's cost is a difference of those step times within one
  repetition; the table gives its median over the repetitions. The agent with snapshots and
  replication every step (`snapshot_every: 1`, the default before the time rule) runs beside
  them.

Throughput is B x seq_len / the mean interval between consecutive steps' completions after a
warm-up (the steady window's span over its steps, so a periodic slow step counts), from each
system's own per-step records. The configurations of one comparison run
back to back: two of them mirrored (A B B A, then B A A B), so that the machine's drift over
minutes cancels, each one's throughput in a repetition taken over its two runs; the agent's
six once each, in an order rotated every repetition. Every ratio is the median of the ratios
of the same repetition. The machine is shared: read medians, not single
runs. Every process this starts is killed on the way out, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticpp.agent.jobspec import SNAPSHOT_EVERY_S_DEFAULT
from elasticpp.agent.localcluster import LocalCluster, kill_tree
from elasticpp.proctree import sigterm_as_interrupt

BASELINE_DIR = Path(__file__).resolve().parent / "torchrun_baseline"
GLOBAL_BATCH = 16
MICRO_BATCH = 2
# name -> (model preset or spec fields, steps per run, steps per run of the agent's comparison,
# warm-up intervals left out). The agent's runs are longer: their steady window spans at least
# three intervals of the default snapshot rule (SNAPSHOT_EVERY_S_DEFAULT), so that the periodic
# snapshots and replications weigh in it as they do in a long job. At the compute size, where
# the targets are, every comparison runs as long (~40 s a run): windows of 35 steps (~12 s)
# left single repetitions 5-10 % apart.
SIZES: dict[str, tuple[str | dict[str, Any], int, int, int]] = {
    "small": ("tiny", 200, 600, 20),
    "compute": (
        {"name": "steady-compute", "num_layers": 4, "hidden_size": 256, "num_heads": 8}
        | {"vocab_size": 256, "seq_len": 128},
        130,
        130,
        10,
    ),
}
RUN_TIMEOUT_S = 300.0
FULL_AGENT = "agent, defaults (snapshots + replication)"
# The agent's tax, phase by phase: each config adds one phase to the one before it.
PHASE_CONFIGS = (
    "elasticpp train (agent's layout)",
    "+ worker snapshots",
    "agent, no snapshots",
    "agent, snapshots, no replication",
    FULL_AGENT,
)


class BenchError(RuntimeError):
    pass


@dataclass(frozen=True)
class Config:
    """One thing measured: `group` names the comparison, `baseline` the config it is
    compared against (None: it is a baseline)."""

    group: str
    name: str
    run: Callable[[Path], list[float]]  # work dir -> completion time of each step (s)
    baseline: str | None = None
    row: int = 0  # its place in the table


def steady_interval_s(times: Sequence[float], warmup: int) -> float:
    """Mean interval between consecutive steps' completions, the first `warmup` left out:
    the window's span over its steps. A median would hide the periodic slow step (a snapshot
    every few seconds), so throughput is what the whole window trained."""
    done = sorted(times)[warmup:]
    if len(done) < 2:
        raise BenchError(f"{len(times)} steps: too few to measure after {warmup} warm-up")
    return (done[-1] - done[0]) / (len(done) - 1)


def completion_times(rows: Sequence[dict[str, Any]], time_key: str = "time") -> list[float]:
    """Per step, when its last record came (every rank, or every node, had finished it)."""
    done: dict[int, float] = {}
    for r in rows:
        step = int(r["step"])
        done[step] = max(done.get(step, float("-inf")), float(r[time_key]))
    return [done[s] for s in sorted(done)]


def run_order(members: Sequence[Config], rep: int) -> list[Config]:
    """The runs of one repetition of a comparison. Two configs run A B B A (B A A B in every
    other repetition): the machine's speed drifts by a few per cent over minutes, and a
    mirrored order takes a steady drift out of their ratio. More configs (the agent's) run
    once each, in an order rotated every repetition."""
    k = rep % len(members)
    order = list(members[k:]) + list(members[:k])
    if len(order) == 2:
        return order + order[::-1]
    return order


def trained_to_the_end(rows: Sequence[dict[str, Any]], steps: int) -> bool:
    """Whether the per-step records hold every step of a `steps`-step run."""
    return {int(r["step"]) for r in rows} >= set(range(steps))


def ratio_summary(ours: Sequence[float], theirs: Sequence[float]) -> tuple[float, float, float]:
    """Median, min and max of per-repetition throughput ratios (runs paired by index)."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


# --------------------------------------------------------------------------- runners


def model_arg(model: str | dict[str, Any], workdir: Path) -> str:
    """A preset name as is; spec fields written to a file the runners can all read."""
    if isinstance(model, str):
        return model
    path = workdir / f"{model['name']}.json"
    path.write_text(json.dumps(model))
    return str(path)


def run_train(
    model: str, layout: str, micro_batch: int, steps: int, *, snapshots: bool = False
) -> Callable[[Path], list[float]]:
    """`elasticpp train`'s own path (warm workers, `run_local`), optionally with the
    workers' snapshots on the agent's default time rule (written and reported as under an
    agent, nothing else)."""

    def run(workdir: Path) -> list[float]:
        from elasticpp.plan import ClusterSpec, Layout, build_plan, load_device_spec
        from elasticpp.train.config import TrainConfig
        from elasticpp.train.model.modelref import resolve_model
        from elasticpp.train.worker.launch import kill_all, run_local, spawn_workers

        lay = Layout.parse(layout)
        plan = build_plan(
            resolve_model(model).spec,
            ClusterSpec.uniform(1, lay.world_size, load_device_spec("cpu")),
            lay,
            global_batch=GLOBAL_BATCH,
            micro_batch=micro_batch,
        )
        times: list[float] = []
        workers = spawn_workers(plan.gpus_used, workdir, tag="rank")
        try:
            run_local(
                plan,
                TrainConfig(seed=0, steps=steps),
                workers,
                snapshot_dir=workdir / "snapshots" if snapshots else None,
                snapshot_every_s=SNAPSHOT_EVERY_S_DEFAULT if snapshots else 0.0,
                num_threads=1,
                on_record=lambda _record: times.append(time.monotonic()),
            )
        finally:
            kill_all(workers)
        return times

    return run


def _torchrun_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BASELINE_DIR.parent.parent), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    return env


def run_torchrun(
    script: str, nproc: int, steps: int, args: list[str]
) -> Callable[[Path], list[float]]:
    """One torchrun job of `steps` steps to its end (`args` besides `--steps`); its ranks'
    own per-step records."""

    def run(workdir: Path) -> list[float]:
        metrics = workdir / "metrics.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(BASELINE_DIR / script),
            *args,
            "--steps",
            str(steps),
            "--metrics",
            str(metrics),
        ]
        if script == "train_ddp.py":  # its checkpoint file (never written: see ddp_args)
            cmd += ["--ckpt", str(workdir / "ckpt.safetensors")]
        with (workdir / "torchrun.log").open("ab") as log:
            proc = subprocess.Popen(
                cmd,
                env=_torchrun_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait(timeout=10)
            # Ranks torchrun left behind (it died first) are still in its session.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, 9)
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        records = [r for r in rows if r["event"] == "step"]
        if code != 0:
            if not trained_to_the_end(records, steps):
                raise BenchError(f"torchrun {script} exited {code}; see {workdir}/torchrun.log")
            # Every step trained: a crash in torch's teardown (gloo's "terminate called
            # without an active exception" after the last step) is not what is measured.
            print(
                f"warning: torchrun {script} exited {code} after its last step; its steps "
                f"count (see {workdir}/torchrun.log)",
                file=sys.stderr,
            )
        return completion_times(records)

    return run


def run_agent(
    model: str, steps: int, layouts: dict[str, str], **spec: Any
) -> Callable[[Path], list[float]]:
    """A job under 2 agents of 1 slot each to its end; the newest generation's per-step
    records (from the agents' metrics). The layout the planner chose goes into `layouts`."""

    def run(workdir: Path) -> list[float]:
        job = {
            "name": "steady",
            "model": model,
            "global_batch": GLOBAL_BATCH,
            "micro_batch": MICRO_BATCH,
            "steps": steps,
            "seed": 0,
            "min_nodes": 2,
            "max_nodes": 2,
            "lease_ttl_s": 3,
            "join_settle_s": 0.5,
            "hang_timeout_s": 120,
            **spec,
        }
        lc = LocalCluster(workdir / "cluster", job, nodes=2, slots=1)
        try:
            lc.start()
            lc.wait_finished(RUN_TIMEOUT_S)
            rows = lc.metrics()
        finally:
            lc.close()
        newest = max(int(r["generation"]) for r in rows)
        rows = [r for r in rows if int(r["generation"]) == newest]
        layouts[model] = str(rows[0]["layout"])
        return completion_times(rows)

    return run


def configs_for(model: str, steps: int, agent_steps: int, pps: Sequence[int]) -> list[Config]:
    half = GLOBAL_BATCH // 2
    train_args = ["--model", model, "--global-batch", str(GLOBAL_BATCH)]
    ddp_args = [*train_args, "--ckpt-every", str(10**9)]  # no checkpoints
    out = [
        Config("dp=2", "torchrun + DDP", run_torchrun("train_ddp.py", 2, steps, ddp_args)),
        Config(
            "dp=2",
            "elasticpp train dp=2",
            run_train(model, "pp=1,tp=1,dp=2", half, steps),
            baseline="torchrun + DDP",
        ),
    ]
    for pp in pps:
        g = f"pp={pp}"
        pipe_args = [*train_args, "--micro-batch", str(MICRO_BATCH)]
        out.append(
            Config(
                g,
                f"torch Schedule1F1B pp={pp}",
                run_torchrun("train_pipe.py", pp, steps, pipe_args),
            )
        )
        out.append(
            Config(
                g,
                f"elasticpp train pp={pp}",
                run_train(model, f"pp={pp},tp=1,dp=1", MICRO_BATCH, steps),
                baseline=f"torch Schedule1F1B pp={pp}",
            )
        )
    layouts: dict[str, str] = {}

    def train_at_agent_layout(snapshots: bool) -> Callable[[Path], list[float]]:
        def run(workdir: Path) -> list[float]:
            layout = layouts[model]  # the agent's run comes first (see below)
            return run_train(model, layout, MICRO_BATCH, agent_steps, snapshots=snapshots)(workdir)

        return run

    base = "elasticpp train (agent's layout)"
    out += [
        Config("agent", base, train_at_agent_layout(False)),
        Config(
            "agent",
            "agent, snapshots + replication every step",
            run_agent(model, agent_steps, layouts, snapshot_every=1),
            base,
        ),
        Config("agent", "+ worker snapshots", train_at_agent_layout(True), base),
        Config(
            "agent",
            "agent, no snapshots",
            run_agent(model, agent_steps, layouts, snapshot_every=agent_steps + 1),
            base,
        ),
        Config(
            "agent",
            "agent, snapshots, no replication",
            run_agent(model, agent_steps, layouts, replication_copies=0),
            base,
        ),
        Config("agent", FULL_AGENT, run_agent(model, agent_steps, layouts), base),
    ]
    out = [dataclasses.replace(c, row=i) for i, c in enumerate(out)]
    # The full agent runs first: it tells the layout the `elasticpp train` runs compare at.
    return [out[-1], *out[:-1]]


# --------------------------------------------------------------------------- report


def table(size: str, configs: list[Config], tput: dict[str, list[float]], seq_len: int) -> str:
    tokens = GLOBAL_BATCH * seq_len
    lines = [
        f"**{size}** (B = {GLOBAL_BATCH}, seq {seq_len}, {tokens} tokens a step)",
        "",
        "| comparison | system | step (s) | tokens/s median [min–max] | vs baseline, median "
        "[min–max] |",
        "|---|---|---:|---:|---|",
    ]
    configs = sorted(configs, key=lambda c: c.row)
    for c in configs:
        got = tput[c.name]
        med = statistics.median(got)
        vs = "baseline"
        if c.baseline is not None:
            r, lo, hi = ratio_summary(got, tput[c.baseline])
            vs = f"{r:.2f}× [{lo:.2f}–{hi:.2f}] of {c.baseline}"
        lines.append(
            f"| {c.group} | {c.name} | {tokens / med:.3f} | {med:,.0f} [{min(got):,.0f}–"
            f"{max(got):,.0f}] | {vs} |"
        )
    if all(tput.get(name) for name in PHASE_CONFIGS):  # every agent config measured
        # Per repetition (they ran back to back), then the median of each phase.
        reps = [
            [tokens / tput[name][i] for name in PHASE_CONFIGS] for i in range(len(tput[FULL_AGENT]))
        ]
        phases = {
            "the workers' snapshots (copy, serialise, hash, write)": [t[1] - t[0] for t in reps],
            "the agent itself (no state handled)": [t[2] - t[0] for t in reps],
            "commits (store, records) beyond the workers' snapshots": [
                t[3] - t[2] - t[1] + t[0] for t in reps
            ],
            "replication": [t[4] - t[3] for t in reps],
            "total": [t[4] - t[0] for t in reps],
        }
        lines += ["", "| the agent's tax, by phase | s per step, median [min–max] |", "|---|---:|"]
        lines += [
            f"| {label} | {statistics.median(v):+.4f} [{min(v):+.4f} – {max(v):+.4f}] |"
            for label, v in phases.items()
        ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of every config")
    parser.add_argument("--sizes", default="small,compute", help=f"of {', '.join(SIZES)}")
    parser.add_argument("--pp", default="2,4", help="pipeline depths compared, at both sizes")
    parser.add_argument(
        "--groups", default="dp,pp,agent", help="comparisons to run: dp, pp (every depth), agent"
    )
    parser.add_argument("--quick", action="store_true", help="1 repetition, small, pp=2")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and results here")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.sizes, args.pp = 1, "small", "2"
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or args.repeats < 1:
        parser.error(f"--repeats >= 1; sizes are {', '.join(SIZES)} (got {unknown})")
    pps = [int(p) for p in args.pp.split(",") if p]
    bad = set(args.groups.split(",")) - {"dp", "pp", "agent"}
    if bad:
        parser.error(f"--groups: unknown {', '.join(sorted(bad))} (of dp, pp, agent)")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="elasticpp-bench-steady-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {message}", file=sys.stderr, flush=True)

    log(f"sizes {sizes}, pp {pps}, {args.repeats} repetitions; work dir {workdir}")
    results: dict[str, Any] = {"format_version": 1, "runs": []}
    tables = []
    with sigterm_as_interrupt():
        for size in sizes:
            model_spec, steps, agent_steps, warmup = SIZES[size]
            model = model_arg(model_spec, workdir)
            from elasticpp.train.model.modelref import resolve_model

            seq_len = resolve_model(model).spec.seq_len
            wanted = set(args.groups.split(","))
            configs = [
                c
                for c in configs_for(model, steps, agent_steps, pps)
                if c.group.split("=")[0] in wanted
            ]
            tput: dict[str, list[float]] = {c.name: [] for c in configs}
            groups = list(dict.fromkeys(c.group for c in configs))
            for group, rep in itertools.product(groups, range(args.repeats)):
                # The configs of a comparison run back to back (`run_order`): each ratio pairs
                # runs minutes apart at most, and no config always runs first.
                members = [c for c in configs if c.group == group]
                intervals: dict[str, list[float]] = {c.name: [] for c in members}
                for n, c in enumerate(run_order(members, rep)):
                    run_dir = workdir / size / f"rep{rep}" / f"{n}-{c.name.replace(' ', '_')}"
                    run_dir.mkdir(parents=True, exist_ok=True)
                    interval = steady_interval_s(c.run(run_dir), warmup)
                    intervals[c.name].append(interval)
                    results["runs"].append(
                        {"size": size, "rep": rep, "config": c.name, "step_s": interval}
                    )
                    log(f"{size} rep {rep + 1}/{args.repeats}: {c.name}: {interval:.4f} s/step")
                for name, got in intervals.items():
                    tput[name].append(GLOBAL_BATCH * seq_len / statistics.mean(got))
            tables.append(table(size, configs, tput, seq_len))
    (workdir / "results.json").write_text(json.dumps(results, indent=1))
    print("\n\n".join(tables))
    log(f"done in {time.monotonic() - t0:.0f} s")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
