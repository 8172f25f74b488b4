"""The `llama` family: a Llama-style decoder on the model contract, weight-compatible with
Hugging Face's `LlamaForCausalLM` (tested against `transformers` itself).

Units: `embed` (token embedding), `block.NNNN` (RMSNorm, attention with rotary position
embeddings and grouped-query attention, RMSNorm, SwiGLU MLP; no biases), `head` (RMSNorm and
LM head). Q, K and V are COLUMN-split by heads (tensor parallelism must divide both the query
heads and the key/value heads: every rank then holds `num_kv_heads / t` key/value heads
and the `num_heads / t` query heads that use them), the attention output and the MLP's down
projection are ROW-split, gate and up are COLUMN-split.

Options:
- `rope_theta`: the base of the rotary frequencies, default 10000.0;
- `norm_eps`: RMSNorm epsilon, default 1e-5;
- `tie_embeddings`: the LM head shares the token embedding, default false;
- `vocab_parallel`: split the embedding and the LM head along the vocabulary, default false;
- `max_positions`: the longest sequence the weights were trained for (kept for export; the
  rotary embedding itself has no table), default `seq_len`.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch
import torch.nn.functional as F

from elasticpp.plan.specs import UNIT_EMBED, UNIT_HEAD, ModelSpec, block_unit
from elasticpp.train.contract import (
    ONES,
    ModelDef,
    Param,
    Split,
    Unit,
    UnitContext,
    normal,
)
from elasticpp.train.families import (
    INIT_STD,
    check_options,
    decoder,
    lm_head_param,
    option_float,
    to_vocab,
    vocab_split,
)

OPTIONS: dict[str, type | tuple[type, ...]] = {
    "rope_theta": (int, float),
    "norm_eps": (int, float),
    "tie_embeddings": bool,
    "vocab_parallel": bool,
    "max_positions": int,
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotary(seq: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """cos and sin `[2, seq, head_dim]` of the rotary embedding (halves, not interleaved)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    pos = torch.arange(seq, device=device).float()
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos(), emb.sin()))


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_sin[0], cos_sin[1]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def embed_forward(
    ctx: UnitContext, p: Mapping[str, torch.Tensor], tokens: torch.Tensor
) -> torch.Tensor:
    return ctx.dropout(ctx.embedding(tokens, p["tok.weight"]), "embed")


def block_forward(
    ctx: UnitContext,
    p: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    *,
    head_dim: int,
    group_size: int,
    theta: float,
    eps: float,
) -> torch.Tensor:
    b, s, _ = x.shape
    cos_sin = rotary(s, head_dim, theta, x.device).to(x.dtype)
    h = ctx.copy_to_tp(rms_norm(x, p["attn_norm.weight"], eps))

    def heads(name: str) -> torch.Tensor:
        return F.linear(h, p[f"attn.{name}.weight"]).view(b, s, -1, head_dim).transpose(1, 2)

    q = apply_rotary(heads("q"), cos_sin)
    k = apply_rotary(heads("k"), cos_sin)
    v = heads("v")
    if group_size > 1:  # each key/value head serves `group_size` consecutive query heads
        k = k.repeat_interleave(group_size, dim=1)
        v = v.repeat_interleave(group_size, dim=1)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    a = a.transpose(1, 2).reshape(b, s, -1)
    x = x + ctx.dropout(ctx.reduce_from_tp(F.linear(a, p["attn.o.weight"])), "attn")

    h = ctx.copy_to_tp(rms_norm(x, p["mlp_norm.weight"], eps))
    h = F.silu(F.linear(h, p["mlp.gate.weight"])) * F.linear(h, p["mlp.up.weight"])
    return x + ctx.dropout(ctx.reduce_from_tp(F.linear(h, p["mlp.down.weight"])), "mlp")


def head_forward(
    ctx: UnitContext, p: Mapping[str, torch.Tensor], x: torch.Tensor, *, eps: float
) -> torch.Tensor:
    return to_vocab(ctx, rms_norm(x, p["norm.weight"], eps), p["lm_head.weight"])


def build(spec: ModelSpec) -> ModelDef:
    opts = spec.option_map
    check_options("llama", opts, OPTIONS)
    theta = option_float(opts, "rope_theta", 10000.0)
    eps = option_float(opts, "norm_eps", 1e-5)
    vocab = vocab_split(opts)
    H, F_, V, S = spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size, spec.seq_len
    hd, nh, nkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    std = normal(INIT_STD)
    embed = Unit(UNIT_EMBED, (Param("tok.weight", (V, H), vocab, std),), embed_forward)
    block_params = (
        Param("attn_norm.weight", (H,), init=ONES),
        Param("attn.q.weight", (nh * hd, H), Split.COLUMN, std),
        Param("attn.k.weight", (nkv * hd, H), Split.COLUMN, std),
        Param("attn.v.weight", (nkv * hd, H), Split.COLUMN, std),
        Param("attn.o.weight", (H, nh * hd), Split.ROW, std),
        Param("mlp_norm.weight", (H,), init=ONES),
        Param("mlp.gate.weight", (F_, H), Split.COLUMN, std),
        Param("mlp.up.weight", (F_, H), Split.COLUMN, std),
        Param("mlp.down.weight", (H, F_), Split.ROW, std),
    )
    forward = partial(block_forward, head_dim=hd, group_size=nh // nkv, theta=theta, eps=eps)
    flops = 2.0 * (2 * H * nh * hd + 2 * H * nkv * hd + 3 * H * F_) + 4.0 * S * H
    blocks = tuple(
        Unit(block_unit(i), block_params, forward, flops) for i in range(spec.num_layers)
    )
    head = Unit(
        UNIT_HEAD,
        (
            Param("norm.weight", (H,), init=ONES),
            lm_head_param(spec),
        ),
        partial(head_forward, eps=eps),
    )
    return decoder(spec, embed, blocks, head, tp_divisors=(nkv,))
