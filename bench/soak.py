"""Soak: a local elastic job under a long random sequence of mixed faults.

    python bench/soak.py --faults 100 [--seed 0] [--nodes 3] [--slots 1] [--kinds a,b,...]

N agents on a real etcd (a `LocalCluster`), one job, and a fault injector that draws a fault
kind at random (seeded; every kind comes up once before any comes up again) whenever the job
is steady: the generation in etcd has no failure reported, every node runs its ranks of it
(live, not stopped worker processes), training makes progress and every warm pool is full.
After each fault it checks that training resumes (two new steps within
`--resume-timeout-s`), gives back what the fault took (restarts a killed node, continues a
stopped process) and waits until the job is steady again. At the end the job runs to its
last step and the harness checks:

- every step's loss equals the uninterrupted single-worker run of the same job (`elasticpp
  train`, same seed, same global batch, same step count) to 1e-4 relative;
- no committed step was lost: no recovery resumed before the job's committed step (the safe
  step the leader publishes: held by every node and its replica holders) of the moment its
  fault struck;
- no process is left behind.

Per fault kind it prints (and writes to `soak.json`) the count, how many survived, the stall
p50/p95/max, the steps recomputed and the committed steps lost (and, for a killed node, the
stall of its rejoin once the harness restarts it: a join, timed apart from the fault whose
window ends at the restart). Stall = the longest gap between consecutive steps
between this fault and the next, minus the median gap of the whole run (DESIGN.md targets:
≤ 1 s after a worker crash or a non-leader node loss, ≤ 2 s after the leader's node dies).

Fault kinds (`KINDS`): worker_kill, node_kill, leader_kill, worker_hang, agent_stop,
etcd_restart, etcd_outage_worker_death, corrupt_piece, second_fault_in_recovery, and, as
root with nftables and cgroup v2 (`SANDBOX_KINDS`), full_disk (each node's state dir is a
small tmpfs; the fault fills one) and network_partition (each node's agent and workers run
in a cgroup of their own; the fault drops every packet they send, loopback included, until
it heals). Without those, they are left out, and the run says so.

Sick-node kinds (`SICK_KINDS`): a node is killed and restarted sick, and stays sick until
it has been set aside (quarantined, or lost) and the job has trained `SICK_STEPS` steps on
the others; then it is healed (killed and restarted healthy: a new incarnation, which the
leader re-admits at once) and every node must train again. sick_spares: its workers hang
before they report ready (a `sitecustomize` on their PYTHONPATH); wedged_agent: its agent's
loop blocks for good on its first step (its metrics.jsonl is a FIFO nobody reads);
small_disk, root only: its state dir is a 4 MiB tmpfs that cannot hold its share;
stuck_exit (root, or ptrace_scope 0): once it trains, a ptrace tracer holds its worker at its
exit (`tools/hold_exit.py`), and a worker elsewhere is killed, so the new generation's
SIGKILL of it does not complete (as uninterruptible sleep would have it). Such a
fault is survived when all of that happens, besides the run's curve and committed steps;
its stall runs from the fault to the heal (the longest pause: from the sickness to
training again on the others), and its rejoin stall from the heal on.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
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

from elasticpp.agent.localcluster import LocalCluster
from elasticpp.proctree import blocked_reading_stdin, descendants, worker_processes
from elasticpp.waiting import wait_until

GLOBAL_BATCH = 12
MICRO_BATCH = 2
STEPS_PER_FAULT = 60  # the job's length: enough steps for every fault and its recovery
# A sick node's fault lasts longer (two restarts, the sickness, the steps without it), and
# the job trains on meanwhile.
STEPS_PER_SICK_FAULT = 150
# stuck_exit waits for its restarted node to train before it makes it sick, while the job
# trains on the others (a few hundred steps of the tiny model).
STEPS_PER_STUCK_EXIT = 400
STOP_TIMEOUT_S = 10  # a node whose old workers outlive SIGKILL this long is set aside
LEASE_TTL_S = 3
HANG_TIMEOUT_S = 5
STATE_DIR_SIZE = "256m"  # each node's tmpfs state dir (root only)
FULL_DISK_S = 3.0  # how long a full disk stays full
PARTITION_S = LEASE_TTL_S + 3.0  # past the lease: the job re-plans without the node
READY_TIMEOUT_S = 30  # a spare not ready by then fails its generation, blaming its node
SICK_STEPS = 10  # steps the job trains on the others while a sick node stays sick
SICK_TIMEOUT_S = 240.0  # for a sick node to be set aside and those steps to be trained
SMALL_DISK = "4m"  # a sick node's state dir: room for its logs, not for its share


# A slot modelled without per-message latency, so that the planner picks pipeline layouts
# where the calibrated `cpu` preset would keep pure data parallelism (3 nodes train dp=3, the
# 2 survivors of a node loss a pp=2 pipeline): recoveries then move stage state between
# nodes instead of finding every layer on any survivor.
SLICED_DEVICE: dict[str, Any] = {
    "name": "cpu-no-latency",
    "memory_gib": 8,
    "peak_tflops": 0.03,
    "intra_node_gbps": 5,
    "inter_node_gbps": 1,
    "intra_node_latency_us": 0,
    "inter_node_latency_us": 0,
}


def job_spec(steps: int, seed: int, device: str = "sliced") -> dict[str, Any]:
    return {
        "device": SLICED_DEVICE if device == "sliced" else device,
        "name": "soak",
        "model": "tiny",
        "global_batch": GLOBAL_BATCH,
        "micro_batch": MICRO_BATCH,
        "steps": steps,
        "seed": seed,
        "min_nodes": 1,
        "max_nodes": 8,
        "lease_ttl_s": LEASE_TTL_S,
        "join_settle_s": 0.5,
        "hang_timeout_s": HANG_TIMEOUT_S,
        # Healthy spares import torch in a few seconds, far longer on a loaded machine; a
        # node whose spares never become ready is set aside after this.
        "ready_timeout_s": READY_TIMEOUT_S,
        "stop_timeout_s": STOP_TIMEOUT_S,
        # Faults here come back to back by design, a hundred in half an hour: the job's
        # failure budget (which would end it) is not what the soak measures.
        "max_failures": 100_000,
    }


def reference_curve(
    workdir: Path, steps: int, seed: int, stop_at: int | None = None
) -> dict[int, float]:
    """The uninterrupted curve of the `steps`-step job, its first `stop_at` steps if given."""
    out = workdir / "reference.jsonl"
    stop = ["--stop-at", str(stop_at)] if stop_at is not None else []
    subprocess.run(
        [
            sys.executable, "-m", "elasticpp.cli.main", "train", "--model", "tiny",
            "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(MICRO_BATCH),
            "--steps", str(steps), "--seed", str(seed), "--metrics", str(out), *stop,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return {int(r["step"]): float(r["loss"]) for r in map(json.loads, out.read_text().splitlines())}


# The curve a soak kept is checked against a replay of its own layouts without faults: each
# run of steps one generation kept, trained by `elasticpp train` in that generation's layout
# from the state the run before saved. The same layouts sum the same numbers in the same
# order, so the curves agree to float noise unless a recovery resumed from a wrong state
# (another step's, a mix of steps, a lost optimizer moment, a wrong data position). Not to
# the bit: two generations of one dp=3 layout from one state differ by ~10^-8 (their grad
# norms in the 9th digit; the cause is not known: the gradient buckets launch in a fixed
# order), and training compounds that, slowly and without a jump: 6.4e-8 over a 740-step
# soak, but past 1e-5 some 5,000 steps into a 10,380-step one (a median 4.5e-6, at most
# 8.5e-5 by its end; the first step past 1e-5 was 48 steps into a run, not at a resume).
# So a step's difference alone cannot tell a wrong resume from compounded noise; a wrong
# resume shows where the soak resumed: the difference jumps there, at once, by orders of
# magnitude (1e-3 and more), while noise carries on from where it was. The check: at every
# run's first REPLAY_WINDOW steps the difference is at most REPLAY_JUMP times what it was
# over the run before's last REPLAY_WINDOW steps, or REPLAY_FLOOR (the first run: from step
# 0, at most REPLAY_FLOOR). Against the uninterrupted run (one layout) they differ by the
# rounding of each layout change, compounding over the run (10^-3 after 10,000 steps and
# 230 changes): reported, and only a difference past DRIFT_LIMIT fails, as any step's
# difference from the replay past it does.
REPLAY_FLOOR = 1e-5  # relative: a difference this small is noise wherever it is
REPLAY_WINDOW = 8  # steps each side of a resume
REPLAY_JUMP = 10.0  # a resume's difference over the run before's
DRIFT_LIMIT = 1e-2  # relative, against the uninterrupted run (and the replay, at any step)


def replay_errors(
    curve: dict[int, float], replay: dict[int, float], runs: list[tuple[int, int, str]]
) -> tuple[list[str], list[tuple[int, float, float]]]:
    """What the replay check finds (see above): an error per resume whose difference from
    the replay jumped, and per step past DRIFT_LIMIT; and per run (its first step, the
    difference before it, after it), for the record."""
    apart = {s: _relative(curve[s], v) for s, v in replay.items() if s in curve}
    errors = [
        f"step {s}: {curve[s]} vs {replay[s]}, its layouts replayed, more than {DRIFT_LIMIT} apart"
        for s, d in sorted(apart.items())
        if d > DRIFT_LIMIT
    ]
    seams: list[tuple[int, float, float]] = []
    before = 0.0
    for first, end, _ in runs:
        after = max(
            (apart[s] for s in range(first, min(end, first + REPLAY_WINDOW)) if s in apart),
            default=0.0,
        )
        seams.append((first, before, after))
        if after > max(REPLAY_FLOOR, REPLAY_JUMP * before):
            errors.append(
                f"step {first}: resumed {after:.1e} from its layouts replayed, against "
                f"{before:.1e} before (more than {REPLAY_JUMP:g}x and {REPLAY_FLOOR:g})"
            )
        before = max(
            (apart[s] for s in range(max(first, end - REPLAY_WINDOW), end) if s in apart),
            default=0.0,
        )
    return errors, seams


def kept_runs(rows: list[dict[str, Any]]) -> list[tuple[int, int, str]]:
    """(first step, last step + 1, layout) of each run of consecutive steps that one
    generation kept (the newest generation that trained a step keeps it)."""
    kept: dict[int, tuple[int, str]] = {}
    for r in rows:
        step, gen = int(r["step"]), int(r["generation"])
        if step not in kept or gen > kept[step][0]:
            kept[step] = (gen, str(r["layout"]))
    runs: list[tuple[int, int, str]] = []
    prev: tuple[int, str] | None = None
    for step in sorted(kept):
        if runs and kept[step] == prev and runs[-1][1] == step:
            runs[-1] = (runs[-1][0], step + 1, runs[-1][2])
        else:
            runs.append((step, step + 1, kept[step][1]))
        prev = kept[step]
    return runs


def replay_curve(
    workdir: Path, steps: int, seed: int, runs: list[tuple[int, int, str]]
) -> dict[int, float]:
    """The curve of `runs` (`kept_runs`) trained one after another without faults, each
    from the state the one before saved; the steps must follow on from step 0."""
    out: dict[int, float] = {}
    state: Path | None = None
    for i, (first, end, layout) in enumerate(runs):
        if first != (runs[i - 1][1] if i else 0):
            raise ValueError(f"the kept steps are not contiguous at step {first}")
        saved = workdir / "replay" / f"run-{i:04d}"
        saved.mkdir(parents=True, exist_ok=True)
        metrics = workdir / "replay" / f"run-{i:04d}.jsonl"  # kept with the state gone
        resume = ["--resume", str(state)] if state is not None else []
        subprocess.run(
            [
                sys.executable, "-m", "elasticpp.cli.main", "train", "--model", "tiny",
                "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(MICRO_BATCH),
                "--steps", str(steps), "--seed", str(seed), "--layout", layout,
                "--metrics", str(metrics), "--save", str(saved), "--stop-at", str(end),
                *resume,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        for r in map(json.loads, metrics.read_text().splitlines()):
            out[int(r["step"])] = float(r["loss"])
        if state is not None:
            shutil.rmtree(state)
        state = saved
    return out


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# --------------------------------------------------------------------------- observing


def completion_times(rows: list[dict[str, Any]]) -> list[float]:
    """When each step of each generation was done on every node that trained it (its last
    row), every generation's, in time order. A recovery's recomputed steps are training too
    (counted apart, as steps recomputed): a stall is a pause in these. Only the newest
    generation's times, as before, put a recomputed step's time after the recovery and left
    the steps it replaced out: windows with no step (a stall of nan) and stalls that held
    the steps trained before the fault."""
    done: dict[tuple[int, int], float] = {}
    for r in rows:
        key = (int(r["step"]), int(r["generation"]))
        done[key] = max(done.get(key, 0.0), float(r["time"]))
    return sorted(done.values())


def status(lc: LocalCluster, node_id: str) -> Any:
    import grpc

    from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc

    with grpc.insecure_channel(lc.node(node_id).address) as ch:
        return agent_pb2_grpc.AgentServiceStub(ch).GetStatus(
            agent_pb2.GetStatusRequest(), timeout=5
        )


def describe(lc: LocalCluster, node_id: str) -> str:
    """One node as its agent reports it (for a harness error that must be diagnosable)."""
    try:
        st = status(lc, node_id)
    except Exception as exc:
        return f"{node_id}: no status ({type(exc).__name__})"
    workers = ", ".join(f"rank {w.rank} {w.state}" for w in st.workers) or "no workers"
    return f"{node_id}: generation {st.generation} {st.phase}, {workers}"


def training_pids(lc: LocalCluster, node_id: str) -> list[int]:
    with contextlib.suppress(Exception):
        return [w.pid for w in status(lc, node_id).workers if w.state == "running"]
    return []


def cluster_state(lc: LocalCluster) -> tuple[str | None, int]:
    from elasticpp.cluster.client import ClusterClient

    with ClusterClient([lc.etcd.endpoint], str(lc.spec["name"])) as c:
        record, _ = c.read_generation()
        return c.leader(), record.generation if record else 0


def committed_step(lc: LocalCluster) -> int | None:
    """The job's committed step: the safe step the leader published (held by every node
    and by the replica holders of each, so any single node loss leaves it resumable), or
    None before the first one."""
    from elasticpp.cluster.client import ClusterClient

    with (
        contextlib.suppress(Exception),
        ClusterClient([lc.etcd.endpoint], str(lc.spec["name"])) as c,
    ):
        safe, _ = c.commits.read_safe()
        return None if safe is None else safe.step
    return None


def running(pid: int) -> bool:
    """Whether `pid` exists and can run: not gone, not a zombie waiting to be reaped, not
    stopped. The process itself, not what an agent last reported of it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X", "x", "T", "t")


