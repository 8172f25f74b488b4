"""Recovery downtime: elasticpp against torchrun, after a worker crash and after a node loss.

    python bench/recovery.py [--repeats 5] [--torchrun-node-repeats 2] [--quick]

All four scenarios run in the same invocation, on this machine, one after another, with the
same tiny model and global batch (B = 16, micro-batch 2) on 2 "nodes" × 2 worker slots:

- elasticpp, node loss: a `LocalCluster` (real etcd, two agent processes); kill -9 of the
  non-leader node (agent and workers), then the node is started again and rejoins before
  the next trial.
- elasticpp, worker crash: SIGKILL of one training worker (found through the agent's
  `GetStatus`); the agent, its warm workers and the other node live on.
- torchrun, worker crash: `torch.distributed.run --standalone --nproc-per-node=4
  --max-restarts=N` running `torchrun_baseline/train_ddp.py` (plain DDP on gloo, a
  safetensors checkpoint every `--ckpt-every` steps); SIGKILL of one worker.
- torchrun, node loss: two torchrun agents (`--nnodes=1:2 --nproc-per-node=2`, c10d
  rendezvous on a store in its own process, so the survivor can re-rendezvous), kill -9 of
  one agent's whole process tree. About a minute per trial, so fewer trials.

Downtime is what a user sees: the wall time from the last step reported before the kill to
the first step reported after it (for elasticpp, the first step of the new generation; for
torchrun, the first step of a new worker process), both from the systems' own per-step
records. It includes the remainder of the step that was in flight. Steps lost are steps
trained twice: last step before the kill + 1 − first step after. Before every elasticpp
trial both nodes train in the current generation and every agent's warm workers are ready
(blocked reading their assignment), as in a job that has been running a while. torchrun
trials are killed at a spread of positions in the checkpoint interval, so its steps lost
average about half the interval, as for a failure at a random time.

The phase breakdown gives medians of each phase's own duration: for elasticpp from the
leader's recovery timeline (detect = kill → the leader saw it; plan, stop, move, start as
recorded by the agents; first step = the rest), for torchrun from the new workers' own
records (restart = kill → the new process runs, i.e. detection, stopping the survivors,
rendezvous and spawn; import = torch and the model code; setup = process group, model,
checkpoint load; first step = the rest).

Prints a markdown table and writes every trial to `trials.json` in the work directory;
`--results FILE` writes them with the tree and the machine (bench/provenance.py), and
`--table-from FILE` prints the table of such a file again. `--elasticpp-defaults` runs
elasticpp with the job spec's defaults (snapshots on the 10 s time rule, the default lease,
settle window and hang rule) instead of the step rule: a crash then recomputes the steps
since the newest snapshot, which the "time lost" column counts.
The machine is shared: numbers are noisy, medians are the thing to read.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.provenance import machine, tree
from elasticpp.agent.localcluster import LocalCluster, kill_tree
from elasticpp.proctree import blocked_reading_stdin, sigterm_as_interrupt, worker_processes

BASELINE_DIR = Path(__file__).resolve().parent / "torchrun_baseline"
GLOBAL_BATCH = 16
MICRO_BATCH = 2
NODES = 2
SLOTS = 2
SETTLE_STEPS = 5  # steps trained in the current generation / run before a kill
POLL_S = 0.02
ELASTICPP_PHASES = ("detect", "plan", "stop", "move", "start", "first step")
TORCHRUN_PHASES = ("restart", "import", "pg", "setup", "first step")


class BenchError(RuntimeError):
    pass


@dataclass(frozen=True)
class Trial:
    scenario: str  # "worker crash" or "node loss"
    system: str  # "elasticpp" or "torchrun"
    downtime_s: float  # last step before the kill -> first step after
    steps_lost: int  # steps trained twice
    phases: dict[str, float]  # phase -> its own duration (s), in order
    kill_to_first_step_s: float
    regained_s: float  # last step before the kill -> the step after it done after recovery
    steady_step_s: float  # median step interval just before the kill
    last_step_before: int
    first_step_after: int
    note: str = ""


@dataclass
class JsonlTail:
    """New complete lines of growing JSON-lines files, read incrementally."""

    paths: list[Path]
    rows: list[dict[str, Any]] = field(default_factory=list)
    _offsets: dict[Path, int] = field(default_factory=dict)

    def poll(self) -> list[dict[str, Any]]:
        for path in self.paths:
            try:
                with path.open("rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # a line being written is read next time
            self._offsets[path] = self._offsets.get(path, 0) + end
            for line in data[:end].splitlines():
                with contextlib.suppress(ValueError):
                    self.rows.append(json.loads(line))
        return self.rows


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    cond: Callable[[], bool],
    timeout_s: float,
    what: str,
    check: Callable[[], None] | None = None,
) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)


def done_times(rows: list[dict[str, Any]]) -> dict[int, float]:
    """step -> when its last report came (every rank or node has it then)."""
    out: dict[int, float] = {}
    for r in rows:
        step = int(r["step"])
        out[step] = max(out.get(step, 0.0), float(r["time"]))
    return out


def steady_step_s(rows: list[dict[str, Any]], count: int = SETTLE_STEPS) -> float:
    """Median interval between the last `count` steps of one run (one generation)."""
    times = sorted(done_times(rows).items())[-(count + 1) :]
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(times) if b[0] == a[0] + 1]
    return statistics.median(gaps) if gaps else float("nan")


# --------------------------------------------------------------------------- elasticpp


# The elasticpp job's settings the step rule overrides; `--elasticpp-defaults` leaves the
# job spec's defaults instead (a snapshot on the time rule, every 10 s; the default lease,
# settle window and hang rule), which is what a user who sets nothing gets.
TUNED = ("lease_ttl_s", "join_settle_s", "hang_timeout_s", "snapshot_every")


def elasticpp_spec(name: str, defaults: bool = False) -> dict[str, Any]:
    spec = {
        "name": name,
        "model": "tiny",
        "global_batch": GLOBAL_BATCH,
        "micro_batch": MICRO_BATCH,
        "steps": 1_000_000,  # the benchmark ends the job
        "seed": 0,
        "min_nodes": 1,
        "max_nodes": NODES,
        "lease_ttl_s": 3,
        "join_settle_s": 0.5,
        "hang_timeout_s": 30,
        # Every step committed (the step rule): downtime is measured the same way as in the
        # earlier tables, and a failure recomputes at most the step in flight. Under the
        # default time rule (a snapshot every 10 s) it would recompute up to 10 s of steps.
        "snapshot_every": 1,
    }
    return {k: v for k, v in spec.items() if not (defaults and k in TUNED)}


def warm_pool_ready(lc: LocalCluster, node_id: str) -> bool:
    n = lc.node(node_id)
    if n.proc is None or n.proc.poll() is not None:
        return False
    idle = [p for p in worker_processes(n.proc.pid) if blocked_reading_stdin(p)]
    return len(idle) >= lc.slots


def running_worker_pids(lc: LocalCluster, node_id: str) -> list[int]:
    import grpc

    from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc

    with grpc.insecure_channel(lc.node(node_id).address) as ch:
        status = agent_pb2_grpc.AgentServiceStub(ch).GetStatus(
            agent_pb2.GetStatusRequest(), timeout=10
        )
    return [w.pid for w in status.workers if w.state == "running"]


def leader_of(lc: LocalCluster) -> str | None:
    from elasticpp.cluster.client import ClusterClient

    with ClusterClient([lc.etcd.endpoint], str(lc.spec["name"])) as c:
        return c.leader()


def _newest_generation(rows: list[dict[str, Any]]) -> int:
    return max((int(r["generation"]) for r in rows), default=0)


def elasticpp_steady(lc: LocalCluster, tail: JsonlTail) -> bool:
    """Every node trains in the newest generation, which has run a few steps, and every
    agent's warm workers are ready."""
    rows = tail.poll()
    gen = _newest_generation(rows)
    in_gen = [r for r in rows if int(r["generation"]) == gen]
    nodes = {r["node"] for r in in_gen}
    steps = {int(r["step"]) for r in in_gen}
    return (
        gen > 0
        and nodes == {n.node_id for n in lc.nodes}
        and len(steps) >= SETTLE_STEPS
        and all(warm_pool_ready(lc, n.node_id) for n in lc.nodes)
    )


