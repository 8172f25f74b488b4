"""GPU figures on one device: bf16 throughput and MFU of a ~1B Llama, against the same model
in `transformers`, and the agent's tax on one GPU.

    python bench/gpu.py [--micro-batches 4,8] [--steps 10] [--sections mfu,tax] [--out DIR]
                        [--tax-modes time,every-skip] [--tax-steps 150] [--tax-rounds 1]
                        [--py-spy BIN]

- mfu: `elasticpp train --device cuda --precision bf16` at `pp=1,tp=1,dp=1` (the `llama-1b`
  spec below: Llama 3.2 1B's shape with a 32k vocabulary and untied embeddings, 1.1 B
  parameters, seq 2048), global batch B = 16 at each micro-batch size b, against
  `transformers`' `LlamaForCausalLM` of the same configuration (SDPA attention) in a plain
  loop with the same policy: fp32 weights under bf16 autocast, torch's fused AdamW, B/b
  micro-batches of gradient accumulation. Step time: the median of the steps after the first
  three; each system its own per-step record (ours: the engine's step time; the reference:
  CUDA-synchronised wall time). FLOPs per token: `elasticpp.plan.flops`, the count behind
  the agent's `elasticpp_model_tflops` and `elasticpp_mfu`: 6 x the matmul parameters (blocks
  and LM head) + 6 x layers x seq x attention width (the scores and values of causal
  attention, forward and backward, counted as the flash kernel computes them: the masked
  half skipped); MFU against `--peak-tflops` (default: the visible GPU's dense bf16 peak
  from `elasticpp.plan.flops`' table, 989 on an H100 or H200).
- tax: a job under one agent with one CUDA slot (real etcd, no peer to replicate to; the job
  spec's planner device is the visible GPU's preset, so the agent plans the same layout,
  recompute off) against `elasticpp train` at the same layout, on the `llama-tax` spec (~200 M
  parameters, 2.4 GB of fp32 state a snapshot), one run per `--tax-modes` entry: `time`, the
  default time rule (a snapshot once every writer has been free `snapshot_every_s`, 10 s);
  `every-skip` and `every-wait`, a snapshot every step (`snapshot_every: 1`) with
  `snapshot_when_busy` skip or wait; `time-2s`, the time rule at 2 s (the default before);
  `no-snapshots`, the agent's own work alone (`snapshot_every` past the end). Each side's
  throughput is its mean interval between consecutive steps' completions after a warm-up (wall
  clock: the lines `elasticpp train` prints, the agents' step records), so a periodic snapshot
  step counts; the ratio is the agent's tax on one GPU. `--tax-rounds N` repeats the baseline
  and every mode N times, interleaved, each ratio against its own round's baseline. `--py-spy
  BIN` also samples the training worker's Python stacks for 5 s of every run (`BIN`: a py-spy
  executable; not a dependency) and prints each run's busiest threads and frames side by side.

Every process this starts is stopped on the way out. Writes `gpu.json` and `gpu.md` to
`--out` (a temp dir by default) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEQ = 2048
LLAMA_1B: dict[str, Any] = {
    "name": "llama-1b",
    "family": "llama",
    "num_layers": 16,
    "hidden_size": 2048,
    "num_heads": 32,
    "num_kv_heads": 8,
    "ffn_hidden_size": 8192,
    "vocab_size": 32000,
    "seq_len": SEQ,
}
LLAMA_TAX: dict[str, Any] = LLAMA_1B | {
    "name": "llama-tax",
    "num_layers": 8,
    "hidden_size": 1024,
    "num_heads": 16,
    "ffn_hidden_size": 4096,
    "seq_len": 1024,
}
GLOBAL_BATCH = 16
WARMUP = 3
RUN_TIMEOUT_S = 400


def matmul_params(spec: dict[str, Any]) -> int:
    """Entries of the weight matrices (blocks and LM head): 2 forward FLOPs each a token."""
    from elasticpp.plan.flops import forward_flops
    from elasticpp.plan.specs import ModelSpec

    f = forward_flops(ModelSpec.from_dict(spec))
    return round((f.num_layers * f.block_matmul + f.last) / 2)


def flops_per_token(spec: dict[str, Any]) -> float:
    """Model FLOPs of one token's forward and backward (`elasticpp.plan.flops`)."""
    from elasticpp.plan.flops import forward_flops
    from elasticpp.plan.specs import ModelSpec

    return forward_flops(ModelSpec.from_dict(spec)).train_per_token