@dataclass(frozen=True)
class NodeView:
    """One node as the harness sees it when it asks whether the job is steady."""

    node_id: str
    generation: int  # the agent's, as it reports it (-1: it did not answer)
    phase: str
    ranks_planned: frozenset[int]  # this node's ranks in etcd's generation
    ranks_running: frozenset[int]  # reported running, and the process alive, not stopped
    warm_ready: int  # warm workers waiting for an assignment
    agent_alive: bool


@dataclass(frozen=True)
class JobView:
    generation: int  # etcd's generation record (0: none, or etcd unreadable)
    failures: frozenset[str]  # nodes that reported a failure in it
    nodes: tuple[NodeView, ...]
    newest_step: int  # the newest step trained in etcd's generation (-1: none)
    quarantined: frozenset[str] = frozenset()  # nodes with a quarantine record in etcd


def is_steady(view: JobView, since_step: int, slots: int) -> bool:
    """The job runs undisturbed: the generation in etcd has no failure reported, every node
    runs its ranks of it (as its agent reports, and the processes are alive and not
    stopped), it trained two steps past `since_step`, and every node's warm pool is full.
    A quarantined node is the exception: it has no ranks (the leader replaced any
    generation it was in) and that is steady while it is sick, whatever its agent, its
    spares and its failure reports (old workers that will not die) say.

    The processes are checked, not only the agents' word, and the generation is etcd's, not
    the newest in the metrics: an agent's status and its metrics lag what happened (a worker
    just killed is still listed; steps of a generation whose workers are dead are still
    being written after an agent's loop waited on etcd), and a fault injected then finds the
    job between generations, with no worker to act on."""
    if view.generation <= 0 or view.failures - view.quarantined:
        return False
    for n in view.nodes:
        if n.node_id in view.quarantined:
            if n.ranks_planned:
                return False  # the leader has yet to replace the generation it is in
            continue
        if not (n.agent_alive and n.generation == view.generation and n.phase == "running"):
            return False
        if not n.ranks_planned or n.ranks_running != n.ranks_planned or n.warm_ready < slots:
            return False
    return view.newest_step >= since_step + 2


