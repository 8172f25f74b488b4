"""One rank's training engine: a pipeline stage's slice of the model, its AdamW state and the
synchronous step (pipeline schedule, DP gradient reduce, global-norm clipping, update).

What keeps training layout independent (see the design's invariant 1):
- replica r trains global samples `k*B + plan.sample_range(r)` of step k;
- each micro-batch's backward uses (Σ per-sample losses) / B, and DP reduces by SUM, so the
  micro-batch and replica counts cancel out;
- the gradient norm is the true global one: sharded tensors counted by every tp rank,
  replicated tensors by tp rank 0 only, all of it by replica 0 only (after the DP reduce all
  replicas hold the same gradients), summed over the world;
- the optimizer is elementwise, so a tp slice updates exactly like its part of the whole.

The pipeline's p2p (see `schedule.p2p_phases` and `p2p.exchange`): each op's receive
travels in one batch with the send the op before it owes; the receive is waited on before
the op runs, the send after it, before the next exchange. A sent tensor is freed one phase
after it was made: sent buffers stay O(1) per rank, so 1F1B's activation memory stays O(p)
for any micro-batch count m. The loss is summed on the device and read to the host once per
step.

Precision (`TrainConfig.precision`): fp32, or bf16 compute under autocast over fp32
parameters; gradients, AdamW moments and snapshots are fp32 either way. Under bf16 a stage
boundary crosses the wire as bf16 and is cast back to the model's declared dtype on arrival.

Data parallelism reduces gradients in buckets while the step's last backward runs (see
`buckets`): each bucket is all-reduced as soon as its gradients are final, and the optimizer
waits for all of them. The update is torch's fused (or foreach) AdamW (see `kernels`).

A step ends with one all-gather across the world of (loss sum, known stop step). It follows
every rank's optimizer update, so when it returns the step is committed everywhere; it also
gives every rank the same loss and the same agreed stop step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from elasticpp.checkpoint.manifest import PieceEntry, PieceKey
from elasticpp.checkpoint.tensors import KINDS, PieceMeta, load_units, write_piece
from elasticpp.errors import CheckpointError
from elasticpp.plan import Plan
from elasticpp.train.config import TrainConfig
from elasticpp.train.data.samples import Corpus
from elasticpp.train.engine.buckets import DEFAULT_BUCKET_CAP_BYTES, GradReducer, sum_tied
from elasticpp.train.engine.kernels import AdamW, PhaseTimer, set_tf32
from elasticpp.train.engine.p2p import Sending, exchange
from elasticpp.train.engine.parallel import ParallelGroups
from elasticpp.train.engine.schedule import FORWARD, p2p_phases
from elasticpp.train.model.contract import DropoutKey, ModelDef, init_unit, slice_shape
from elasticpp.train.model.families import build_model
from elasticpp.train.model.stage import Stage

NO_STOP = 2**50  # "no stop requested"; exact in float64


@dataclass(frozen=True)
class StepResult:
    step: int  # 0-based index of the step just committed
    loss: float
    lr: float
    grad_norm: float
    samples: int
    step_seconds: float
    max_in_flight: int
    busy_seconds: float  # time this rank spent computing forwards and backwards
    pipeline_seconds: float  # time of the whole schedule (compute + waiting for neighbours)
    peak_activation_bytes: int  # most bytes autograd held saved for live micro-batches
    stop_at: int  # the agreed stop step (NO_STOP if none)
    writers_idle: bool = True  # every rank's snapshot writer was free after the update
    # The shortest time any rank's snapshot writer has been free (see Trainer.train_step).
    writers_rested_s: float = math.inf


@dataclass(frozen=True)
class UnitState:
    """A snapshot copy of one unit on this rank: CPU tensors named `kind/name`."""

    key: PieceKey
    tensors: dict[str, torch.Tensor]
    meta: PieceMeta

    def write(self, step_dir: Path) -> PieceEntry:
        return write_piece(step_dir, self.key, self.tensors, self.meta)


class Trainer:
    def __init__(
        self,
        plan: Plan,
        job: TrainConfig,
        groups: ParallelGroups,
        corpus: Corpus,
        device: torch.device,
        model: ModelDef | None = None,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
    ) -> None:
        self.plan = plan
        self.model = model if model is not None else build_model(plan.model)
        self.job = job
        self.groups = groups
        self.corpus = corpus
        self.device = device
        self.coord = groups.coord
        self.stage = Stage.for_stage(
            self.model,
            plan.model,
            plan.stages,
            self.coord.pp,
            recompute=plan.recompute,
            compiled=job.compile,
        )
        self.params: dict[str, dict[str, torch.Tensor]] = {}
        self.exp_avg: dict[str, dict[str, torch.Tensor]] = {}
        self.exp_avg_sq: dict[str, dict[str, torch.Tensor]] = {}
        self.shard_dims: dict[str, dict[str, int | None]] = {}
        self.decay: dict[str, dict[str, bool]] = {}
        # Tied parameters: "unit/name" of every local copy or original -> the original's.
        self.tied: dict[tuple[str, str], str] = {}
        originals = self.model.tied_params()
        for unit in self.stage.units:
            self.shard_dims[unit.name] = {p.name: p.shard_dim for p in unit.params}
            self.decay[unit.name] = {p.name: p.weight_decay for p in unit.params}
            for p in unit.params:
                key = f"{unit.name}/{p.name}"
                if p.tied_to is not None:
                    self.tied[(unit.name, p.name)] = p.tied_to
                elif key in originals:
                    self.tied[(unit.name, p.name)] = key
        # Every tied key, held here or not, in one order: the tie group's buffers must match.
        self.tie_shapes: dict[str, tuple[int, ...]] = {}
        for key in sorted(originals):
            unit_name, _, name = key.partition("/")
            p = self.model.unit(unit_name).param(name)
            self.tie_shapes[key] = slice_shape(p.shape, p.shard_dim, groups.tp_size)
        self.opt_step = 0
        self._param_storages: set[int] = set()
        self.bucket_cap_bytes = bucket_cap_bytes
        self.reducer: GradReducer | None = None
        self.optimizer: AdamW | None = None
        self.tf32 = set_tf32(device, job.precision)
        self._update_gates: list[torch.cuda.Event] = []  # CUDA events the next update waits for

    # ----- state -----

    def update_after(self, event: torch.cuda.Event) -> None:
        """The next optimizer update waits on the device for `event` (a CUDA event): a
        snapshot's copy of the state on a side stream reads what that update overwrites.
        The forward and backward before it do not wait."""
        self._update_gates.append(event)

    def init_fresh(self) -> None:
        tp_rank, tp_size = self.coord.tp, self.groups.tp_size
        values = {
            unit.name: init_unit(unit, self.job.seed, tp_rank, tp_size) for unit in self.stage.units
        }
        zeros = {u: {n: torch.zeros_like(t) for n, t in ts.items()} for u, ts in values.items()}
        self._install(
            values, zeros, {u: {n: t.clone() for n, t in z.items()} for u, z in zeros.items()}, 0
        )

    def load(self, directory: Path, expected_step: int) -> None:
        """Load this rank's units from a directory of pieces saved under any layout."""
        loaded = load_units(directory, self.stage.unit_names, self.coord.tp, self.groups.tp_size)
        values: dict[str, dict[str, torch.Tensor]] = {}
        m1: dict[str, dict[str, torch.Tensor]] = {}
        m2: dict[str, dict[str, torch.Tensor]] = {}
        for decl in self.stage.units:
            unit = decl.name
            got = loaded[unit]
            if got.step != expected_step:
                raise CheckpointError(
                    f"{directory}: unit {unit} is at step {got.step}, expected {expected_step}"
                )
            shapes = {
                p.name: slice_shape(p.shape, p.shard_dim, self.groups.tp_size) for p in decl.params
            }
            for target, kind in ((values, "param"), (m1, "exp_avg"), (m2, "exp_avg_sq")):
                target[unit] = {}
                for name, shape in shapes.items():
                    t = got.tensors.get(f"{kind}/{name}")
                    if t is None or tuple(t.shape) != shape:
                        raise CheckpointError(
                            f"{directory}: unit {unit} has no {kind}/{name} of shape {shape}"
                        )
                    target[unit][name] = t.to(torch.float32)
        self._install(values, m1, m2, expected_step)

    def _install(
        self,
        values: dict[str, dict[str, torch.Tensor]],
        m1: dict[str, dict[str, torch.Tensor]],
        m2: dict[str, dict[str, torch.Tensor]],
        step: int,
    ) -> None:
        dev = self.device
        self.params = {
            u: {n: t.to(dev).requires_grad_(True) for n, t in ts.items()}
            for u, ts in values.items()
        }
        self.exp_avg = {u: {n: t.to(dev) for n, t in ts.items()} for u, ts in m1.items()}
        self.exp_avg_sq = {u: {n: t.to(dev) for n, t in ts.items()} for u, ts in m2.items()}
        self.opt_step = step
        self._param_storages = {
            t.untyped_storage().data_ptr() for ts in self.params.values() for t in ts.values()
        }
        flat = [(u, n, t) for u, ts in self.params.items() for n, t in ts.items()]
        if self.reducer is not None:
            self.reducer.remove_hooks()
        self.reducer = None
        if self.groups.dp is not None:
            self.reducer = GradReducer([t for *_, t in flat], self.groups.dp, self.bucket_cap_bytes)
        self.optimizer = AdamW(
            [t for *_, t in flat],
            [self.exp_avg[u][n] for u, n, _ in flat],
            [self.exp_avg_sq[u][n] for u, n, _ in flat],
            [self.decay[u][n] for u, n, _ in flat],
            betas=self.job.betas,
            eps=self.job.eps,
            weight_decay=self.job.weight_decay,
            step=step,
        )

    def snapshot(self) -> list[UnitState]:
        """CPU copies of this rank's units (cheap; writing them can happen elsewhere)."""
        out = []
        tp_rank, tp_size = self.coord.tp, self.groups.tp_size
        for unit in self.stage.unit_names:
            tensors: dict[str, torch.Tensor] = {}
            dims: dict[str, int | None] = {}
            for kind, source in zip(
                KINDS, (self.params, self.exp_avg, self.exp_avg_sq), strict=True
            ):
                for name, t in source[unit].items():
                    tensors[f"{kind}/{name}"] = t.detach().to("cpu", copy=True)
                    dims[f"{kind}/{name}"] = self.shard_dims[unit][name]
            key = PieceKey(unit, tp_rank, tp_size)
            meta = PieceMeta(unit, tp_rank, tp_size, self.opt_step, dims)
            out.append(UnitState(key, tensors, meta))
        return out

    # ----- one step -----

    def train_step(
        self,
        step: int,
        local_stop: int,
        writer_idle: Callable[[], bool] = lambda: True,
        writer_rested: Callable[[], float] = lambda: math.inf,
    ) -> StepResult:
        """One step. `writer_idle()` and `writer_rested()`, asked once after the update, say
        whether this rank's snapshot writer is free and for how long (s) it has been, since
        its last write ended or its last snapshot was taken (0 while busy; infinite for a
        rank that writes none); `StepResult.writers_idle` is whether every rank's writer is
        free and `StepResult.writers_rested_s` the shortest of those times (both travel in the
        step's last all-gather), so every rank takes or skips a snapshot of this step alike."""
        started = time.perf_counter()
        plan, g = self.plan, self.groups
        B, b = plan.global_batch, plan.micro_batch
        m = plan.microbatches[self.coord.dp]
        first_sample = step * B + plan.sample_range(self.coord.dp)[0]
        boundary = self.model.boundary.per_sample
        boundary_dtype = self.model.boundary.torch_dtype()
        wire_dtype = self._wire_dtype(boundary_dtype)
        timer = PhaseTimer(self.device)
        reducer = self.reducer
        if reducer is not None:
            reducer.zero_grad()
        else:
            for ts in self.params.values():
                for t in ts.values():
                    t.grad = None

        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        act_bytes: dict[int, int] = {}
        # What the op just run owes its neighbour; sent with the next phase's receive.
        owed: tuple[torch.Tensor, int | None] | None = None
        # Summed on the device, read once per step: a host read per micro-batch would make
        # every micro-batch wait for the device.
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        live = peak_live = 0
        live_bytes = peak_bytes = 0
        backwards = 0
        timer.start("pipeline")
        sending = Sending()  # the last phase's send, finished while this phase's op runs
        for phase in p2p_phases(self.job.schedule, g.pp_size, self.coord.pp, m):
            op, inbox, recv = phase.run, None, None
            if phase.recv is not None:
                inbox = torch.empty(b, *boundary, dtype=wire_dtype, device=self.device)
                recv = (inbox, g.prev_rank if phase.recv.kind == FORWARD else g.next_rank)
            sending.finish()  # its buffer goes now, not at the step's end
            sending = exchange(owed, recv)
            owed = None
            if op is None:
                break
            i = op.microbatch
            mb_first = first_sample + i * b
            if op.kind == FORWARD:
                tokens = targets = None
                if g.is_first_stage or g.is_last_stage:
                    tokens, targets = self.corpus.batch(mb_first, b)
                if inbox is None:
                    assert tokens is not None  # only the first stage receives no input
                    x = tokens.to(self.device)
                else:
                    x = inbox.to(boundary_dtype).requires_grad_(True)
                timer.start("busy")
                key = (
                    DropoutKey(self.job.seed, step, mb_first, self.job.dropout)
                    if self.job.dropout > 0
                    else None
                )
                tgt = targets.to(self.device) if targets is not None and g.is_last_stage else None
                with self._count_saved() as counter, self._autocast():
                    out = self.stage.forward(
                        self.params, x, self.coord.tp, g.tp_size, g.tp, key, tgt
                    )
                timer.stop("busy")
                saved[i] = (x, out)
                act_bytes[i] = counter[0]
                live += 1
                live_bytes += counter[0]
                peak_live = max(peak_live, live)
                peak_bytes = max(peak_bytes, live_bytes)
                if g.is_last_stage:
                    loss_sum += out.detach().to(torch.float64)
                else:
                    owed = (out.detach().to(wire_dtype).contiguous(), g.next_rank)
            else:
                x, out = saved.pop(i)
                backwards += 1
                if reducer is not None and backwards == m:
                    reducer.arm()  # the step's last backward: reduce buckets as they finish
                timer.start("busy")
                if inbox is None:
                    torch.autograd.backward(out / B)
                else:
                    torch.autograd.backward(out, inbox.to(out.dtype))
                timer.stop("busy")
                live -= 1
                live_bytes -= act_bytes.pop(i)
                if not g.is_first_stage:
                    if x.grad is None:
                        raise RuntimeError(f"stage {self.coord.pp}: no input gradient")
                    owed = (x.grad.to(wire_dtype).contiguous(), g.prev_rank)
                del x, out
        sending.finish()
        timer.stop("pipeline")
        if reducer is not None:
            reducer.finish()  # every bucket summed over the replicas

        flat_params = [(u, n, t) for u, ts in self.params.items() for n, t in ts.items()]
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for _, _, t in flat_params]
        if self.tie_shapes:
            tied = [self.tied.get((u, n)) for u, n, _ in flat_params]
            sum_tied(grads, tied, self.tie_shapes, g.tie)

        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.coord.dp == 0:
            for (u, n, _), gr in zip(flat_params, grads, strict=True):
                if self.tied.get((u, n), f"{u}/{n}") != f"{u}/{n}":
                    continue  # a tied copy: its original counts the shared gradient once
                if self.shard_dims[u][n] is not None or self.coord.tp == 0:
                    # fp64 accumulation without an fp64 copy of the gradient
                    sq += torch.linalg.vector_norm(gr, dtype=torch.float64).square()
        dist.all_reduce(sq)
        grad_norm = math.sqrt(float(sq))
        clip = 1.0
        if self.job.clip_grad > 0 and grad_norm > self.job.clip_grad:
            clip = self.job.clip_grad / (grad_norm + 1e-6)
        lr = self.job.lr_at(step)
        assert self.optimizer is not None  # installed with the parameters
        self.opt_step += 1
        if self._update_gates:
            stream = torch.cuda.current_stream(self.device)
            for event in self._update_gates:
                stream.wait_event(event)
            self._update_gates.clear()
        self.optimizer.step(grads, lr, clip)

        mine = torch.tensor(
            [
                float(loss_sum.item()) if g.is_last_stage and self.coord.tp == 0 else 0.0,
                float(min(local_stop, NO_STOP)),
                1.0 if writer_idle() else 0.0,
                float(writer_rested()),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        gathered = [torch.empty_like(mine) for _ in range(g.world_size)]
        dist.all_gather(gathered, mine)
        rows = torch.stack(gathered).cpu()
        loss = float(rows[:, 0].sum()) / B
        agreed_stop = int(rows[:, 1].min())
        writers_idle = bool(rows[:, 2].min() > 0.5)
        writers_rested_s = float(rows[:, 3].min())
        return StepResult(
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            samples=B,
            step_seconds=time.perf_counter() - started,
            max_in_flight=peak_live,
            busy_seconds=timer.seconds("busy"),
            pipeline_seconds=timer.seconds("pipeline"),
            peak_activation_bytes=peak_bytes,
            stop_at=agreed_stop,
            writers_idle=writers_idle,
            writers_rested_s=writers_rested_s,
        )

    def _autocast(self) -> torch.autocast:
        """bf16 compute over fp32 parameters: autocast casts each weight for its matmuls and
        its backward returns fp32 gradients, so the master weights, the AdamW moments and
        every snapshot stay fp32. Norms, softmax and the loss run in fp32 under it."""
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.job.precision == "bf16"
        )

    def _wire_dtype(self, declared: torch.dtype) -> torch.dtype:
        """The dtype of boundary activations and their gradients on the wire: bf16 under bf16
        (half the bytes), else what the model declares. A receiver computes in the declared
        dtype, so a stage's residual stream is the same dtype whatever the pipeline depth."""
        if self.job.precision == "bf16" and declared.is_floating_point:
            return torch.bfloat16
        return declared

    def agree_stop(self, local_stop: int) -> int:
        """The world's minimum known stop step (a collective every rank must call)."""
        t = torch.tensor([float(min(local_stop, NO_STOP))], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    @contextmanager
    def _count_saved(self) -> Iterator[list[int]]:
        """Count the bytes autograd saves for backward (activations, not parameters)."""
        counter = [0]
        params = self._param_storages
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in params and ptr not in seen:
                seen.add(ptr)
                counter[0] += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield counter


def tie_stages(model: ModelDef, plan: Plan) -> tuple[int, ...]:
    """The pipeline stages that hold a tied parameter or its original."""
    names = set()
    for original, copies in model.tied_params().items():
        names.add(original.partition("/")[0])
        names.update(c.partition("/")[0] for c in copies)
    return tuple(
        pp for pp in range(plan.pp) if names & set(plan.model.stage_units(plan.stages, pp))
    )
