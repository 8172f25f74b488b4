"""A user model on elasticpp's model contract: a byte-level causal-convolution network (no
attention), complete and runnable.

    elasticpp train --model byte_conv:build --model-option depth=4 --layout pp=2,tp=2,dp=1

with this directory on PYTHONPATH (every node of an elastic job needs it there too). The
function takes the model options (JSON scalars from `--model-option` or the job spec's
`model_options:`) and returns a `ModelDef`; elasticpp checks the declaration before any
worker starts, plans its layout from the declared sizes, and trains it under any (p, t, d).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from elasticpp.train.model.contract import (
    ONES,
    ZEROS,
    Boundary,
    ModelDef,
    Param,
    Split,
    Unit,
    UnitContext,
    normal,
)


def embed(ctx: UnitContext, p: Mapping[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    # `ctx.embedding` handles a vocabulary split across tensor-parallel ranks.
    return ctx.embedding(tokens, p["tok"])


def mix(
    ctx: UnitContext, p: Mapping[str, torch.Tensor], x: torch.Tensor, *, kernel: int
) -> torch.Tensor:
    # A causal depthwise convolution over time (replicated: every tp rank computes it) ...
    h = x * p["scale"]
    h = F.pad(h.transpose(1, 2), (kernel - 1, 0))
    h = F.conv1d(h, p["conv"].unsqueeze(1), groups=x.shape[-1]).transpose(1, 2)
    # ... then an MLP split Megatron-style: column-parallel in, row-parallel out.
    h = ctx.copy_to_tp(h)
    h = F.gelu(F.linear(h, p["w_in"], p["b_in"]))
    out = ctx.reduce_from_tp(F.linear(h, p["w_out"])) + p["b_out"]
    return x + ctx.dropout(out, "mlp")  # dropout keyed by sample, never by rank


def readout(ctx: UnitContext, p: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = ctx.copy_to_tp(F.layer_norm(x, x.shape[-1:], p["norm"]))
    return F.linear(h, p["head"])  # this rank's vocabulary slice of the logits


def build(options: dict[str, Any]) -> ModelDef:
    width = int(options.get("width", 32))
    depth = int(options.get("depth", 4))
    kernel = int(options.get("kernel", 4))
    seq = int(options.get("seq_len", 32))
    vocab = 256  # bytes
    std = normal(0.02)
    first = Unit("embed", (Param("tok", (vocab, width), Split.VOCAB, std),), embed)
    blocks = tuple(
        Unit(
            f"mix.{i}",
            (
                Param("scale", (width,), init=ONES),
                Param("conv", (width, kernel), init=normal(0.3)),
                Param("w_in", (2 * width, width), Split.COLUMN, std),
                Param("b_in", (2 * width,), Split.COLUMN, ZEROS),
                Param("w_out", (width, 2 * width), Split.ROW, std),
                Param("b_out", (width,), init=ZEROS),
            ),
            partial(mix, kernel=kernel),
        )
        for i in range(depth)
    )
    last = Unit(
        "readout",
        (Param("norm", (width,), init=ONES), Param("head", (vocab, width), Split.VOCAB, std)),
        readout,
    )
    return ModelDef(
        name="byte-conv",
        first=(first,),
        blocks=blocks,
        last=(last,),
        boundary=Boundary((seq, width)),  # what one sample sends from stage to stage
        vocab_size=vocab,
        seq_len=seq,
    )