def steady_step_s(step_seconds: list[float]) -> float:
    rest = step_seconds[WARMUP:]
    if not rest:
        raise RuntimeError(f"{len(step_seconds)} steps: too few after {WARMUP} of warm-up")
    return statistics.median(rest)


def run_ours(
    spec: dict[str, Any], micro_batch: int, steps: int, work: Path, *extra: str
) -> list[float]:
    spec_file = work / f"{spec['name']}.json"
    spec_file.write_text(json.dumps(spec))
    metrics = work / f"ours-b{micro_batch}{''.join(extra)}.jsonl"
    cmd = [
        sys.executable, "-m", "elasticpp.cli.main", "train", "--model", str(spec_file),
        "--device", "cuda", "--precision", "bf16", "--layout", "pp=1,tp=1,dp=1",
        "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(micro_batch),
        "--steps", str(steps), "--metrics", str(metrics), "--log-dir", str(work / "logs"), *extra,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=RUN_TIMEOUT_S, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [float(r["step_seconds"]) for r in rows]


def run_reference(spec: dict[str, Any], micro_batch: int, steps: int) -> list[float]:
    """transformers' Llama in a plain loop (this script, `--reference`, in a process of its
    own so that neither side inherits the other's allocator state)."""
    cmd = [sys.executable, __file__, "--reference", json.dumps(spec), str(micro_batch), str(steps)]
    out = subprocess.run(cmd, timeout=RUN_TIMEOUT_S, capture_output=True, text=True)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"exit {out.returncode}: {tail[0][:200]}")
    return [float(x) for x in json.loads(out.stdout.strip().splitlines()[-1])]