def is_set_aside(view: JobView, node_id: str, since_step: int, slots: int, steps: int = 2) -> bool:
    """A sick node is set aside and the job trains on the others: it has no ranks in etcd's
    generation (quarantined, or lost: a wedged agent whose lease ran out), the other nodes
    are steady in it, and it trained `steps` steps past `since_step`. What the sick node's
    agent reports, or whether it answers at all, does not matter."""
    if any(n.node_id == node_id and n.ranks_planned for n in view.nodes):
        return False
    others = tuple(n for n in view.nodes if n.node_id != node_id)
    if not others or not is_steady(replace(view, nodes=others), since_step, slots):
        return False
    return view.newest_step >= since_step + steps


def observe(lc: LocalCluster) -> JobView:
    from elasticpp.agent.jobspec import load_job_spec
    from elasticpp.cluster.client import ClusterClient

    none = JobView(0, frozenset(), (), -1)
    try:
        with ClusterClient([lc.etcd.endpoint], str(lc.spec["name"])) as c:
            record, _ = c.read_generation()
            if record is None:
                return none
            failed, _ = c.arrivals.barrier_state(f"failed-{record.generation}")
            quarantined = frozenset(c.health.quarantined())
    except Exception:  # etcd down or restarting
        return none
    plan = load_job_spec(lc.spec_path).plan_of(record.plan)  # the record names no model
    nodes = []
    for n in lc.nodes:
        proc = n.proc
        alive = proc is not None and proc.poll() is None and running(proc.pid)
        try:
            st = status(lc, n.node_id)
            gen, phase = int(st.generation), str(st.phase)
            ranks = frozenset(w.rank for w in st.workers if w.state == "running" and running(w.pid))
        except Exception:  # the agent does not answer (stopped, restarting)
            gen, phase, ranks = -1, "", frozenset()
        warm = 0
        if proc is not None and alive:
            warm = sum(blocked_reading_stdin(p) for p in worker_processes(proc.pid))
        planned = frozenset(s.rank for s in plan.ranks_on(n.node_id))
        nodes.append(NodeView(n.node_id, gen, phase, planned, ranks, warm, alive))
    steps = [int(r["step"]) for r in lc.metrics() if int(r["generation"]) == record.generation]
    return JobView(
        record.generation, frozenset(failed), tuple(nodes), max(steps, default=-1), quarantined
    )


def steady(lc: LocalCluster, since_step: int, healed: str | None = None) -> bool:
    """`is_steady`; with `healed`, that node (sick before, healed now) must not be
    quarantined: it trains again."""
    view = observe(lc)
    return is_steady(view, since_step, lc.slots) and healed not in view.quarantined


