"""The model contract: what a model must declare so that elasticpp can train it under any
`(p, t, d)`, move its state between layouts, and keep the loss curve layout independent.

A model (`ModelDef`) is an ordered list of units: the `first` units open the pipeline (they
take the token ids `[b, seq]` and always sit on stage 0), the `blocks` repeat between and
are what the planner partitions into stages, the `last` units close it (they always sit on
the last stage). Each `Unit` declares its parameters as data (`Param`: name, whole shape,
how tensor parallelism slices it, how it is initialised) and its forward, a plain torch
function `forward(ctx, params, x) -> y` over this rank's slices. The model declares what
crosses a stage boundary (`Boundary`: shape per sample and dtype) and its loss: per-sample
losses `[b]` from the last unit's output and the targets (the engine sums them and divides
by the global batch).

Tensor parallelism (`Split`), after Megatron's parallel linears:
- COLUMN: the output dimension (dim 0 of a `[out, in]` weight, and its bias) is split; the
  forward sees `out / t` rows and must first `ctx.copy_to_tp` its input.
- ROW: the input dimension (the last dim) is split; the forward multiplies by its slice and
  sums the partial products with `ctx.reduce_from_tp` (a row-parallel bias is declared
  REPLICATED and added after the reduce).
- VOCAB: a `[vocab, hidden]` table split along the vocabulary: `ctx.embedding` looks token
  ids up in it, `ctx.cross_entropy` computes the loss from vocabulary-split logits.
- REPLICATED: every tp rank holds the whole tensor.
Slices are contiguous equal chunks in tp-rank order, so every split size must be divisible
by the tensor-parallel width (the planner only offers widths that divide them all).

What keeps invariant 1 (the design's layout independence) for any model honouring this:
every parameter is initialised WHOLE from a generator seeded by `(seed, unit, name)` and then
sliced; `ctx.dropout` draws masks per `(seed, step, global sample, unit, site)`; the forward
of a unit depends only on its inputs, its parameters and the context (never on the rank,
except through the tp helpers). A tied parameter (`tied_to="unit/name"`) starts as a copy of
its original and gets the sum of both gradients, wherever the two live.

Names of units and parameters use `elasticpp.names`' character set; `validate` refuses a
declaration that breaks the contract, naming the unit and parameter, before a worker starts.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from elasticpp.errors import ConfigError
from elasticpp.names import parse_name
from elasticpp.plan.specs import ModelNumbers, ModelSpec, OptionValue
from elasticpp.train.data.samples import stable_int
from elasticpp.train.engine.parallel import copy_to_tp, reduce_from_tp, vocab_parallel_cross_entropy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ContractError(ConfigError):
    """A model declaration breaks the contract."""


class Split(enum.Enum):
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    REPLICATED = "replicated"


@dataclass(frozen=True)
class Init:
    """How a parameter is initialised: `normal` (mean 0, `std`), `zeros` or `ones`."""

    kind: str = "normal"
    std: float = 0.02

    def __post_init__(self) -> None:
        if self.kind not in ("normal", "zeros", "ones"):
            raise ContractError(f"init kind must be normal, zeros or ones, got {self.kind!r}")
        if not (isinstance(self.std, (int, float)) and 0 <= self.std < math.inf):
            raise ContractError(f"init std must be a finite number >= 0, got {self.std!r}")


ZEROS = Init("zeros", 0.0)
ONES = Init("ones", 0.0)


def normal(std: float) -> Init:
    return Init("normal", std)


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]  # the whole tensor's shape, before tensor parallelism
    split: Split = Split.REPLICATED
    init: Init = field(default_factory=Init)
    decay: bool | None = None  # AdamW weight decay; None: matrices yes, vectors no
    tied_to: str | None = None  # "unit/name" of the parameter this one shares values with

    @property
    def shard_dim(self) -> int | None:
        if self.split is Split.REPLICATED:
            return None
        if self.split is Split.ROW:
            return len(self.shape) - 1
        return 0

    @property
    def weight_decay(self) -> bool:
        return self.decay if self.decay is not None else len(self.shape) >= 2

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class UnitContext:
    """What a unit's forward may use besides its parameters and input: the tp helpers and
    the rank-independent dropout of this micro-batch."""

    def __init__(
        self,
        unit: str,
        tp_rank: int,
        tp_size: int,
        tp_group: Any,
        vocab_size: int,
        dropout: DropoutKey | None,
    ) -> None:
        self.unit = unit
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.vocab_size = vocab_size
        self._dropout = dropout

    def copy_to_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Identity forward, gradient summed over the tp group backward (before COLUMN)."""
        return copy_to_tp(x, self.tp_group)

    def reduce_from_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the tp group forward, identity backward (after ROW)."""
        return reduce_from_tp(x, self.tp_group)

    def dropout(self, x: torch.Tensor, site: str) -> torch.Tensor:
        """Dropout with masks keyed by (seed, step, global sample, unit, site); `x` must be
        replicated across tp ranks (every rank draws the same mask)."""
        key = self._dropout
        if key is None or key.p == 0.0:
            return x
        masks = []
        for i in range(x.shape[0]):
            gen = torch.Generator().manual_seed(
                stable_int("dropout", key.seed, key.step, key.first_sample + i, self.unit, site)
            )
            masks.append(torch.rand(x.shape[1:], generator=gen) >= key.p)
        mask = torch.stack(masks).to(x.device)
        return x * mask / (1.0 - key.p)

    def _vocab_split(self, rows: int) -> bool:
        if rows == self.vocab_size:
            return False
        if rows * self.tp_size != self.vocab_size:
            raise ContractError(
                f"unit {self.unit}: a table of {rows} rows is neither the vocabulary "
                f"({self.vocab_size}) nor its 1/{self.tp_size} slice"
            )
        return True

    def embedding(self, tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Token ids looked up in a whole or vocabulary-split (VOCAB) table."""
        if not self._vocab_split(weight.shape[0]):
            return F.embedding(tokens, weight)
        start = self.tp_rank * weight.shape[0]
        local = tokens - start
        outside = (local < 0) | (local >= weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.reduce_from_tp(out)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy `[...]` of whole or vocabulary-split logits `[..., V(/t)]`."""
        if not self._vocab_split(logits.shape[-1]):
            flat = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
            )
            return flat.view(targets.shape)
        start = self.tp_rank * logits.shape[-1]
        return vocab_parallel_cross_entropy(logits, targets, start, self.tp_group)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Whole logits from vocabulary-split ones (for evaluation; not differentiable)."""
        if not self._vocab_split(logits.shape[-1]):
            return logits
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


UnitForward = Callable[[UnitContext, Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor]
LossFn = Callable[[UnitContext, torch.Tensor, torch.Tensor], torch.Tensor]


def mean_token_cross_entropy(
    ctx: UnitContext, logits: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The default loss: per sample, the mean over its tokens of the cross-entropy."""
    return ctx.cross_entropy(logits, targets).mean(dim=1)


@dataclass(frozen=True)
class Unit:
    name: str
    params: tuple[Param, ...]
    forward: UnitForward
    # Forward FLOPs per token, for the planner; None: 2 per parameter (a matmul's multiply-add).
    flops_per_token: float | None = None

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise ContractError(f"unit {self.name} has no parameter {name!r}")

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params if p.tied_to is None)

    @property
    def fwd_flops_per_token(self) -> float:
        if self.flops_per_token is not None:
            return float(self.flops_per_token)
        return 2.0 * sum(p.numel for p in self.params if len(p.shape) >= 2)


@dataclass(frozen=True)
class Boundary:
    """What one sample sends from a stage to the next: a tensor of this shape and dtype."""

    per_sample: tuple[int, ...]
    dtype: str = "float32"

    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class ModelDef:
    name: str
    first: tuple[Unit, ...]
    blocks: tuple[Unit, ...]
    last: tuple[Unit, ...]
    boundary: Boundary
    vocab_size: int
    seq_len: int
    loss: LossFn = mean_token_cross_entropy
    num_heads: int = 1  # attention heads, for the planner's activation-memory estimate
    tp_divisors: tuple[int, ...] = ()  # further sizes a tp width must divide (e.g. kv heads)

    @property
    def units(self) -> tuple[Unit, ...]:
        return (*self.first, *self.blocks, *self.last)

    @property
    def unit_names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units)

    def unit(self, name: str) -> Unit:
        for u in self.units:
            if u.name == name:
                return u
        raise ContractError(f"model {self.name} has no unit {name!r}")

    def is_block(self, name: str) -> bool:
        return any(u.name == name for u in self.blocks)

    def tied_params(self) -> dict[str, list[str]]:
        """original "unit/name" -> the "unit/name" of every parameter tied to it."""
        out: dict[str, list[str]] = {}
        for u in self.units:
            for p in u.params:
                if p.tied_to is not None:
                    out.setdefault(p.tied_to, []).append(f"{u.name}/{p.name}")
        return out


def validate(model: ModelDef) -> None:
    """Refuse a declaration that breaks the contract, naming the unit and parameter."""
    where = f"model {model.name!r}"
    if not isinstance(model, ModelDef):
        raise ContractError(f"a model definition must be a ModelDef, got {type(model).__name__}")
    for name in ("vocab_size", "seq_len", "num_heads"):
        v = getattr(model, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ContractError(f"{where}: {name} must be a positive integer, got {v!r}")
    if not model.first or not model.blocks or not model.last:
        raise ContractError(
            f"{where}: needs at least one first unit, one block and one last unit "
            f"(has {len(model.first)}, {len(model.blocks)}, {len(model.last)})"
        )
    if not isinstance(model.boundary, Boundary) or model.boundary.dtype not in DTYPES:
        raise ContractError(f"{where}: boundary dtype must be one of {', '.join(DTYPES)}")
    if not model.boundary.per_sample or any(
        isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in model.boundary.per_sample
    ):
        raise ContractError(f"{where}: boundary shape must be positive integers")
    seen_units: set[str] = set()
    shapes: dict[str, Param] = {}
    for unit in model.units:
        if not isinstance(unit, Unit):
            raise ContractError(f"{where}: units must be Unit, got {type(unit).__name__}")
        _check_name(unit.name, f"{where}: unit")
        if unit.name in seen_units:
            raise ContractError(f"{where}: unit name {unit.name!r} is used twice")
        seen_units.add(unit.name)
        if not callable(unit.forward):
            raise ContractError(f"{where}: unit {unit.name} has no callable forward")
        names: set[str] = set()
        for p in unit.params:
            at = f"{where}: unit {unit.name} parameter {p.name!r}"
            _check_name(p.name, f"{where}: unit {unit.name} parameter")
            if p.name in names:
                raise ContractError(f"{at} is declared twice")
            names.add(p.name)
            if not p.shape or any(
                isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in p.shape
            ):
                raise ContractError(f"{at}: shape must be positive integers, got {p.shape!r}")
            if not isinstance(p.split, Split):
                raise ContractError(f"{at}: split must be a Split, got {p.split!r}")
            if p.split is Split.ROW and len(p.shape) < 2:
                raise ContractError(f"{at}: a ROW split needs a matrix (a bias is REPLICATED)")
            if p.split is Split.VOCAB and p.shape[0] != model.vocab_size:
                raise ContractError(
                    f"{at}: a VOCAB split needs {model.vocab_size} rows, has {p.shape[0]}"
                )
            shapes[f"{unit.name}/{p.name}"] = p
    for u in model.units:
        for p in u.params:
            if p.tied_to is None:
                continue
            at = f"{where}: unit {u.name} parameter {p.name!r}"
            original = shapes.get(p.tied_to)
            if original is None or original.tied_to is not None:
                raise ContractError(f"{at}: tied_to {p.tied_to!r} is not an untied parameter")
            if (original.shape, original.split) != (p.shape, p.split):
                raise ContractError(f"{at}: shape or split differs from {p.tied_to}")


def _check_name(name: object, what: str) -> None:
    try:
        parse_name(name, what=what)
    except ConfigError as exc:
        raise ContractError(str(exc)) from exc


def split_sizes(model: ModelDef) -> tuple[int, ...]:
    """Every size a tensor-parallel width must divide."""
    sizes = {*model.tp_divisors}
    if model.num_heads > 1:  # heads are split whole across tp ranks
        sizes.add(model.num_heads)
    for u in model.units:
        for p in u.params:
            if p.shard_dim is not None:
                sizes.add(p.shape[p.shard_dim])
    return tuple(sorted(sizes))


def model_numbers(model: ModelDef) -> ModelNumbers:
    """The declaration's parameter counts and FLOPs, as the planner's plain numbers."""
    blocks = model.blocks
    return ModelNumbers(
        first_params=sum(u.numel for u in model.first),
        block_params=math.ceil(sum(u.numel for u in blocks) / len(blocks)),
        last_params=sum(u.numel for u in model.last),
        block_flops_per_token=sum(u.fwd_flops_per_token for u in blocks) / len(blocks),
        last_flops_per_token=sum(u.fwd_flops_per_token for u in model.last),
        boundary_values_per_token=max(1, math.prod(model.boundary.per_sample) // model.seq_len),
        tp_divisors=split_sizes(model),
    )


def describe(
    model: ModelDef, *, family: str, options: Mapping[str, OptionValue] | None = None
) -> ModelSpec:
    """The planner's `ModelSpec` of a declared (user) model: names and numbers only."""
    validate(model)
    per_token = max(1, math.prod(model.boundary.per_sample) // model.seq_len)
    # The spec's hidden size only feeds the planner's activation estimate; round it to a
    # multiple of the head count, as the spec requires.
    hidden = -(-per_token // model.num_heads) * model.num_heads
    return ModelSpec(
        name=model.name,
        num_layers=len(model.blocks),
        hidden_size=hidden,
        num_heads=model.num_heads,
        vocab_size=model.vocab_size,
        seq_len=model.seq_len,
        family=family,
        options=tuple((options or {}).items()),
        units=model.unit_names,
        first_units=len(model.first),
        last_units=len(model.last),
        numbers=model_numbers(model),
    )


def check_matches(model: ModelDef, spec: ModelSpec) -> None:
    """A built definition must have the units and sizes its spec promised."""
    if model.unit_names != spec.units:
        raise ContractError(
            f"model {spec.name!r}: the definition's units differ from the spec's "
            f"({len(model.unit_names)} vs {len(spec.units)} units)"
        )
    if (model.vocab_size, model.seq_len) != (spec.vocab_size, spec.seq_len):
        raise ContractError(
            f"model {spec.name!r}: the definition has vocab_size {model.vocab_size} and "
            f"seq_len {model.seq_len}; the spec says {spec.vocab_size} and {spec.seq_len}"
        )


@dataclass(frozen=True)
class DropoutKey:
    """Where a forward pass is: dropout masks depend on these only (never on the rank)."""

    seed: int
    step: int
    first_sample: int  # global index of the micro-batch's first sample
    p: float


def init_key(unit: str, param: Param) -> tuple[str, str]:
    """Whose generator initialises `param`: a tied parameter starts as its original."""
    if param.tied_to is None:
        return unit, param.name
    u, _, n = param.tied_to.partition("/")
    return u, n


def init_whole(seed: int, unit: str, param: Param) -> torch.Tensor:
    """The whole tensor of a freshly initialised parameter (float32, CPU)."""
    if param.init.kind == "ones":
        return torch.ones(param.shape)
    if param.init.kind == "zeros":
        return torch.zeros(param.shape)
    u, n = init_key(unit, param)
    gen = torch.Generator().manual_seed(stable_int("init", seed, u, n))
    return torch.randn(param.shape, generator=gen) * param.init.std


def shard(whole: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    if dim is None or tp_size == 1:
        return whole.clone()
    return whole.chunk(tp_size, dim=dim)[tp_rank].clone()


def init_unit(unit: Unit, seed: int, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """This tp rank's slices of a freshly initialised unit."""
    return {
        p.name: shard(init_whole(seed, unit.name, p), p.shard_dim, tp_rank, tp_size)
        for p in unit.params
    }


def slice_shape(shape: tuple[int, ...], dim: int | None, tp_size: int) -> tuple[int, ...]:
    if dim is None:
        return shape
    return tuple(n // tp_size if i == dim else n for i, n in enumerate(shape))
