"""`elasticpp demo`: the elastic job on one machine, a node killed and brought back.

Starts a local etcd and 4 agents with 2 worker slots each, trains the tiny model, kills
one node (agent and workers, SIGKILL) mid-run, brings it back later, then checks the loss
curve against an uninterrupted run of the same job and draws both.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from elasticpp.cli import flagtypes

# The job's batch, the same for the elastic run and the reference. Its size sets how long a
# step takes: with 16 samples the tiny model ran ~12 steps a second on 2 cores, and the job
# ended before the restarted node's cold start (its agent and warm workers import torch)
# was over, so the join never showed; 128 leaves the join ~half the run.
GLOBAL_BATCH = 128
MICRO_BATCH = 2


def add_parser(p: argparse.ArgumentParser) -> None:
    positive, nonnegative = flagtypes.positive_int, flagtypes.nonnegative_int
    p.add_argument("--out", type=flagtypes.path, default=Path("demo-out"), help="output directory")
    p.add_argument("--nodes", type=positive, default=4, help="agents (at least 2)")
    p.add_argument("--slots", type=positive, default=2, help="worker slots per node")
    p.add_argument("--steps", type=positive, default=60, help="steps of the job")
    p.add_argument("--kill-at", type=nonnegative, default=10, help="kill a node after this step")
    p.add_argument(
        "--rejoin-at", type=nonnegative, default=16, help="bring it back after this step"
    )
    p.add_argument(
        "--timeout",
        type=flagtypes.positive_float,
        default=600.0,
        help="give up after this long (s)",
    )


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    import shutil
    import subprocess
    import sys
    import time

    from elasticpp.agent.localcluster import LocalCluster
    from elasticpp.errors import ConfigError

    if args.nodes < 2:
        raise ConfigError("--nodes must be >= 2 (one of them is killed)")
    if not 0 <= args.kill_at < args.rejoin_at < args.steps - 1:
        raise ConfigError("need 0 <= --kill-at < --rejoin-at < --steps - 1")
    logging.basicConfig(level=logging.WARNING)
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    spec = {
        "name": "demo",
        "model": "tiny",
        "global_batch": GLOBAL_BATCH,
        "micro_batch": MICRO_BATCH,
        "steps": args.steps,
        "seed": 0,
        "min_nodes": 1,
        "max_nodes": args.nodes,
        "lease_ttl_s": 3,
        "join_settle_s": 1.0,
        "hang_timeout_s": 30,
    }
    victim = f"node-{args.nodes - 1}"
    t0 = time.monotonic()
    marks: dict[str, int] = {}
    print(
        f"elasticpp demo: {args.nodes} nodes x {args.slots} slots, tiny model, "
        f"{args.steps} steps; {victim} is killed after step {args.kill_at} and rejoins "
        f"after step {args.rejoin_at}. Output in {out}/"
    )
    ref_proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "elasticpp.cli.main",
            "train",
            "--model",
            "tiny",
            "--layout",
            "pp=1,tp=1,dp=1",
            "--global-batch",
            str(GLOBAL_BATCH),
            "--micro-batch",
            str(MICRO_BATCH),
            "--steps",
            str(args.steps),
            "--seed",
            "0",
            "--metrics",
            str(out / "reference.jsonl"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(out / "reference.log").open("wb"),
        start_new_session=True,
    )
    bar = _Bar(args.steps)
    try:
        with LocalCluster(out / "cluster", spec, nodes=args.nodes, slots=args.slots) as lc:
            lc.start()

            def tick() -> None:
                bar.update(lc.max_step() + 1, _phase(marks))

            lc.wait_for(
                lambda: lc.max_step() >= args.kill_at, args.timeout, f"step {args.kill_at}", tick
            )
            marks["killed"] = lc.max_step()
            lc.kill_node(victim)
            bar.note(f"killed {victim} (agent + workers, SIGKILL) after step {marks['killed']}")
            lc.wait_for(
                lambda: lc.max_step() >= args.rejoin_at,
                args.timeout,
                f"step {args.rejoin_at}",
                tick,
            )
            marks["rejoined"] = lc.max_step()
            lc.start_node(victim)
            bar.note(f"restarted {victim} after step {marks['rejoined']}")
            lc.wait_finished(args.timeout, tick)
            bar.update(args.steps, "finished")
            bar.close()
            curve = lc.curve()
            timelines = lc.timelines()
        ref_proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - t0)))
    finally:
        bar.close()
        if ref_proc.poll() is None:
            from elasticpp.agent.localcluster import kill_tree

            kill_tree(ref_proc.pid)
            ref_proc.wait()
    if ref_proc.returncode != 0:
        print(f"reference run failed; see {out / 'reference.log'}", file=sys.stderr)
        return 1
    ref = {
        int(r["step"]): float(r["loss"])
        for r in map(json.loads, (out / "reference.jsonl").read_text().splitlines())
    }
    _print_timeline(timelines)
    if "rejoined" in marks and not any(
        str(t.get("reason", "")).startswith("join") and victim in str(t.get("reason", ""))
        for t in timelines
    ):
        # Training outran the restarted node's cold start: say so, not a silent table.
        print(
            f"note: {victim} was restarted after step {marks['rejoined']} but the job ended "
            f"before it was planned back in; a larger --steps gives its join time to show"
        )
    worst = 0.0
    missing = [s for s in range(args.steps) if s not in curve]
    for step, (loss, _gen) in curve.items():
        worst = max(worst, abs(loss - ref[step]) / abs(ref[step]))
    ok = not missing and worst <= 1e-4
    png = out / "loss.png"
    _plot(png, curve, ref, marks, timelines)
    print(
        f"loss curve vs. an uninterrupted run on one worker: {len(curve)}/{args.steps} steps, "
        f"largest relative difference {worst:.2e} -> {'MATCH' if ok else 'MISMATCH'}"
    )
    if missing:
        print(f"missing steps: {missing}")
    print(f"plot: {png}   total {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1


def _phase(marks: dict[str, int]) -> str:
    if "rejoined" in marks:
        return "node back"
    if "killed" in marks:
        return "node lost"
    return "4 nodes"


class _Bar:
    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="step", dynamic_ncols=True)
        self._n = 0

    def update(self, n: int, phase: str) -> None:
        if n > self._n:
            self._bar.update(n - self._n)
            self._n = n
        self._bar.set_postfix_str(phase, refresh=False)

    def note(self, text: str) -> None:
        self._bar.write(text)

    def close(self) -> None:
        self._bar.close()


def _print_timeline(timelines: list[dict[str, object]]) -> None:
    print("\nrecoveries (seconds after detection):")
    print(
        f"{'gen':>3}  {'reason':28s} {'layout before':>20s} -> {'layout after':20s} "
        f"{'planned':>7} {'stopped':>7} {'moved':>6} {'resumed':>7} {'resume@':>7} "
        f"{'recomputed':>10}"
    )
    for t in timelines:
        print(
            f"{t['generation']:>3}  {str(t['reason'])[:28]:28s} "
            f"{str(t['layout_before']) or '-':>20s} -> {t['layout_after']!s:20s} "
            f"{float(t['planned_s']):7.2f} {float(t['stopped_s']):7.2f} "  # type: ignore[arg-type]
            f"{float(t['moved_s']):6.2f} {float(t['resumed_s']):7.2f} "  # type: ignore[arg-type]
            f"{t['resume_step']:>7} {t['steps_recomputed']:>10}"
        )
    print()


def _plot(
    path: Path,
    curve: dict[int, tuple[float, int]],
    ref: dict[int, float],
    marks: dict[str, int],
    timelines: list[dict[str, object]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = sorted(ref)
    ax.plot(steps, [ref[s] for s in steps], color="0.6", lw=3, label="uninterrupted (1 worker)")
    es = sorted(curve)
    ax.plot(es, [curve[s][0] for s in es], "o-", ms=3, color="C0", label="elastic (4 nodes)")
    if "killed" in marks:
        ax.axvline(marks["killed"], color="C3", ls="--", label="node killed")
    if "rejoined" in marks:
        ax.axvline(marks["rejoined"], color="C2", ls="--", label="node rejoined")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over the global batch)")
    ax.set_title("elasticpp: same loss curve through a node failure and a join")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