# --------------------------------------------------------------------------- sandbox


def _cgroup2_mount() -> Path | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and parts[2] == "cgroup2":
                return Path(parts[1])
    return None


def _run(*cmd: str, stdin: str | None = None) -> None:
    proc = subprocess.run(list(cmd), input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")


class Sandbox:
    """Root-only fault machinery, all undone by `close()`: a tmpfs per node state dir (a
    disk that can fill), a cgroup v2 per node and an nftables table whose output chain can
    drop every packet a node's processes send (a partition; rules match the socket's
    cgroup, so only that node is cut off, loopback addresses included)."""

    def __init__(self, node_dirs: list[Path]) -> None:
        self.table = f"elasticpp_soak_{os.getpid()}"
        self.mounts: list[Path] = []
        self.cgroup: Path | None = None
        self._nft = False
        mount = _cgroup2_mount()
        if mount is None:
            raise RuntimeError("no cgroup v2 mount")
        try:
            for d in node_dirs:
                d.mkdir(parents=True, exist_ok=True)
                _run("mount", "-t", "tmpfs", "-o", f"size={STATE_DIR_SIZE}", "tmpfs", str(d))
                self.mounts.append(d)
            self.cgroup = mount / f"elasticpp-soak-{os.getpid()}"
            self.cgroup.mkdir()
            # nft resolves cgroup paths below /sys/fs/cgroup (a hybrid host mounts v2 deeper)
            self._rel = os.path.relpath(self.cgroup, "/sys/fs/cgroup")
            _run("nft", "add", "table", "inet", self.table)
            self._nft = True
            _run(
                "nft", "add", "chain", "inet", self.table, "out",
                "{ type filter hook output priority 0; policy accept; }",
            )  # fmt: skip
        except BaseException:
            self.close()
            raise

    @staticmethod
    def available() -> str | None:
        """Why the root-only kinds cannot run here, or None if they can."""
        if os.geteuid() != 0:
            return "not root"
        if _cgroup2_mount() is None:
            return "no cgroup v2 mount"
        for tool in ("nft", "mount", "umount"):
            if shutil.which(tool) is None:
                return f"no {tool} on PATH"
        return None

    def partition(self, node_id: str) -> None:
        # The node's cgroup is two levels below the cgroup v2 root: <soak>/<node id>.
        _run(
            "nft", "add", "rule", "inet", self.table, "out", "socket", "cgroupv2", "level",
            "2", f'"{self._rel}/{node_id}"', "drop",
        )  # fmt: skip

    def heal(self) -> None:
        _run("nft", "flush", "chain", "inet", self.table, "out")

    def fill(self, state_dir: Path) -> Path:
        """Fill the node's tmpfs: every later write there fails with ENOSPC."""
        filler = state_dir / "filler"
        st = os.statvfs(state_dir)
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with contextlib.suppress(OSError):
                os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize)
            with contextlib.suppress(OSError):  # what fallocate's rounding left
                while True:
                    os.write(fd, b"\0" * 4096)
        finally:
            os.close(fd)
        return filler

    def close(self) -> None:
        if self._nft:
            with contextlib.suppress(RuntimeError):
                _run("nft", "delete", "table", "inet", self.table)
            self._nft = False
        if self.cgroup is not None and self.cgroup.is_dir():
            for d in sorted(self.cgroup.iterdir()):
                if d.is_dir():
                    with contextlib.suppress(OSError):
                        d.rmdir()
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()
        for d in reversed(self.mounts):
            with contextlib.suppress(RuntimeError):
                _run("umount", "-l", str(d))
        self.mounts.clear()