def elasticpp_measure(
    lc: LocalCluster,
    tail: JsonlTail,
    scenario: str,
    kill: Callable[[], None],
    timeout_s: float,
) -> Trial:
    old_gen = _newest_generation(tail.poll())
    kill_time = time.time()
    kill()

    def resumed() -> bool:
        return any(int(r["generation"]) > old_gen for r in tail.poll())

    wait_until(resumed, timeout_s, f"a step of a generation after {old_gen}", lc.check_alive)
    rows = tail.poll()
    before = max((r for r in rows if r["time"] <= kill_time), key=lambda r: r["time"])
    after = min((r for r in rows if int(r["generation"]) > old_gen), key=lambda r: r["time"])
    trained_gen = int(after["generation"])
    old_rows = [r for r in rows if int(r["generation"]) == old_gen and r["time"] <= kill_time]

    def new_rows() -> list[dict[str, Any]]:
        return [r for r in tail.poll() if int(r["generation"]) > old_gen]

    target = int(before["step"]) + 1
    wait_until(lambda: target in done_times(new_rows()), timeout_s, f"step {target} again")
    regained = done_times(new_rows())[target]

    def timeline_written() -> bool:
        return any(int(t["generation"]) == trained_gen for t in lc.timelines())

    wait_until(timeline_written, 60, f"the timeline of generation {trained_gen}")
    timelines = {int(t["generation"]): t for t in lc.timelines()}
    t = timelines[trained_gen]
    detected = min(
        float(timelines[g]["detected_at"])
        for g in range(old_gen + 1, trained_gen + 1)
        if g in timelines
    )
    base = float(t["detected_at"])
    marks = [
        kill_time,
        detected,
        base + float(t["planned_s"]),
        base + float(t["stopped_s"]),
        base + float(t["moved_s"]),
        base + float(t["resumed_s"]),
        float(after["time"]),
    ]
    phases = {name: marks[i + 1] - marks[i] for i, name in enumerate(ELASTICPP_PHASES)}
    note = f"{t['layout_before']} -> {t['layout_after']}"
    if trained_gen - old_gen > 1:
        note += f"; {trained_gen - old_gen} generations"
    if int(t["steps_recomputed"]) != int(before["step"]) + 1 - int(after["step"]):
        note += f"; timeline says {t['steps_recomputed']} recomputed"
    return Trial(
        scenario=scenario,
        system="elasticpp",
        downtime_s=float(after["time"]) - float(before["time"]),
        steps_lost=int(before["step"]) + 1 - int(after["step"]),
        phases=phases,
        kill_to_first_step_s=float(after["time"]) - kill_time,
        regained_s=regained - float(before["time"]),
        steady_step_s=steady_step_s(old_rows),
        last_step_before=int(before["step"]),
        first_step_after=int(after["step"]),
        note=note,
    )


