"""The `gpt` family: a GPT-2-style decoder on the model contract.

Units: `embed` (token and learned position embeddings), `block.NNNN` (pre-LayerNorm
attention and GELU MLP, with biases), `head` (final LayerNorm and LM head). Q, K and V are
separate COLUMN-split weights (a slice is a contiguous run of heads), the attention output
projection and fc2 are ROW-split, fc1 is COLUMN-split; LayerNorms and the biases of
ROW-split layers are replicated (added after the reduce).

Options (the defaults train today's curves exactly):
- `gelu`: `exact` (default) or `tanh` (GPT-2's approximation);
- `tie_embeddings`: the LM head shares the token embedding (GPT-2), default false;
- `vocab_parallel`: split the embedding and the LM head along the vocabulary across tp
  ranks (default false: with a small vocabulary splitting saves nothing);
- `norm_eps`: LayerNorm epsilon, default 1e-5;
- `max_positions`: rows of the position table, default `seq_len` (a Hugging Face GPT-2
  keeps its `n_positions` rows when it trains on shorter sequences).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial

import torch
import torch.nn.functional as F

from elasticpp.plan.flops import forward_flops
from elasticpp.plan.specs import UNIT_EMBED, UNIT_HEAD, ModelSpec, block_unit
from elasticpp.train.model.contract import (
    ONES,
    ZEROS,
    ContractError,
    ModelDef,
    Param,
    Split,
    Unit,
    UnitContext,
    normal,
)
from elasticpp.train.model.families import (
    INIT_STD,
    check_options,
    decoder,
    lm_head_param,
    option_float,
    to_vocab,
    vocab_split,
)

OPTIONS: dict[str, type | tuple[type, ...]] = {
    "gelu": str,
    "tie_embeddings": bool,
    "vocab_parallel": bool,
    "norm_eps": (int, float),
    "max_positions": int,
}


def embed_forward(
    ctx: UnitContext, p: Mapping[str, torch.Tensor], tokens: torch.Tensor
) -> torch.Tensor:
    seq = tokens.shape[1]
    x = ctx.embedding(tokens, p["tok.weight"]) + p["pos.weight"][:seq]
    return ctx.dropout(x, "embed")


def block_forward(
    ctx: UnitContext,
    p: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    *,
    head_dim: int,
    eps: float,
    approximate: str,
) -> torch.Tensor:
    b, s, _ = x.shape
    h = F.layer_norm(x, x.shape[-1:], p["ln1.weight"], p["ln1.bias"], eps)
    h = ctx.copy_to_tp(h)

    def heads(name: str) -> torch.Tensor:
        y = F.linear(h, p[f"attn.{name}.weight"], p[f"attn.{name}.bias"])
        return y.view(b, s, -1, head_dim).transpose(1, 2)

    a = F.scaled_dot_product_attention(heads("q"), heads("k"), heads("v"), is_causal=True)
    a = a.transpose(1, 2).reshape(b, s, -1)
    o = ctx.reduce_from_tp(F.linear(a, p["attn.o.weight"])) + p["attn.o.bias"]
    x = x + ctx.dropout(o, "attn")

    h = F.layer_norm(x, x.shape[-1:], p["ln2.weight"], p["ln2.bias"], eps)
    h = ctx.copy_to_tp(h)
    h = F.gelu(F.linear(h, p["mlp.fc1.weight"], p["mlp.fc1.bias"]), approximate=approximate)
    o = ctx.reduce_from_tp(F.linear(h, p["mlp.fc2.weight"])) + p["mlp.fc2.bias"]
    return x + ctx.dropout(o, "mlp")


def head_forward(
    ctx: UnitContext, p: Mapping[str, torch.Tensor], x: torch.Tensor, *, eps: float
) -> torch.Tensor:
    h = F.layer_norm(x, x.shape[-1:], p["ln_f.weight"], p["ln_f.bias"], eps)
    return to_vocab(ctx, h, p["lm_head.weight"])


def build(spec: ModelSpec) -> ModelDef:
    opts = spec.option_map
    check_options("gpt", opts, OPTIONS)
    approximate = {"exact": "none", "tanh": "tanh"}.get(str(opts.get("gelu", "exact")))
    if approximate is None:
        raise ContractError(f"gpt: option gelu must be exact or tanh, got {opts['gelu']!r}")
    vocab = vocab_split(opts)
    eps = option_float(opts, "norm_eps", 1e-5)
    if spec.num_kv_heads != spec.num_heads:
        raise ContractError("gpt: grouped-query attention (num_kv_heads) is a llama option")
    H, F_, V, S = spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size, spec.seq_len
    positions = opts.get("max_positions", S)
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < S:
        raise ContractError(f"gpt: option max_positions must be an integer >= seq_len {S}")
    std = normal(INIT_STD)
    # GPT-2's scaled init of the projections that feed the residual stream.
    resid = normal(INIT_STD / math.sqrt(2 * spec.num_layers))
    embed = Unit(
        UNIT_EMBED,
        (Param("tok.weight", (V, H), vocab, std), Param("pos.weight", (positions, H), init=std)),
        embed_forward,
    )
    block_params: list[Param] = [
        Param("ln1.weight", (H,), init=ONES),
        Param("ln1.bias", (H,), init=ZEROS),
    ]
    for qkv in ("q", "k", "v"):
        block_params.append(Param(f"attn.{qkv}.weight", (H, H), Split.COLUMN, std))
        block_params.append(Param(f"attn.{qkv}.bias", (H,), Split.COLUMN, ZEROS))
    block_params += [
        Param("attn.o.weight", (H, H), Split.ROW, resid),
        Param("attn.o.bias", (H,), init=ZEROS),
        Param("ln2.weight", (H,), init=ONES),
        Param("ln2.bias", (H,), init=ZEROS),
        Param("mlp.fc1.weight", (F_, H), Split.COLUMN, std),
        Param("mlp.fc1.bias", (F_,), Split.COLUMN, ZEROS),
        Param("mlp.fc2.weight", (H, F_), Split.ROW, resid),
        Param("mlp.fc2.bias", (H,), init=ZEROS),
    ]
    forward = partial(block_forward, head_dim=spec.head_dim, eps=eps, approximate=approximate)
    # The planner's forward FLOPs of a block: its matmuls and attention's scores and their
    # use at full width (elasticpp.plan.flops; MFU counts the causal half the kernel computes).
    flops = forward_flops(spec, attention_computed=1.0).block
    blocks = tuple(
        Unit(block_unit(i), tuple(block_params), forward, flops) for i in range(spec.num_layers)
    )
    head = Unit(
        UNIT_HEAD,
        (
            Param("ln_f.weight", (H,), init=ONES),
            Param("ln_f.bias", (H,), init=ZEROS),
            lm_head_param(spec),
        ),
        partial(head_forward, eps=eps),
    )
    return decoder(spec, embed, blocks, head)