def small_disk_unavailable() -> str | None:
    """Why a small disk cannot be mounted here, or None if it can."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("mount", "umount"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH"
    return None


def unavailable(kind: str) -> str | None:
    """Why fault kind `kind` cannot run here, or None if it can."""
    if kind in SANDBOX_KINDS:
        return Sandbox.available()
    if kind == "small_disk":
        return small_disk_unavailable()
    if kind == "stuck_exit":
        return stuck_exit_unavailable()
    return None


def mount_small_disk(where: Path) -> Path:
    """A tmpfs of `SMALL_DISK` at `where`, filled but for 512 KiB (room for a node's logs,
    not for its share of the model's state); the state dir inside it is returned."""
    where.mkdir(parents=True, exist_ok=True)
    _run("mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK}", "tmpfs", str(where))
    st = os.statvfs(where)
    with (where / "filler").open("wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - (512 << 10)))
    return where / "state"


# --------------------------------------------------------------------------- faults


@dataclass
class Ctx:
    lc: LocalCluster
    rng: random.Random
    undo: list[Callable[[], None]] = field(default_factory=list)
    sandbox: Sandbox | None = None
    rejoin: bool = False  # the undo restarts a node: its join is timed apart from the fault
    failure: str | None = None  # why the fault was not survived, found while injecting it
    healed: str | None = None  # a sick node the undo heals: it must train again after it
    mounts: list[Path] = field(default_factory=list)  # the run's small disks still mounted
    holders: list[subprocess.Popen[str]] = field(default_factory=list)  # tools/hold_exit.py
    last_step: int | None = None  # the job's: once trained, no fault is waited on any more
    # A step whose copy on one node the fault corrupted: the job is steady again only once
    # every running node committed a newer one. Before, the next fault could kill the node
    # with the only other copy: both copies of the job's state gone (a double fault the
    # replication is not built for), and the job rightly refused to start over.
    spoiled_step: int | None = None

    def non_leader(self) -> str:
        leader, _ = cluster_state(self.lc)
        others = [n.node_id for n in self.lc.nodes if n.node_id != leader]
        return self.rng.choice(others)

    def any_node(self) -> str:
        return self.rng.choice([n.node_id for n in self.lc.nodes])

    def signal_a_worker(
        self, sig: int, node_id: str | None = None, *, not_on: str | None = None
    ) -> tuple[str, int]:
        """Send `sig` to a training worker (of `node_id`, or of any node but `not_on`). The
        agent's status may be a moment old: a worker that is gone already is skipped."""
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            if node_id:
                nodes = [node_id]
            else:
                nodes = [n.node_id for n in self.lc.nodes if n.node_id != not_on]
            for node in self.rng.sample(nodes, len(nodes)):
                pids = training_pids(self.lc, node)
                if pids:
                    pid = self.rng.choice(pids)
                    try:
                        os.kill(pid, sig)
                        return node, pid
                    except ProcessLookupError:
                        pass
            time.sleep(0.05)
        raise RuntimeError(
            f"{node_id or 'any node'}: no training worker to signal in 30 s; newest step "
            f"{self.lc.max_step()}; "
            + "; ".join(describe(self.lc, n.node_id) for n in self.lc.nodes)
        )

    def kill_a_worker(self, node_id: str | None = None, *, not_on: str | None = None) -> str:
        return self.signal_a_worker(signal.SIGKILL, node_id, not_on=not_on)[0]


def f_worker_kill(ctx: Ctx) -> str:
    return f"kill -9 of a worker on {ctx.kill_a_worker()}"


def _kill_node(ctx: Ctx, node: str) -> None:
    ctx.lc.kill_node(node)

    def restart() -> None:
        ctx.lc.start_node(node)

    ctx.undo.append(restart)
    ctx.rejoin = True


def f_node_kill(ctx: Ctx) -> str:
    node = ctx.non_leader()
    _kill_node(ctx, node)
    return f"kill -9 of {node} (agent and workers)"


def f_leader_kill(ctx: Ctx) -> str:
    leader, _ = cluster_state(ctx.lc)
    if leader is None:
        raise RuntimeError("no leader")
    _kill_node(ctx, leader)
    return f"kill -9 of the leader's node {leader}"


def f_worker_hang(ctx: Ctx) -> str:
    node, pid = ctx.signal_a_worker(signal.SIGSTOP)
    ctx.undo.append(lambda: _signal(pid, signal.SIGCONT))
    return f"SIGSTOP of a worker on {node} (hang)"


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def f_agent_stop(ctx: Ctx) -> str:
    node = ctx.non_leader()
    proc = ctx.lc.node(node).proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)
    # Past its lease: the job re-plans without it; when it runs again it must come back
    # fenced (nothing committed meanwhile) and rejoin.
    time.sleep(LEASE_TTL_S + 2.0)
    os.kill(proc.pid, signal.SIGCONT)
    return f"SIGSTOP of {node}'s agent for {LEASE_TTL_S + 2.0:.0f} s"


def f_etcd_restart(ctx: Ctx) -> str:
    ctx.lc.etcd.kill()
    ctx.lc.etcd.start()
    ctx.kill_a_worker()  # a membership change right after, so etcd is needed at once
    return "kill -9 and restart of etcd, then a worker kill"


def f_etcd_outage_worker_death(ctx: Ctx) -> str:
    ctx.lc.etcd.stop()
    node = ctx.kill_a_worker()
    time.sleep(HANG_TIMEOUT_S + 1.0)  # the outage outlasts the hang timeout
    ctx.lc.etcd.start()
    return f"etcd down {HANG_TIMEOUT_S + 1.0:.0f} s with a worker on {node} killed inside"


def newest_committed(own: Path, timeout_s: float) -> Path | None:
    """The newest step directory under a node's `store/own` that has its manifest, waiting
    up to `timeout_s` for one: a job just started (the soak's first fault) may have
    trained steps but committed none yet."""
    found: list[Path] = []

    def committed() -> bool:
        # store/own/epoch-<E>/gen-<G>/step-<S>, each name zero-padded: sorted as text
        found[:] = sorted(
            (p for p in own.glob("epoch-*/gen-*/step-*") if (p / "manifest.json").is_file()),
            key=lambda p: p.relative_to(own).parts,
        )
        return bool(found)

    return found[-1] if wait_until(committed, timeout_s, interval_s=0.1) else None


def f_corrupt_piece(ctx: Ctx) -> str:
    node = ctx.any_node()
    step = newest_committed(ctx.lc.node(node).state_dir / "store" / "own", 60.0)
    if step is None:
        raise RuntimeError(f"{node}: no committed step to corrupt within 60 s")
    pieces = sorted(step.glob("*.safetensors"))
    victim = ctx.rng.choice(pieces)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))  # in place: hard links (resume dirs) see it too
    ctx.spoiled_step = int(step.name.split("-")[1])
    ctx.kill_a_worker(node)
    return f"corrupted {victim.name} of {step.name} on {node}, then a worker kill there"


def committed_past(lc: LocalCluster, step: int | None) -> bool:
    """Every node whose agent runs committed a step newer than `step` (None: no condition)."""
    if step is None:
        return True
    for n in lc.nodes:
        if n.proc is None or n.proc.poll() is not None:
            continue
        newest = newest_committed(n.state_dir / "store" / "own", 0.0)
        if newest is None or int(newest.name.split("-")[1]) <= step:
            return False
    return True


def f_second_fault_in_recovery(ctx: Ctx) -> str:
    _, gen = cluster_state(ctx.lc)
    ctx.kill_a_worker()
    wait_until(lambda: cluster_state(ctx.lc)[1] > gen, 30, interval_s=0.02)
    delay = ctx.rng.uniform(0.0, 1.5)  # lands in stopping, moving or starting
    time.sleep(delay)
    for n in ctx.rng.sample([n.node_id for n in ctx.lc.nodes], len(ctx.lc.nodes)):
        pids = [p for p in ctx.lc.worker_pids(n) if not blocked_reading_stdin(p)]
        with contextlib.suppress(ProcessLookupError):
            if pids:
                os.kill(ctx.rng.choice(pids), signal.SIGKILL)
                return f"worker kill, then another on {n} {delay:.2f} s into the recovery"
    return f"worker kill; no second worker found {delay:.2f} s into the recovery"


def f_full_disk(ctx: Ctx) -> str:
    assert ctx.sandbox is not None
    node = ctx.any_node()
    filler = ctx.sandbox.fill(ctx.lc.node(node).state_dir)
    # Training goes on (snapshots fail and are reported, nothing is committed there); the
    # disk is given back after a while and commits resume.
    time.sleep(FULL_DISK_S)
    filler.unlink()
    return f"{node}'s state dir full for {FULL_DISK_S:.0f} s"


def f_network_partition(ctx: Ctx) -> str:
    assert ctx.sandbox is not None
    node = ctx.any_node()
    ctx.sandbox.partition(node)
    # Past its lease: the job re-plans without it; healed, it must come back fenced.
    time.sleep(PARTITION_S)
    ctx.sandbox.heal()
    return f"{node} cut off (every packet it sends dropped) for {PARTITION_S:.0f} s"