def run_elasticpp(
    scenario: str,
    repeats: int,
    workdir: Path,
    log: Callable[[str], None],
    defaults: bool = False,
) -> list[Trial]:
    name = "bench-node" if scenario == "node loss" else "bench-worker"
    spec = elasticpp_spec(name, defaults)
    lc = LocalCluster(workdir / name, spec, nodes=NODES, slots=SLOTS)
    trials: list[Trial] = []
    restarts: list[str] = []

    def revive() -> None:
        """An agent that died on its own is started again (a few times at most), as its
        service manager would; it is reported, and trials only run once the job is steady."""
        for n in lc.nodes:
            if n.proc is not None and n.proc.poll() not in (None, -signal.SIGKILL):
                last = n.log_path.read_text(errors="replace").strip().splitlines()[-1:]
                restarts.append(n.node_id)
                log(f"{n.node_id} agent exited {n.proc.returncode} ({''.join(last)}); restarting")
                if len(restarts) > 3:
                    raise BenchError(f"{n.node_id} agent keeps exiting; see {n.log_path}")
                lc.start_node(n.node_id)

    try:
        lc.start()
        tail = JsonlTail([n.state_dir / "metrics.jsonl" for n in lc.nodes])
        for i in range(repeats):
            wait_until(lambda: elasticpp_steady(lc, tail), 240, "a steady job", revive)
            leader = leader_of(lc)
            victim = next(n.node_id for n in lc.nodes if n.node_id != leader)
            kill: Callable[[], None]
            if scenario == "node loss":
                kill = functools.partial(lc.kill_node, victim)
            else:
                pid = running_worker_pids(lc, victim)[0]
                kill = functools.partial(os.kill, pid, signal.SIGKILL)
            trial = elasticpp_measure(lc, tail, scenario, kill, timeout_s=120)
            trials.append(trial)
            log(f"elasticpp {scenario} {i + 1}/{repeats}: {_trial_line(trial)}")
            if scenario == "node loss":
                lc.start_node(victim)
    finally:
        lc.close()
    return trials


