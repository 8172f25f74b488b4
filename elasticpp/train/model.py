"""The GPT-style model as units of plain tensors, with Megatron-style tensor parallelism.

A stage holds a dict `unit -> name -> tensor` (units as in `checkpoint.manifest`:
`embed`, `block.NNNN`, `head`). Forward functions are functional over those dicts, so
the state a piece stores is exactly what the stage trains, with no module tree to map.

Tensor parallelism (t ranks): Q, K and V are separate column-parallel weights split by
heads (a slice is one contiguous chunk of rows), the attention output projection and the
MLP's fc2 are row-parallel, fc1 is column-parallel. Each block does one all-reduce per
sub-layer per pass (f/g in `parallel`). The embedding and the LM head are replicated
across TP ranks (the byte vocabulary has 256 entries: splitting it saves nothing), and so
are LayerNorms and the biases of row-parallel layers (they are added after the reduce).

Initialisation is layout independent: every tensor is drawn WHOLE from a generator seeded
by a stable hash of (seed, unit, name), then sliced for the tp rank. Dropout masks are
drawn per (seed, step, global sample, unit, site) on replicated activations, so they are
the same whatever rank computes the sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from elasticpp.checkpoint.manifest import UNIT_EMBED, UNIT_HEAD, block_unit
from elasticpp.plan import ModelSpec
from elasticpp.train.data import stable_int
from elasticpp.train.parallel import copy_to_tp, reduce_from_tp

INIT_STD = 0.02


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]  # the whole tensor's shape
    shard_dim: int | None  # split across tp ranks along this dim; None = replicated
    init: str  # "normal", "zeros" or "ones"
    std: float = INIT_STD

    @property
    def decay(self) -> bool:
        return len(self.shape) >= 2


def unit_param_specs(model: ModelSpec, unit: str) -> list[ParamSpec]:
    """The parameters of one unit, in a fixed order."""
    H, F_, V, S = model.hidden_size, model.ffn_hidden_size, model.vocab_size, model.seq_len
    if unit == UNIT_EMBED:
        return [
            ParamSpec("tok.weight", (V, H), None, "normal"),
            ParamSpec("pos.weight", (S, H), None, "normal"),
        ]
    if unit == UNIT_HEAD:
        return [
            ParamSpec("ln_f.weight", (H,), None, "ones"),
            ParamSpec("ln_f.bias", (H,), None, "zeros"),
            ParamSpec("lm_head.weight", (V, H), None, "normal"),
        ]
    # GPT-2's scaled init of the projections that feed the residual stream.
    resid_std = INIT_STD / math.sqrt(2 * model.num_layers)
    specs = [
        ParamSpec("ln1.weight", (H,), None, "ones"),
        ParamSpec("ln1.bias", (H,), None, "zeros"),
    ]
    for qkv in ("q", "k", "v"):
        specs.append(ParamSpec(f"attn.{qkv}.weight", (H, H), 0, "normal"))
        specs.append(ParamSpec(f"attn.{qkv}.bias", (H,), 0, "zeros"))
    specs += [
        ParamSpec("attn.o.weight", (H, H), 1, "normal", resid_std),
        ParamSpec("attn.o.bias", (H,), None, "zeros"),
        ParamSpec("ln2.weight", (H,), None, "ones"),
        ParamSpec("ln2.bias", (H,), None, "zeros"),
        ParamSpec("mlp.fc1.weight", (F_, H), 0, "normal"),
        ParamSpec("mlp.fc1.bias", (F_,), 0, "zeros"),
        ParamSpec("mlp.fc2.weight", (H, F_), 1, "normal", resid_std),
        ParamSpec("mlp.fc2.bias", (H,), None, "zeros"),
    ]
    return specs


def init_unit(
    model: ModelSpec, unit: str, seed: int, tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """This tp rank's slices of a freshly initialised unit (float32, CPU)."""
    out: dict[str, torch.Tensor] = {}
    for spec in unit_param_specs(model, unit):
        if spec.init == "ones":
            whole = torch.ones(spec.shape)
        elif spec.init == "zeros":
            whole = torch.zeros(spec.shape)
        else:
            gen = torch.Generator().manual_seed(stable_int("init", seed, unit, spec.name))
            whole = torch.randn(spec.shape, generator=gen) * spec.std
        out[spec.name] = shard(whole, spec.shard_dim, tp_rank, tp_size)
    return out