def _sicken(ctx: Ctx, sicken: Callable[[str], Callable[[], None]], what: str) -> str:
    """Restart a node sick and keep it sick until it is set aside (quarantined, or lost)
    and the job has trained `SICK_STEPS` steps on the others; then the undo heals it
    (restarts it healthy, a new incarnation that the leader re-admits at once) and the
    soak waits until every node trains again. `sicken(node)` starts it sick and returns
    what to clear once it is killed, before its healthy restart."""
    lc = ctx.lc
    node = ctx.non_leader()
    lc.kill_node(node)
    cure = sicken(node)
    _, gen0 = cluster_state(lc)

    def heal() -> None:
        lc.kill_node(node)
        cure()
        lc.start_node(node)

    ctx.undo.append(heal)
    ctx.rejoin = True
    ctx.healed = node
    # Set aside after its restart: quarantined, or planned (a join) and then re-planned
    # without (a wedged agent's lease runs out). Before that it is merely lost to the kill.
    seen: dict[str, Any] = {"caught": False, "aside_step": None, "how": ""}

    def trained_without() -> bool:
        if ctx.last_step is not None and lc.max_step() >= ctx.last_step:
            seen["ended"] = True  # the job trained to its end: nothing more to wait for
            return True
        view = observe(lc)
        planned = any(n.node_id == node and n.ranks_planned for n in view.nodes)
        if node in view.quarantined or (view.generation > gen0 and planned):
            seen["caught"] = True
        if not seen["caught"]:
            return False
        if seen["aside_step"] is None:
            if is_set_aside(view, node, -2, lc.slots):
                seen["aside_step"] = view.newest_step
            return False
        seen["how"] = "quarantined" if node in view.quarantined else "lost"
        return is_set_aside(view, node, seen["aside_step"], lc.slots, steps=SICK_STEPS)

    if wait_until(trained_without, SICK_TIMEOUT_S, interval_s=0.2):
        if not seen.get("ended"):
            return f"{node} restarted {what}: {seen['how']}, {SICK_STEPS} steps on the others"
        if seen["aside_step"] is not None:
            return f"{node} restarted {what}: set aside; the job trained to its end without it"
        ctx.failure = f"{node} restarted {what}: the job ended before it was set aside"
        return f"{node} restarted {what}"
    ctx.failure = (
        f"{node} restarted {what}: not set aside with {SICK_STEPS} steps on the others "
        f"within {SICK_TIMEOUT_S:.0f} s ("
        + ("set aside, too few steps; " if seen["aside_step"] is not None else "")
        + ("caught" if seen["caught"] else "never planned nor quarantined")
        + "); "
        + "; ".join(describe(lc, n.node_id) for n in lc.nodes)
    )
    return f"{node} restarted {what}"


def f_sick_spares(ctx: Ctx) -> str:
    hook = ctx.lc.workdir / "sick-spares"
    hook.mkdir(exist_ok=True)

    def sicken(node: str) -> Callable[[], None]:
        # Its workers hang before they report ready (a stuck driver initialisation, say):
        # Python imports sitecustomize at start-up, before the worker's own code runs. The
        # agent, without the node id in its environment, starts normally.
        (hook / "sitecustomize.py").write_text(
            "import os, time\n"
            f"if os.environ.get('ELASTICPP_NODE_ID') == {node!r}:\n"
            "    time.sleep(3600)\n"
        )
        ctx.lc.start_node(node, env={"PYTHONPATH": os.pathsep.join([str(hook), *sys.path])})
        return lambda: None

    return _sicken(ctx, sicken, "with spares that never become ready")


def f_wedged_agent(ctx: Ctx) -> str:
    def sicken(node: str) -> Callable[[], None]:
        # Its agent blocks for good the first time it records a step: its metrics file is a
        # FIFO nobody reads (a hung file system does the same). Its gRPC threads answer on,
        # and its workers train: only the lease, renewed by the loop's progress, tells.
        metrics = ctx.lc.node(node).state_dir / "metrics.jsonl"
        kept = metrics.with_name("metrics.jsonl.kept")
        if metrics.is_file():
            metrics.replace(kept)
        os.mkfifo(metrics)
        ctx.lc.start_node(node)

        def cure() -> None:
            metrics.unlink()
            if kept.is_file():
                kept.replace(metrics)

        return cure

    return _sicken(ctx, sicken, "with a loop that wedges")


def f_small_disk(ctx: Ctx) -> str:
    def sicken(node: str) -> Callable[[], None]:
        n = ctx.lc.node(node)
        healthy, small = n.state_dir, ctx.lc.workdir / f"small-disk-{node}"
        state = mount_small_disk(small)
        ctx.mounts.append(small)
        ctx.lc.start_node(node, state_dir=state)

        def cure() -> None:
            n.state_dir = healthy
            _run("umount", "-l", str(small))
            ctx.mounts.remove(small)

        return cure

    return _sicken(ctx, sicken, f"on a {SMALL_DISK} state dir")


HOLD_EXIT = Path(__file__).resolve().parents[1] / "tools" / "hold_exit.py"


def stuck_exit_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "holding a worker at its exit needs Linux ptrace"
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if os.geteuid() != 0 and scope.is_file() and scope.read_text().strip() != "0":
        return "attaching to an agent's worker needs root or ptrace_scope 0"
    return None


def f_stuck_exit(ctx: Ctx) -> str:
    def sicken(node: str) -> Callable[[], None]:
        # Its training worker will not go once it starts to exit, as one that a driver or
        # file system hang keeps in uninterruptible sleep outlives SIGKILL: a ptrace tracer
        # holds it at its exit (tools/hold_exit.py). Then a worker elsewhere dies, every
        # node stops its workers at once, and this one cannot.
        ctx.lc.start_node(node)
        pids: list[int] = []

        def training() -> bool:
            pids[:] = training_pids(ctx.lc, node)
            return bool(pids)

        if not wait_until(training, 180):
            raise RuntimeError(f"{node}: no training worker within 180 s of its restart")
        holder = subprocess.Popen(
            [sys.executable, str(HOLD_EXIT), str(pids[0]), "3600"],
            stdout=subprocess.PIPE,
            text=True,
        )
        ctx.holders.append(holder)
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "attached":
            raise RuntimeError(f"{node}: could not hold worker {pids[0]} at its exit")
        # A worker of a node that trains: the first other node may be a spare of this plan.
        ctx.kill_a_worker(not_on=node)

        def cure() -> None:
            holder.kill()  # the held worker exits
            holder.wait()
            ctx.holders.remove(holder)

        return cure

    return _sicken(ctx, sicken, "with a worker that outlives SIGKILL")


