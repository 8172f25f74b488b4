"""The `llama` family: a Llama-style decoder on the model contract, weight-compatible with
Hugging Face's `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` and
`Qwen3ForCausalLM` (each tested against `transformers` itself).

Units: `embed` (token embedding), `block.NNNN` (RMSNorm, attention with rotary position
embeddings and grouped-query attention, RMSNorm, SwiGLU MLP), `head` (RMSNorm and LM head).
Q, K and V are COLUMN-split by heads (tensor parallelism must divide both the query heads and
the key/value heads: every rank then holds `num_kv_heads / t` key/value heads and the
`num_heads / t` query heads that use them), and so are their biases; the attention output and
the MLP's down projection are ROW-split (the output bias is replicated, added after the
reduce), gate and up are COLUMN-split. The per-head q/k norms of `qk_norm` act on one head's
`head_dim` values, so every rank holds them whole.

Attention is full causal attention over the sequence: a sliding window is accepted only where
it is at least `seq_len` long, which is exactly full causal attention.

Options:
- `rope_theta`: the base of the rotary frequencies, default 10000.0;
- `norm_eps`: RMSNorm epsilon, default 1e-5;
- `tie_embeddings`: the LM head shares the token embedding, default false;
- `vocab_parallel`: split the embedding and the LM head along the vocabulary, default false;
- `max_positions`: the longest sequence the weights were trained for (kept for export; the
  rotary embedding itself has no table), default `seq_len`;
- `head_dim`: the width of one attention head, default `hidden_size / num_heads` (Qwen3 and
  some Mistral models choose another);
- `rope_type`: `default` or `llama3` (Llama 3.1's frequency-dependent scaling, with
  `rope_factor`, `rope_low_freq_factor`, `rope_high_freq_factor` and
  `rope_original_max_positions`, all required with it);
- `qkv_bias`: Q, K and V have biases (Qwen2), default false; `o_bias`: the attention output
  has one too (`attention_bias` of Llama and Qwen3), default false;
- `qk_norm`: RMSNorm on every query and key head before the rotation (Qwen3), default false;
- `sliding_window`: the attention window of the weights; refused when shorter than `seq_len`;
- `hf_model_type`: the Hugging Face architecture to export to (`llama`, `mistral`, `qwen2`,
  `qwen3`), default `llama`; it does not change the math.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from elasticpp.plan.flops import forward_flops
from elasticpp.plan.specs import UNIT_EMBED, UNIT_HEAD, ModelSpec, OptionValue, block_unit
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
    "rope_theta": (int, float),
    "norm_eps": (int, float),
    "tie_embeddings": bool,
    "vocab_parallel": bool,
    "max_positions": int,
    "head_dim": int,
    "rope_type": str,
    "rope_factor": (int, float),
    "rope_low_freq_factor": (int, float),
    "rope_high_freq_factor": (int, float),
    "rope_original_max_positions": int,
    "qkv_bias": bool,
    "o_bias": bool,
    "qk_norm": bool,
    "sliding_window": int,
    "hf_model_type": str,
}
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = (
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_positions",
)


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's rotary scaling: wavelengths longer than `original / low` are stretched by
    `factor`, shorter than `original / high` kept, and those between blended smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    def __post_init__(self) -> None:
        if not self.high_freq_factor > self.low_freq_factor:
            raise ContractError(
                "llama: rope_high_freq_factor must be greater than rope_low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def inverse_frequencies(
    head_dim: int, theta: float, scaling: Llama3Scaling | None, device: torch.device
) -> torch.Tensor:
    """The rotary embedding's `head_dim / 2` angular frequencies (float32, as `transformers`
    computes them, so that the rotations agree to the last bits that matter)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    old = scaling.original_max_positions
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    stretched = inv_freq / scaling.factor
    # 0 at the long-wavelength edge of the band (fully stretched), 1 at the short one (kept).
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * stretched + smooth * inv_freq
    out = torch.where(wavelen > old / low, stretched, inv_freq)
    in_band = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(in_band, blended, out)