def shard(whole: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    if dim is None or tp_size == 1:
        return whole.clone()
    return whole.chunk(tp_size, dim=dim)[tp_rank].clone()


@dataclass(frozen=True)
class DropoutKey:
    """Where a forward pass is: dropout masks depend on these only (never on the rank)."""

    seed: int
    step: int
    first_sample: int  # global index of the micro-batch's first sample
    p: float


def _dropout(x: torch.Tensor, key: DropoutKey | None, unit: str, site: str) -> torch.Tensor:
    if key is None or key.p == 0.0:
        return x
    masks = []
    for i in range(x.shape[0]):
        gen = torch.Generator().manual_seed(
            stable_int("dropout", key.seed, key.step, key.first_sample + i, unit, site)
        )
        masks.append(torch.rand(x.shape[1:], generator=gen) >= key.p)
    mask = torch.stack(masks).to(x.device)
    return x * mask / (1.0 - key.p)


def embed_forward(
    params: dict[str, torch.Tensor], tokens: torch.Tensor, key: DropoutKey | None
) -> torch.Tensor:
    seq = tokens.shape[1]
    x = F.embedding(tokens, params["tok.weight"]) + params["pos.weight"][:seq]
    return _dropout(x, key, UNIT_EMBED, "embed")


def block_forward(
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    unit: str,
    head_dim: int,
    tp_group: Any,
    key: DropoutKey | None,
) -> torch.Tensor:
    b, s, _ = x.shape
    h = F.layer_norm(x, x.shape[-1:], params["ln1.weight"], params["ln1.bias"])
    h = copy_to_tp(h, tp_group)

    def heads(name: str) -> torch.Tensor:
        y = F.linear(h, params[f"attn.{name}.weight"], params[f"attn.{name}.bias"])
        return y.view(b, s, -1, head_dim).transpose(1, 2)

    a = F.scaled_dot_product_attention(heads("q"), heads("k"), heads("v"), is_causal=True)
    a = a.transpose(1, 2).reshape(b, s, -1)
    o = reduce_from_tp(F.linear(a, params["attn.o.weight"]), tp_group) + params["attn.o.bias"]
    x = x + _dropout(o, key, unit, "attn")

    h = F.layer_norm(x, x.shape[-1:], params["ln2.weight"], params["ln2.bias"])
    h = copy_to_tp(h, tp_group)
    h = F.gelu(F.linear(h, params["mlp.fc1.weight"], params["mlp.fc1.bias"]))
    o = reduce_from_tp(F.linear(h, params["mlp.fc2.weight"]), tp_group) + params["mlp.fc2.bias"]
    return x + _dropout(o, key, unit, "mlp")


def head_loss_sum(
    params: dict[str, torch.Tensor], x: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Σ over the micro-batch of per-sample losses (mean token cross-entropy per sample)."""
    h = F.layer_norm(x, x.shape[-1:], params["ln_f.weight"], params["ln_f.bias"])
    logits = F.linear(h, params["lm_head.weight"])
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return per_token.view(targets.shape).mean(dim=1).sum()


@dataclass(frozen=True)
class StageModel:
    """The units one pipeline stage holds, and its forward pass."""

    model: ModelSpec
    units: tuple[str, ...]
    first_block: int
    end_block: int
    has_embed: bool
    has_head: bool
    # Full activation recomputation: keep only each block's input and run the block's forward
    # again in the backward pass. Dropout masks are keyed by sample, so the re-run is exact.
    recompute: bool = False

    @classmethod
    def for_stage(
        cls,
        model: ModelSpec,
        stages: tuple[tuple[int, int], ...],
        pp: int,
        recompute: bool = False,
    ) -> StageModel:
        first, end = stages[pp]
        units = [block_unit(i) for i in range(first, end)]
        has_embed, has_head = pp == 0, pp == len(stages) - 1
        if has_embed:
            units.insert(0, UNIT_EMBED)
        if has_head:
            units.append(UNIT_HEAD)
        return cls(model, tuple(units), first, end, has_embed, has_head, recompute)

    def forward(
        self,
        params: dict[str, dict[str, torch.Tensor]],
        x: torch.Tensor,
        tp_group: Any,
        key: DropoutKey | None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens (first stage) or activations in; activations or the loss sum out."""
        if self.has_embed:
            x = embed_forward(params[UNIT_EMBED], x, key)
        for i in range(self.first_block, self.end_block):
            unit = block_unit(i)
            args = (params[unit], x, unit, self.model.head_dim, tp_group, key)
            if self.recompute and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block_forward, *args, use_reentrant=False)
            else:
                x = block_forward(*args)
        if self.has_head:
            if targets is None:
                raise ValueError("the last stage needs targets")
            return head_loss_sum(params[UNIT_HEAD], x, targets)
        return x