KINDS: dict[str, Callable[[Ctx], str]] = {
    "worker_kill": f_worker_kill,
    "node_kill": f_node_kill,
    "leader_kill": f_leader_kill,
    "worker_hang": f_worker_hang,
    "agent_stop": f_agent_stop,
    "etcd_restart": f_etcd_restart,
    "etcd_outage_worker_death": f_etcd_outage_worker_death,
    "corrupt_piece": f_corrupt_piece,
    "second_fault_in_recovery": f_second_fault_in_recovery,
    "full_disk": f_full_disk,
    "network_partition": f_network_partition,
    "sick_spares": f_sick_spares,
    "wedged_agent": f_wedged_agent,
    "small_disk": f_small_disk,
    "stuck_exit": f_stuck_exit,
}
SANDBOX_KINDS = ("full_disk", "network_partition")  # need root, nftables and cgroup v2
# A node restarted sick, kept sick until it is set aside, then healed (`_sicken`).
SICK_KINDS = ("sick_spares", "wedged_agent", "small_disk", "stuck_exit")


# --------------------------------------------------------------------------- the soak


def room_for(kind: str) -> int:
    """Steps of the job a fault of `kind` may take, recovery included."""
    if kind == "stuck_exit":
        return STEPS_PER_STUCK_EXIT
    return STEPS_PER_SICK_FAULT if kind in SICK_KINDS else STEPS_PER_FAULT


@dataclass
class FaultRecord:
    index: int
    kind: str
    what: str
    at: float
    step_before: int
    survived: bool
    resumed_s: float | None
    committed: int | None = None  # the job's committed (safe) step when the fault struck
    undo_at: float | None = None  # when the harness restarted the node the fault killed
    stall_s: float = float("nan")  # of the fault, up to the harness's undo
    rejoin_stall_s: float = float("nan")  # after the undo (the node's rejoin), if any
    recomputed: int = 0
    most_recomputed: int = 0  # in one recovery (invariant 4: the step in flight)
    lost: int = 0  # committed steps a recovery after it went back past
    timelines: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class SoakResult:
    faults: list[FaultRecord]
    curve_ok: bool
    curve_errors: list[str]
    steps: int
    lost_steps: int
    leftover_processes: list[int]
    median_step_s: float
    wall_s: float
    # The largest relative difference of the kept curve from its layouts replayed, and from
    # the uninterrupted run; the runs of steps one generation kept (`kept_runs`).
    replay_max: float = 0.0
    drift_max: float = 0.0
    layout_runs: int = 0
    # Per replayed run: its first step, the difference over the run before's last steps and
    # over its own first ones (`replay_errors`); the largest ratio of the two at a resume.
    seams: list[tuple[int, float, float]] = field(default_factory=list)
    jump_max: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.curve_ok
            and not self.leftover_processes
            and self.lost_steps == 0
            and all(f.survived for f in self.faults)
        )


def kind_order(kinds: list[str], count: int, rng: random.Random) -> list[str]:
    """`count` kinds, every kind once per round, each round in a seeded random order."""
    out: list[str] = []
    while len(out) < count:
        round_ = list(kinds)
        rng.shuffle(round_)
        out += round_
    return out[:count]


def run_soak(
    workdir: Path,
    *,
    faults: int,
    seed: int = 0,
    nodes: int = 3,
    slots: int = 1,
    kinds: list[str] | None = None,
    device: str = "sliced",
    resume_timeout_s: float = 120.0,
    finish: bool = True,
    log: Callable[[str], None] = print,
) -> SoakResult:
    """Inject `faults` faults into a `nodes`-node job, one at a time whenever it is steady.

    `finish`: the job trains to its last step (the room left for faults that did not take
    it) and its whole curve is compared; without it the run stops once the job is steady
    after the last fault, and the curve is compared over the steps trained by then (the job
    is then stopped with the cluster, as at any failure)."""
    kinds = kinds or list(KINDS)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown fault kind(s) {unknown}; known: {sorted(KINDS)}")
    rng = random.Random(seed)
    order = kind_order(kinds, faults, rng)
    # Without `finish` the room left over is never trained: room to spare costs nothing.
    steps = 20 + sum(room_for(k) for k in order) * (1 if finish else 3)
    started = time.monotonic()
    reference = reference_curve(workdir, steps, seed) if finish else {}
    sandbox = None
    for kind in kinds:
        why = unavailable(kind)
        if why is not None:
            raise RuntimeError(f"fault kind {kind}: {why}")
    if set(kinds) & set(SANDBOX_KINDS):
        node_dirs = [workdir / "job" / f"node-{i}" for i in range(nodes)]
        sandbox = Sandbox(node_dirs)
    lc = LocalCluster(
        workdir / "job",
        job_spec(steps, seed, device),
        nodes=nodes,
        slots=slots,
        cgroup_root=sandbox.cgroup if sandbox else None,
    )
    records: list[FaultRecord] = []
    mounts: list[Path] = []  # small disks (a sick node's), unmounted as each is healed
    holders: list[subprocess.Popen[str]] = []  # processes holding a worker at its exit
    timelines: dict[int, dict[str, Any]] = {}  # read as the run goes: the leader keeps 100
    try:
        lc.start()
        lc.wait_for(lambda: steady(lc, 0), 180, "the job to start")
        for i, kind in enumerate(order):
            step0 = lc.max_step()
            room = room_for(kind)
            if step0 >= steps - room // 2:
                log(f"job near its end at step {step0}: {faults - i} fault(s) not injected")
                break
            ctx = Ctx(lc, rng, sandbox=sandbox, mounts=mounts, holders=holders, last_step=steps - 1)
            committed = committed_step(lc)
            at = time.time()
            what = KINDS[kind](ctx)
            survived = ctx.failure is None and wait_until(
                lambda s=step0: lc.max_step() >= s + 2 or lc.max_step() >= steps - 1,
                resume_timeout_s,
                interval_s=0.05,
            )
            resumed_s = time.time() - at if survived else None
            undo_at = time.time() if ctx.rejoin else None
            for undo in ctx.undo:
                undo()
            records.append(
                FaultRecord(
                    i, kind, what, at, step0, survived, resumed_s, committed, undo_at=undo_at
                )
            )
            log(
                f"fault {i + 1}/{faults} {kind}: {what}: "
                + (f"training resumed after {resumed_s:.2f} s" if survived else "NOT RESUMED")
                + (f": {ctx.failure}" if ctx.failure else "")
            )
            if not survived:
                break
            now_step = lc.max_step()
            # A healed node must train again: its quarantine lifted, its ranks running.
            if not wait_until(
                lambda s=now_step, h=ctx.healed, sp=ctx.spoiled_step: (
                    (steady(lc, s, healed=h) and committed_past(lc, sp))
                    or lc.max_step() >= steps - 1
                ),
                resume_timeout_s,
                interval_s=0.2,
            ):
                log(f"fault {i + 1}: the job did not become steady again")
                records[-1].survived = False
                break
            timelines.update({int(t["generation"]): t for t in lc.timelines()})
        if finish:
            lc.wait_finished(600)
        curve = lc.curve()
        rows = lc.metrics()
        timelines.update({int(t["generation"]): t for t in lc.timelines()})
    finally:
        for holder in holders:  # let held workers go, or they outlive the run
            holder.kill()
            holder.wait()
        lc.close()
        for where in mounts:
            with contextlib.suppress(RuntimeError):
                _run("umount", "-l", str(where))
        if sandbox is not None:
            sandbox.close()
    leftover = list(descendants(os.getpid()))
    last = max(reference) if finish else max(curve, default=-1)
    if not finish and last >= 0:
        reference = reference_curve(workdir, steps, seed, stop_at=last + 1)
    runs = kept_runs([r for r in rows if int(r["step"]) <= last])
    replay = replay_curve(workdir, steps, seed, runs) if runs else {}
    errors = [f"step {s}: not trained" for s in range(last + 1) if s not in curve]
    found, seams = replay_errors({s: v[0] for s, v in curve.items()}, replay, runs)
    errors += found
    apart = [_relative(curve[s][0], v) for s, v in replay.items() if s in curve]
    replay_max = max(apart, default=0.0)
    drift = {s: _relative(curve[s][0], v) for s, v in reference.items() if s <= last and s in curve}
    drift_max = max(drift.values(), default=0.0)
    if drift_max > DRIFT_LIMIT:
        worst = max(drift, key=drift.__getitem__)
        errors.append(
            f"step {worst}: {curve[worst][0]} vs {reference[worst]} uninterrupted, "
            f"more than {DRIFT_LIMIT} apart"
        )
    pairs = list(itertools.pairwise(completion_times(rows)))
    gaps = [b - a for a, b in pairs]
    median_gap = statistics.median(gaps) if gaps else float("nan")
    lost = 0
    for rec, nxt in itertools.zip_longest(records, records[1:]):
        end = nxt.at if nxt else float("inf")
        cut = rec.undo_at if rec.undo_at is not None else end
        # The fault's stall ends where the harness gives back what it took: a killed node
        # restarting is a join, timed on its own (the rejoin stall).
        window = [b - a for a, b in pairs if rec.at < b <= cut]
        rec.stall_s = max(window, default=float("nan")) - median_gap
        if rec.undo_at is not None:
            rejoin = [b - a for a, b in pairs if cut < b <= end]
            rec.rejoin_stall_s = max(rejoin, default=float("nan")) - median_gap
        created = [t for t in timelines.values() if rec.at <= float(t.get("detected_at", 0)) < end]
        rec.recomputed = sum(int(t.get("steps_recomputed", 0)) for t in created)
        rec.most_recomputed = max((int(t.get("steps_recomputed", 0)) for t in created), default=0)
        rec.timelines = sorted(created, key=lambda t: int(t["generation"]))
        # A committed step is lost when a recovery resumes before the job's committed step
        # (the published safe step) of the moment the fault struck.
        resumed_at = [int(t.get("resume_step", 0)) for t in created]
        if resumed_at and rec.committed is not None:
            rec.lost = max(0, rec.committed - min(resumed_at))
        lost += rec.lost
    return SoakResult(
        records,
        not errors,
        errors[:10],
        last + 1,
        lost,
        leftover,
        median_gap,
        time.monotonic() - started,
        replay_max,
        drift_max,
        len(runs),
        seams,
        max(
            (after / max(before, REPLAY_FLOOR / REPLAY_JUMP) for _, before, after in seams[1:]),
            default=0.0,
        ),
    )