def rotary(
    seq: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    scaling: Llama3Scaling | None = None,
) -> torch.Tensor:
    """cos and sin `[2, seq, head_dim]` of the rotary embedding (halves, not interleaved)."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling, device)
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
    scaling: Llama3Scaling | None = None,
    qk_norm: bool = False,
) -> torch.Tensor:
    b, s, _ = x.shape
    cos_sin = rotary(s, head_dim, theta, x.device, scaling).to(x.dtype)
    h = ctx.copy_to_tp(rms_norm(x, p["attn_norm.weight"], eps))

    def heads(name: str) -> torch.Tensor:
        y = F.linear(h, p[f"attn.{name}.weight"], p.get(f"attn.{name}.bias"))
        y = y.view(b, s, -1, head_dim)
        if qk_norm and name in ("q", "k"):  # per head, before the rotation (Qwen3)
            # Replicated weight on this rank's heads only: copy_to_tp sums its gradient
            # over the tp group, so every rank holds the whole gradient, as for a norm
            # before a COLUMN split.
            y = rms_norm(y, ctx.copy_to_tp(p[f"attn.{name}_norm.weight"]), eps)
        return y.transpose(1, 2)

    q = apply_rotary(heads("q"), cos_sin)
    k = apply_rotary(heads("k"), cos_sin)
    v = heads("v")
    if group_size > 1:  # each key/value head serves `group_size` consecutive query heads
        k = k.repeat_interleave(group_size, dim=1)
        v = v.repeat_interleave(group_size, dim=1)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    a = a.transpose(1, 2).reshape(b, s, -1)
    o = ctx.reduce_from_tp(F.linear(a, p["attn.o.weight"]))
    if "attn.o.bias" in p:  # replicated: added once, after the reduce
        o = o + p["attn.o.bias"]
    x = x + ctx.dropout(o, "attn")

    h = ctx.copy_to_tp(rms_norm(x, p["mlp_norm.weight"], eps))
    h = F.silu(F.linear(h, p["mlp.gate.weight"])) * F.linear(h, p["mlp.up.weight"])
    return x + ctx.dropout(ctx.reduce_from_tp(F.linear(h, p["mlp.down.weight"])), "mlp")


def head_forward(
    ctx: UnitContext, p: Mapping[str, torch.Tensor], x: torch.Tensor, *, eps: float
) -> torch.Tensor:
    return to_vocab(ctx, rms_norm(x, p["norm.weight"], eps), p["lm_head.weight"])


def _positive_int(opts: Mapping[str, OptionValue], key: str, default: int) -> int:
    value = opts.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ContractError(f"llama: option {key} must be a positive integer, got {value!r}")
    return value


def rope_scaling(opts: Mapping[str, OptionValue]) -> Llama3Scaling | None:
    """The rotary scaling the options ask for; its parameters only with `rope_type: llama3`."""
    kind = opts.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ContractError(f"llama: option rope_type must be one of {ROPE_TYPES}, got {kind!r}")
    given = [k for k in _LLAMA3_KEYS if k in opts]
    if kind == "default":
        if given:
            raise ContractError(f"llama: option(s) {', '.join(given)} need rope_type llama3")
        return None
    missing = [k for k in _LLAMA3_KEYS if k not in opts]
    if missing:
        raise ContractError(f"llama: rope_type llama3 needs option(s) {', '.join(missing)}")
    return Llama3Scaling(
        factor=option_float(opts, "rope_factor", 1.0),
        low_freq_factor=option_float(opts, "rope_low_freq_factor", 1.0),
        high_freq_factor=option_float(opts, "rope_high_freq_factor", 1.0),
        original_max_positions=_positive_int(opts, "rope_original_max_positions", 1),
    )


def build(spec: ModelSpec) -> ModelDef:
    opts = spec.option_map
    check_options("llama", opts, OPTIONS)
    theta = option_float(opts, "rope_theta", 10000.0)
    eps = option_float(opts, "norm_eps", 1e-5)
    scaling = rope_scaling(opts)
    if opts.get("hf_model_type", "llama") not in HF_MODEL_TYPES:
        raise ContractError(
            f"llama: option hf_model_type must be one of {HF_MODEL_TYPES}, "
            f"got {opts['hf_model_type']!r}"
        )
    window = opts.get("sliding_window")
    if window is not None and _positive_int(opts, "sliding_window", 1) < spec.seq_len:
        raise ContractError(
            f"llama: option sliding_window {window} is shorter than seq_len {spec.seq_len}: "
            "only full causal attention is implemented (a window >= seq_len is exactly that)"
        )
    qkv_bias, o_bias = bool(opts.get("qkv_bias", False)), bool(opts.get("o_bias", False))
    qk_norm = bool(opts.get("qk_norm", False))
    vocab = vocab_split(opts)
    H, F_, V = spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size
    hd = _positive_int(opts, "head_dim", spec.head_dim)
    if hd % 2:
        raise ContractError(f"llama: option head_dim must be even (rotary pairs), got {hd}")
    nh, nkv = spec.num_heads, spec.num_kv_heads
    std = normal(INIT_STD)
    embed = Unit(UNIT_EMBED, (Param("tok.weight", (V, H), vocab, std),), embed_forward)
    attn: list[Param] = [Param("attn_norm.weight", (H,), init=ONES)]
    for name, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
        attn.append(Param(f"attn.{name}.weight", (rows, H), Split.COLUMN, std))
        if qkv_bias:
            attn.append(Param(f"attn.{name}.bias", (rows,), Split.COLUMN, ZEROS))
    if qk_norm:
        attn += [Param("attn.q_norm.weight", (hd,), init=ONES)]
        attn += [Param("attn.k_norm.weight", (hd,), init=ONES)]
    attn.append(Param("attn.o.weight", (H, nh * hd), Split.ROW, std))
    if o_bias:
        attn.append(Param("attn.o.bias", (H,), init=ZEROS))
    block_params = (
        *attn,
        Param("mlp_norm.weight", (H,), init=ONES),
        Param("mlp.gate.weight", (F_, H), Split.COLUMN, std),
        Param("mlp.up.weight", (F_, H), Split.COLUMN, std),
        Param("mlp.down.weight", (H, F_), Split.ROW, std),
    )
    forward = partial(
        block_forward,
        head_dim=hd,
        group_size=nh // nkv,
        theta=theta,
        eps=eps,
        scaling=scaling,
        qk_norm=qk_norm,
    )
    # The planner's forward FLOPs of a block (elasticpp.plan.flops, attention at full width).
    flops = forward_flops(spec, attention_computed=1.0).block
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