def reference_main(spec: dict[str, Any], micro_batch: int, steps: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["ffn_hidden_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        max_position_embeddings=spec["seq_len"],
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    m = GLOBAL_BATCH // micro_batch
    gen = torch.Generator(device="cuda").manual_seed(0)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(m):
            ids = torch.randint(
                0, 256, (micro_batch, spec["seq_len"]), device="cuda", generator=gen
            )
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            (loss / m).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    print(json.dumps(times))


def mfu_section(
    args: argparse.Namespace, work: Path, peak: float
) -> tuple[list[dict[str, Any]], str]:
    spec = LLAMA_1B
    tokens = GLOBAL_BATCH * spec["seq_len"]
    fpt = flops_per_token(spec)
    rows = []
    lines = [
        f"llama-1b ({matmul_params(spec) / 1e9:.2f} B matmul parameters), seq {SEQ}, "
        f"B = {GLOBAL_BATCH}, bf16 autocast over fp32 weights, {fpt / 1e9:.1f} GFLOP per token",
        "",
        "| system | b | m | step (s) | tokens/s | TFLOP/s | MFU | vs transformers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in args.micro_batches:
        runs: list[tuple[str, Callable[[], list[float]]]] = [
            ("transformers + fused AdamW", lambda b=b: run_reference(spec, b, args.steps)),
            ("elasticpp train", lambda b=b: run_ours(spec, b, args.steps, work)),
        ]
        if args.compile:
            runs.append(
                (
                    "elasticpp train --compile",
                    lambda b=b: run_ours(spec, b, args.steps + 2, work, "--compile"),
                )
            )
        ref = None
        for name, run in runs:
            try:
                step_s = steady_step_s(run())
            except (subprocess.SubprocessError, RuntimeError) as exc:
                # One configuration that does not fit (out of memory, say) is a row, not the end.
                lines.append(f"| {name} | {b} | {GLOBAL_BATCH // b} | failed: {exc} | | | | |")
                print(lines[-1], flush=True)
                continue
            ref = step_s if ref is None and name.startswith("transformers") else ref
            tflops = tokens * fpt / step_s / 1e12
            vs = f"{ref / step_s:.2f}×" if ref is not None else "–"
            row = {"system": name, "b": b, "step_s": step_s, "tokens_per_s": tokens / step_s,
                   "tflops": tflops, "mfu": tflops / peak}  # fmt: skip
            rows.append(row)
            lines.append(
                f"| {name} | {b} | {GLOBAL_BATCH // b} | {step_s:.3f} | {tokens / step_s:,.0f} "
                f"| {tflops:.0f} | {100 * tflops / peak:.1f} % | {vs} |"
            )
            print(lines[-1], flush=True)
    return rows, "\n".join(lines)


TAX_MODES: dict[str, dict[str, Any]] = {
    "time": {},  # the job spec's defaults: the time rule
    "every-skip": {"snapshot_every": 1, "snapshot_when_busy": "skip"},
    "every-wait": {"snapshot_every": 1, "snapshot_when_busy": "wait"},
    "time-2s": {"snapshot_every_s": 2.0},  # the default before 10 s
    "no-snapshots": {"snapshot_every": 10**6},  # past the end: the agent's own work alone
}
TAX_WARMUP = 10  # intervals left out: CUDA warm-up and the first snapshot's buffers


def device_model() -> str | dict[str, float]:
    """The job spec's `device` for the visible GPU (an agent with CUDA workers refuses the
    default `cpu` model: it plans 8 GiB slots)."""
    import torch

    from elasticpp.plan.specs import gpu_device_model

    props = torch.cuda.get_device_properties(0)
    return gpu_device_model(props.name, props.total_memory / 2**30)


def agent_plan(spec: dict[str, Any], b: int, device: str | dict[str, float]) -> str:
    """The plan the agent's planner makes for the tax job on one slot, as "pp/tp/dp, b,
    recompute" (`elasticpp train` is given its layout, with recompute off)."""
    from elasticpp.plan.search import plan
    from elasticpp.plan.specs import ClusterSpec, DeviceSpec, ModelSpec, NodeSpec, load_device_spec

    dev = load_device_spec(device) if isinstance(device, str) else DeviceSpec("custom", **device)
    model = ModelSpec.from_dict(spec)
    best = plan(model, ClusterSpec((NodeSpec("n0", 1),), dev), GLOBAL_BATCH, micro_batch=b).best
    return (
        f"pp={best.pp} tp={best.tp} dp={best.dp}, b={best.micro_batch}, "
        f"recompute {'on' if best.recompute else 'off'}"
    )


@dataclass(frozen=True)
class Timing:
    interval_s: float  # mean interval between steps' completions (wall clock)
    engine_s: float  # mean of the engine's own step time over the same steps
    median_s: float = 0.0  # the median interval: the common step, one-off stalls left out
    slowest: tuple[tuple[int, float], ...] = ()  # the 3 longest intervals: (step, s)

    @classmethod
    def of(cls, times: list[float], engine: list[float]) -> Timing:
        done = sorted(times)
        gaps = [(i, done[i] - done[i - 1]) for i in range(TAX_WARMUP + 1, len(done))]
        return cls(
            mean_interval_s(times),
            statistics.fmean(engine[TAX_WARMUP + 1 :]),
            statistics.median(g for _, g in gaps),
            tuple(sorted(gaps, key=lambda g: -g[1])[:3]),
        )

    def slowest_text(self) -> str:
        return ", ".join(f"{s:.2f} (step {i})" for i, s in self.slowest)


def mean_interval_s(times: list[float]) -> float:
    done = sorted(times)[TAX_WARMUP:]
    if len(done) < 2:
        raise RuntimeError(f"{len(times)} steps: too few after {TAX_WARMUP} of warm-up")
    return (done[-1] - done[0]) / (len(done) - 1)


def cpu_ticks(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def busiest_descendant(root: int) -> int | None:
    """The descendant of `root` that used the most CPU over the next second (the training
    worker, in these runs)."""
    from elasticpp.proctree import descendants

    before = {pid: cpu_ticks(pid) for pid in descendants(root)}
    time.sleep(1.0)
    used = {pid: cpu_ticks(pid) - t for pid, t in before.items() if t >= 0}
    return max(used, key=lambda p: used[p]) if used else None


class StackSampler:
    """`--py-spy BIN`: 5 s of the training worker's Python stacks (py-spy's collapsed
    format, every thread on a CPU) once a run is past its warm-up, written to
    `OUT/stacks-RUN.txt`; `summary()` gives the busiest frames of each run side by side."""

    SECONDS = 5

    def __init__(self, binary: str | None, out: Path) -> None:
        self.binary, self.out = binary, out
        self.files: dict[str, Path] = {}

    def sample(self, run: str, root: int) -> None:
        if self.binary is None:
            return
        pid = busiest_descendant(root)
        if pid is None:
            return
        path = self.out / f"stacks-{run}.txt"
        cmd = [self.binary, "record", "--rate", "200", "--duration", str(self.SECONDS),
               "--format", "raw", "--threads", "--nonblocking", "--pid", str(pid),
               "--output", str(path)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if done.returncode == 0 and path.exists():
            self.files[run] = path
        else:
            print(f"py-spy on {run} (pid {pid}): exit {done.returncode}: {done.stderr[-300:]}")

    def summary(self, top: int = 12) -> str:
        lines = []
        for run, path in self.files.items():
            threads: dict[str, int] = {}
            own: dict[str, int] = {}
            total = 0
            for line in path.read_text().splitlines():
                stack, _, count = line.rpartition(" ")
                if not count.isdigit():
                    continue
                n = int(count)
                frames = stack.split(";")
                total += n
                threads[frames[0]] = threads.get(frames[0], 0) + n
                own[frames[-1]] = own.get(frames[-1], 0) + n
            lines += ["", f"{run}: {total} samples in {self.SECONDS} s at 200 Hz", ""]
            lines += [f"  {100 * n / total:5.1f} %  {t}" for t, n in sorted(
                threads.items(), key=lambda kv: -kv[1])]  # fmt: skip
            lines.append("  own frames:")
            lines += [f"  {100 * n / total:5.1f} %  {f}" for f, n in sorted(
                own.items(), key=lambda kv: -kv[1])[:top]]  # fmt: skip
        return "\n".join(lines)


SAMPLE_AFTER = 30  # steps trained before the stacks are sampled


def train_step_times(
    spec: dict[str, Any],
    micro_batch: int,
    steps: int,
    work: Path,
    sampler: StackSampler | None = None,
    tag: str = "",
) -> Timing:
    """`elasticpp train` on CUDA in bf16: when each step's line was printed (wall clock), and
    the engine's own time of each step (the line's last field)."""
    spec_file = work / f"{spec['name']}.json"
    spec_file.write_text(json.dumps(spec))
    cmd = [
        sys.executable, "-m", "elasticpp.cli.main", "train", "--model", str(spec_file),
        "--device", "cuda", "--precision", "bf16", "--layout", "pp=1,tp=1,dp=1",
        "--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(micro_batch),
        "--steps", str(steps), "--log-dir", str(work / f"logs-train{tag}"),
    ]  # fmt: skip
    times: list[float] = []
    inside: list[float] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("step "):
                    times.append(time.monotonic())
                    inside.append(float(line.split()[-2]))
                    if sampler is not None and len(times) == SAMPLE_AFTER:
                        threading.Thread(
                            target=sampler.sample, args=(f"train{tag}", proc.pid), daemon=True
                        ).start()
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if code != 0:
        raise RuntimeError(f"elasticpp train exited {code}")
    return Timing.of(times, inside)


def tax_section(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], str]:
    """`--tax-rounds` rounds, each `elasticpp train` then every `--tax-modes` run, so a
    ratio is always against the baseline of its own round and the rounds show how much one
    run moves on the machine."""
    spec = LLAMA_TAX
    b = 8
    steps = args.tax_steps
    sampler = StackSampler(args.py_spy, work)
    rounds: list[tuple[Timing, dict[str, Timing]]] = []
    for r in range(args.tax_rounds):
        tag = f"-r{r + 1}" if args.tax_rounds > 1 else ""
        train = train_step_times(spec, b, steps, work, sampler, tag)
        agent = {m: agent_step_times(spec, b, steps, work, m, sampler, tag) for m in args.tax_modes}
        rounds.append((train, agent))
    out: dict[str, Any] = {"rounds": []}
    for train, agent in rounds:
        out["rounds"].append(
            {
                "train_step_s": train.interval_s,
                "train_engine_s": train.engine_s,
                **{f"agent_{m}_step_s": v.interval_s for m, v in agent.items()},
                **{f"agent_{m}_engine_s": v.engine_s for m, v in agent.items()},
            }
        )
    lines = [
        f"llama-tax (8 layers x 1024, seq 1024, B = {GLOBAL_BATCH}, b = {b}, bf16, "
        f"{matmul_params(spec) * 12 / 1e9:.1f} GB of state), one CUDA slot, {steps} steps, "
        f"mean interval after {TAX_WARMUP} (s/step); in the step: the engine's own time of a "
        "step (`step_seconds`), the rest is between steps; each round against its own "
        f"`elasticpp train`. The agent's plan: {agent_plan(spec, b, device_model())} "
        f"(device model {device_model()}):",
        "",
        "| round | run | s/step | vs `elasticpp train` | in the step (s) | median (s) "
        "| slowest (s) |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for r, (train, agent) in enumerate(rounds, 1):
        ours = train.interval_s
        lines.append(
            f"| {r} | `elasticpp train` | {ours:.3f} | 1.00× | {train.engine_s:.3f} | "
            f"{train.median_s:.3f} | {train.slowest_text()} |"
        )
        lines += [
            f"| {r} | agent, {m} | {v.interval_s:.3f} | {v.interval_s / ours:.2f}× | "
            f"{v.engine_s:.3f} | {v.median_s:.3f} | {v.slowest_text()} |"
            for m, v in agent.items()
        ]
    if sampler.files:
        lines += ["", "Python stacks of the training worker (py-spy):", sampler.summary()]
    return out, "\n".join(lines)


def agent_step_times(
    spec: dict[str, Any],
    b: int,
    steps: int,
    work: Path,
    mode: str,
    sampler: StackSampler | None = None,
    tag: str = "",
) -> Timing:
    """A job under one agent with one CUDA slot: when the agent handled each step's record,
    and the engine's own time of each step (the record's `step_seconds`)."""
    from elasticpp.agent.localcluster import LocalCluster

    job = {
        "name": "gpu-tax",
        "model": str(work / f"{spec['name']}.json"),  # written by train_step_times
        "global_batch": GLOBAL_BATCH,
        "micro_batch": b,
        "steps": steps,
        "seed": 0,
        "min_nodes": 1,
        "max_nodes": 1,
        "lease_ttl_s": 5,
        "join_settle_s": 0.5,
        "hang_timeout_s": 120,
        "precision": "bf16",
        "device": device_model(),
        **TAX_MODES[mode],
    }
    lc = LocalCluster(work / f"cluster-{mode}{tag}", job, nodes=1, slots=1, device="cuda")
    try:
        lc.start()
        if sampler is not None and sampler.binary is not None:
            lc.wait_for(lambda: lc.max_step() >= SAMPLE_AFTER, RUN_TIMEOUT_S, "warm-up")
            sampler.sample(f"agent-{mode}{tag}", os.getpid())
        lc.wait_finished(RUN_TIMEOUT_S)
        rows = lc.metrics()
    finally:
        lc.close()
    newest = max(int(r["generation"]) for r in rows)
    rows = sorted((r for r in rows if int(r["generation"]) == newest), key=lambda r: r["step"])
    return Timing.of([float(r["time"]) for r in rows], [float(r["step_seconds"]) for r in rows])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--reference":
        reference_main(json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro-batches", default="4,8", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--sections", default="mfu,tax")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the GPU's peak for MFU (default: its dense bf16 peak from elasticpp.plan.flops)",
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--tax-modes",
        default="time,every-skip",
        type=lambda s: s.split(","),
        help=f"tax: agent runs, of {', '.join(TAX_MODES)}",
    )
    p.add_argument("--tax-steps", type=int, default=150, help="tax: steps of every run")
    p.add_argument(
        "--tax-rounds",
        type=int,
        default=1,
        help="tax: rounds of `elasticpp train` then every mode, each against its own baseline",
    )
    p.add_argument(
        "--py-spy",
        default=None,
        metavar="BIN",
        help="tax: sample the training worker's Python stacks with this py-spy",
    )
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip --compile runs")
    args = p.parse_args()
    if args.tax_rounds < 1:
        p.error(f"--tax-rounds: {args.tax_rounds}: at least 1")
    unknown = sorted(set(args.tax_modes) - set(TAX_MODES))
    if unknown:
        p.error(f"--tax-modes: unknown {', '.join(unknown)} (known: {', '.join(TAX_MODES)})")
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu.py: torch sees no CUDA device", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="elasticpp-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    from elasticpp.plan.flops import device_peak_tflops

    device = torch.cuda.get_device_name(0)
    peak = args.peak_tflops or device_peak_tflops(device, "bf16")
    if peak is None and "mfu" in args.sections.split(","):
        print(f"bench/gpu.py: no peak known for {device!r}: give --peak-tflops", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"device": device, "torch": torch.__version__, "peak_tflops": peak}
    text = [f"{device}, torch {torch.__version__}"]
    sections = args.sections.split(",")
    if "mfu" in sections:
        assert peak is not None
        result["mfu"], t = mfu_section(args, out, peak)
        text += ["", t]
    if "tax" in sections:
        result["tax"], t = tax_section(args, out)
        text += ["", t]
    (out / "gpu.json").write_text(json.dumps(result, indent=1))
    (out / "gpu.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