def _pct(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def table(result: SoakResult) -> str:
    lines = [
        "| fault kind | count | survived | stall p50 (s) | stall p95 (s) | stall max (s) "
        "| steps recomputed | most in one recovery | committed steps lost "
        "| rejoin stall p50 (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in sorted({f.kind for f in result.faults}):
        fs = [f for f in result.faults if f.kind == kind]
        stalls = [f.stall_s for f in fs]
        rejoin = [f.rejoin_stall_s for f in fs if f.undo_at is not None]
        lines.append(
            f"| {kind} | {len(fs)} | {sum(f.survived for f in fs)} | {_pct(stalls, 0.5):.2f} "
            f"| {_pct(stalls, 0.95):.2f} | {max(stalls):.2f} | {sum(f.recomputed for f in fs)} "
            f"| {max(f.most_recomputed for f in fs)} | {sum(f.lost for f in fs)} | "
            + (f"{_pct(rejoin, 0.5):.2f} |" if rejoin else "– |")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds")
    p.add_argument(
        "--device",
        default="sliced",
        help="'sliced' (a latency-free slot model: pipeline/tensor layouts) or a preset (cpu)",
    )
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument(
        "--no-finish",
        action="store_true",
        help="stop once the job is steady after the last fault (the curve up to there)",
    )
    args = p.parse_args(argv)
    if args.faults < 1 or args.nodes < 2 or args.slots < 1:
        p.error("--faults >= 1, --nodes >= 2 and --slots >= 1 are required")
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - set(KINDS):
        p.error(f"unknown fault kind(s) {sorted(set(kinds) - set(KINDS))}; known: {sorted(KINDS)}")
    missing = {k: why for k in kinds if (why := unavailable(k)) is not None}
    if missing:
        if args.kinds != p.get_default("kinds"):
            p.error(f"fault kinds {missing} cannot run here")
        kinds = [k for k in kinds if k not in missing]
        print(f"left out {missing}", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        result = run_soak(
            workdir,
            faults=args.faults,
            seed=args.seed,
            nodes=args.nodes,
            slots=args.slots,
            kinds=kinds,
            device=args.device,
            finish=not args.no_finish,
        )
        (workdir / "soak.json").write_text(
            json.dumps({**asdict(result), "ok": result.ok}, indent=1, default=str)
        )
    print(table(result))
    print(
        f"\n{len(result.faults)} fault(s) in {result.wall_s:.0f} s over {result.steps} steps "
        f"(median step {result.median_step_s:.3f} s); curve "
        + ("matches" if result.curve_ok else f"DIFFERS: {result.curve_errors}")
        + f" (its {result.layout_runs} runs of layouts replayed: at most "
        f"{result.replay_max:.1e} apart, a resume at most {result.jump_max:.1f}x the "
        f"difference before it; the uninterrupted run: {result.drift_max:.1e})"
        + f"; committed steps lost: {result.lost_steps}; processes left: "
        f"{result.leftover_processes or 'none'}"
    )
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