# --------------------------------------------------------------------------- torchrun


def _torchrun_env(node: str) -> dict[str, str]:
    env = dict(os.environ)
    # Without it restarted workers reuse the store that still holds the dead workers'
    # addresses and never connect (pytorch#135712): a fair baseline sets it.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["BASELINE_NODE"] = node
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BASELINE_DIR.parent.parent), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    return env


def _train_args(trial_dir: Path, ckpt_every: int) -> list[str]:
    return [
        str(BASELINE_DIR / "train_ddp.py"),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--ckpt",
        str(trial_dir / "ckpt.safetensors"),
        "--ckpt-every",
        str(ckpt_every),
        "--metrics",
        str(trial_dir / "metrics.jsonl"),
    ]


@dataclass
class Procs:
    """Every process tree the torchrun part started; `close` kills them all."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    seen_pids: set[int] = field(default_factory=set)

    def start(self, cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
        with log_path.open("ab") as log:
            p = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_tree(p.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        # Workers whose torchrun died before them were reparented: kill them by pid.
        for pid in self.seen_pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if _is_ours(pid):
                    os.kill(pid, signal.SIGKILL)


def _is_ours(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"train_ddp.py" in cmdline


def _steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("event") == "step"]


def torchrun_ready_to_kill(tail: JsonlTail, world: int, ckpt_every: int, offset: int) -> bool:
    """The newest run has `world` ranks, a few steps, and the kill lands `offset` steps
    after a checkpoint."""
    steps = [r for r in _steps(tail.poll()) if r["world"] == world]
    if not steps:
        return False
    newest = max(r["restart"] for r in steps)
    run = {int(r["step"]) for r in steps if r["restart"] == newest}
    last = max(run)
    # The newest step's row from every rank: the step is done everywhere.
    ranks = {r["rank"] for r in steps if r["restart"] == newest and int(r["step"]) == last}
    return len(run) >= SETTLE_STEPS and len(ranks) == world and (last + 1) % ckpt_every == offset


def torchrun_measure(
    tail: JsonlTail, scenario: str, kill: Callable[[], None], procs: Procs, timeout_s: float
) -> Trial:
    rows = tail.poll()
    old_pids = {int(r["pid"]) for r in rows}
    procs.seen_pids |= old_pids
    kill_time = time.time()
    kill()

    def new_step() -> bool:
        return any(int(r["pid"]) not in old_pids for r in _steps(tail.poll()))

    wait_until(new_step, timeout_s, "a step of a restarted worker")
    rows = tail.poll()
    procs.seen_pids |= {int(r["pid"]) for r in rows}
    before = max((r for r in _steps(rows) if r["time"] <= kill_time), key=lambda r: r["time"])
    new = [r for r in rows if int(r["pid"]) not in old_pids]
    after = min(_steps(new), key=lambda r: r["time"])
    newest = max(r["restart"] for r in _steps(rows) if int(r["pid"]) in old_pids)
    old_run = [r for r in _steps(rows) if r["restart"] == newest and int(r["pid"]) in old_pids]

    def new_steps() -> list[dict[str, Any]]:
        return [r for r in _steps(tail.poll()) if int(r["pid"]) not in old_pids]

    target = int(before["step"]) + 1
    wait_until(lambda: target in done_times(new_steps()), timeout_s, f"step {target} again")
    regained = done_times(new_steps())[target]

    def milestone(event: str) -> float:
        # The slowest rank gates the first step.
        return max(float(r["time"]) for r in new if r["event"] == event)

    marks = [kill_time, milestone("start"), milestone("imported")]
    marks += [milestone("pg"), milestone("ready")]
    marks.append(float(after["time"]))
    phases = {name: marks[i + 1] - marks[i] for i, name in enumerate(TORCHRUN_PHASES)}
    return Trial(
        scenario=scenario,
        system="torchrun",
        downtime_s=float(after["time"]) - float(before["time"]),
        steps_lost=int(before["step"]) + 1 - int(after["step"]),
        phases=phases,
        kill_to_first_step_s=float(after["time"]) - kill_time,
        regained_s=regained - float(before["time"]),
        steady_step_s=steady_step_s(old_run),
        last_step_before=int(before["step"]),
        first_step_after=int(after["step"]),
        note=f"world {before['world']} -> {after['world']}",
    )


def kill_offsets(repeats: int, ckpt_every: int) -> list[int]:
    """Kill positions spread evenly over the checkpoint interval."""
    return [round((i + 0.5) * ckpt_every / repeats) % ckpt_every for i in range(repeats)]


def run_torchrun_worker_crash(
    repeats: int, ckpt_every: int, workdir: Path, log: Callable[[str], None]
) -> list[Trial]:
    trial_dir = workdir / "torchrun-worker"
    trial_dir.mkdir(parents=True)
    procs = Procs()
    trials: list[Trial] = []
    try:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={NODES * SLOTS}",
            f"--max-restarts={repeats + 2}",
            "--monitor-interval=0.1",
            *_train_args(trial_dir, ckpt_every),
        ]
        agent = procs.start(cmd, _torchrun_env("node-0"), trial_dir / "torchrun.log")
        tail = JsonlTail([trial_dir / "metrics.jsonl"])

        def check() -> None:
            if agent.poll() is not None:
                raise BenchError(f"torchrun exited {agent.returncode}; see {trial_dir}")

        for i, offset in enumerate(kill_offsets(repeats, ckpt_every)):
            wait_until(
                functools.partial(torchrun_ready_to_kill, tail, NODES * SLOTS, ckpt_every, offset),
                240,
                "torchrun training",
                check,
            )
            steps = _steps(tail.poll())
            newest = max(r["restart"] for r in steps)
            pid = next(int(r["pid"]) for r in steps if r["restart"] == newest and r["rank"] == 1)
            kill = functools.partial(os.kill, pid, signal.SIGKILL)
            trial = torchrun_measure(tail, "worker crash", kill, procs, timeout_s=180)
            trials.append(trial)
            log(f"torchrun worker crash {i + 1}/{repeats}: {_trial_line(trial)}")
    finally:
        procs.close()
    return trials


def run_torchrun_node_loss(
    repeats: int, ckpt_every: int, workdir: Path, log: Callable[[str], None]
) -> list[Trial]:
    trials: list[Trial] = []
    for i, offset in enumerate(kill_offsets(repeats, ckpt_every)):
        trial_dir = workdir / f"torchrun-node-{i}"
        trial_dir.mkdir(parents=True)
        trial = torchrun_node_loss_trial(trial_dir, f"bench-{i}", ckpt_every, offset)
        trials.append(trial)
        log(f"torchrun node loss {i + 1}/{repeats}: {_trial_line(trial)}")
    return trials


def torchrun_node_loss_trial(trial_dir: Path, run_id: str, ckpt_every: int, offset: int) -> Trial:
    procs = Procs()
    try:
        port = free_port()
        store = procs.start(
            [sys.executable, str(BASELINE_DIR / "store.py"), "--port", str(port)],
            _torchrun_env("store"),
            trial_dir / "store.log",
        )
        wait_until(lambda: b"ready" in (trial_dir / "store.log").read_bytes(), 120, "the store")
        agents = {}
        for node in ("node-0", "node-1"):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=1:2",
                f"--nproc-per-node={SLOTS}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id={run_id}",
                # The store runs apart; neither agent may host (and take down) the rendezvous.
                "--rdzv-conf=is_host=false",
                "--max-restarts=3",
                "--monitor-interval=0.1",
                *_train_args(trial_dir, ckpt_every),
            ]
            agents[node] = procs.start(cmd, _torchrun_env(node), trial_dir / f"{node}.log")
        tail = JsonlTail([trial_dir / "metrics.jsonl"])

        def check() -> None:
            for node, p in agents.items():
                if p.poll() is not None and not (node == "node-1" and p.returncode == -9):
                    raise BenchError(f"torchrun {node} exited {p.returncode}; see {trial_dir}")
            if store.poll() is not None:
                raise BenchError(f"the store exited; see {trial_dir}")

        wait_until(
            lambda: torchrun_ready_to_kill(tail, NODES * SLOTS, ckpt_every, offset),
            240,
            "torchrun training on both nodes",
            check,
        )
        victim = agents["node-1"]

        def kill() -> None:
            kill_tree(victim.pid)
            victim.wait(timeout=10)

        return torchrun_measure(tail, "node loss", kill, procs, timeout_s=240)
    finally:
        procs.close()


# --------------------------------------------------------------------------- report


def _trial_line(t: Trial) -> str:
    phases = ", ".join(f"{k} {v:.2f}" for k, v in t.phases.items())
    return (
        f"downtime {t.downtime_s:.2f} s (kill -> first step {t.kill_to_first_step_s:.2f} s), "
        f"steps {t.last_step_before} -> {t.first_step_after}, lost {t.steps_lost}, step "
        f"{t.last_step_before + 1} again after {t.regained_s:.2f} s, steady step "
        f"{t.steady_step_s:.2f} s; {phases}" + (f"; {t.note}" if t.note else "")
    )


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def time_lost_s(t: Trial) -> float:
    """What the fault cost the user: the downtime and the steps trained twice."""
    return t.downtime_s + t.steps_lost * t.steady_step_s


def table(trials: list[Trial]) -> str:
    lines = [
        "| scenario | system | trials | downtime median (s) [min–max] | phase breakdown, "
        "medians (s) | steps lost, median [max] | lost step redone after (s) | steady step (s) "
        "| time lost, median (s): downtime + steps lost × step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[Trial]] = {}
    for t in trials:
        groups.setdefault((t.scenario, t.system), []).append(t)
    for (scenario, system), ts in groups.items():
        down = [t.downtime_s for t in ts]
        names = list(ts[0].phases)
        phases = ", ".join(f"{n} {_median([t.phases[n] for t in ts]):.2f}" for n in names)
        lost = [t.steps_lost for t in ts]
        lines.append(
            f"| {scenario} | {system} | {len(ts)} | {_median(down):.2f} "
            f"[{min(down):.2f}–{max(down):.2f}] | {phases} | "
            f"{_median([float(x) for x in lost]):g} [{max(lost)}] | "
            f"{_median([t.regained_s for t in ts]):.2f} | "
            f"{_median([t.steady_step_s for t in ts]):.2f} | "
            f"{_median([time_lost_s(t) for t in ts]):.2f} |"
        )
    lines.append("")
    for scenario in ("worker crash", "node loss"):
        ours = groups.get((scenario, "elasticpp"), [])
        theirs = groups.get((scenario, "torchrun"), [])
        if ours and theirs:
            a = _median([t.downtime_s for t in ours])
            b = _median([t.downtime_s for t in theirs])
            c = _median([t.regained_s for t in ours])
            d = _median([t.regained_s for t in theirs])
            lines.append(
                f"- {scenario}: elasticpp / torchrun downtime = {a:.2f} / {b:.2f} = "
                f"{a / b:.3f}; until the interrupted step is done again: "
                f"{c:.2f} / {d:.2f} = {c / d:.3f}"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=5, help="trials per scenario")
    parser.add_argument(
        "--torchrun-node-repeats",
        type=int,
        default=2,
        help="trials of torchrun's node loss (about a minute each)",
    )
    parser.add_argument("--ckpt-every", type=int, default=10, help="torchrun checkpoint interval")
    parser.add_argument("--quick", action="store_true", help="2 trials each, 1 of torchrun node")
    parser.add_argument(
        "--only",
        choices=("elasticpp", "torchrun"),
        default=None,
        help="run one system only (the comparison needs both)",
    )
    parser.add_argument(
        "--elasticpp-defaults",
        action="store_true",
        help="elasticpp with the job spec's defaults (snapshots every 10 s), not a step rule",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and trials here")
    parser.add_argument(
        "--results", type=Path, default=None, help="write the raw trials, tree and machine here"
    )
    parser.add_argument(
        "--table-from", type=Path, default=None, help="print the table of a --results file"
    )
    args = parser.parse_args()
    if args.table_from is not None:
        raw = json.loads(args.table_from.read_text())
        print(table([Trial(**t) for t in raw["trials"]]))
        return 0
    if args.quick:
        args.repeats, args.torchrun_node_repeats = 2, 1
    if args.repeats < 1 or args.torchrun_node_repeats < 0 or args.ckpt_every < 1:
        parser.error("--repeats >= 1, --torchrun-node-repeats >= 0, --ckpt-every >= 1")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="elasticpp-bench-recovery-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {message}", file=sys.stderr, flush=True)

    log(
        f"{NODES} nodes x {SLOTS} slots, tiny model, B={GLOBAL_BATCH}, b={MICRO_BATCH}; "
        f"{args.repeats} trials per scenario, {args.torchrun_node_repeats} of torchrun node "
        f"loss; torchrun checkpoints every {args.ckpt_every} steps; work dir {workdir}"
    )
    trials: list[Trial] = []
    with sigterm_as_interrupt():
        if args.only in (None, "elasticpp"):
            for scenario in ("worker crash", "node loss"):
                ours = run_elasticpp(scenario, args.repeats, workdir, log, args.elasticpp_defaults)
                if args.elasticpp_defaults:
                    ours = [replace(t, system="elasticpp, defaults") for t in ours]
                trials += ours
        if args.only in (None, "torchrun"):
            trials += run_torchrun_worker_crash(args.repeats, args.ckpt_every, workdir, log)
            if args.torchrun_node_repeats:
                trials += run_torchrun_node_loss(
                    args.torchrun_node_repeats, args.ckpt_every, workdir, log
                )
    raw = {"format_version": 1, "trials": [asdict(t) for t in trials]}
    (workdir / "trials.json").write_text(json.dumps(raw, indent=1))
    if args.results is not None:
        raw |= {
            "command": "python bench/recovery.py " + " ".join(sys.argv[1:]),
            "tree": tree(),
            "machine": machine(),
            "seconds": round(time.monotonic() - t0, 1),
        }
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(raw, indent=1) + "\n")
    trials.sort(key=lambda t: (t.scenario != "worker crash", t.system != "elasticpp"))
    print(table(trials))
    log(f"done in {time.monotonic() - t0:.0f} s")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
