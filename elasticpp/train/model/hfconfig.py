"""Hugging Face model directories without torch: read a `config.json` into a `ModelSpec`,
write one back, list the safetensors files, and fingerprint a directory.

Kept free of torch so that `elasticpp plan --model DIR` and the agent's job-spec check stay
fast; the tensors themselves are `elasticpp.train.model.hf`'s.

- `spec_from_hf(dir)` reads `config.json` into a `ModelSpec` of the `llama` family (from
  `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`; what
  differs between them becomes family options) or the `gpt` family (from `GPT2LMHeadModel`);
  anything the family does not implement (another activation, MLP biases, rotary scaling
  other than Llama 3's, a sliding window shorter than the sequence, ...) is refused, naming
  the key, rather than trained wrongly. A Llama-shaped config with a key elasticpp does not
  know is refused too, naming it: an unknown key may change the math.
- `hf_config(spec)` writes the config back, for the architecture the spec came from.
- `fingerprint(dir)` identifies a model directory cheaply (config, weights index and
  safetensors headers: names, shapes, dtypes and sizes), so agents can refuse to train from
  files that differ.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.plan.specs import ModelSpec, OptionValue

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
# Hugging Face class -> how elasticpp reads it: the Llama-shaped ones all become the `llama`
# family (elasticpp.train.model.families.llama), told apart by `hf_model_type` for export.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GPT2LMHeadModel": "gpt",
}
ARCH_NAMES = {kind: arch for arch, kind in ARCHITECTURES.items()}


def is_hf_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG_NAME).is_file()


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _require(cfg: Mapping[str, Any], key: str, ok: bool, want: str, source: Path) -> None:
    if not ok:
        raise ConfigError(
            f"{source / CONFIG_NAME}: {key} = {cfg.get(key)!r} is not supported ({want})"
        )


def spec_from_hf(directory: str | Path, *, seq_len: int | None = None) -> ModelSpec:
    """The `ModelSpec` of a Hugging Face model directory; `seq_len` defaults to its
    maximum position count."""
    d = Path(directory)
    cfg = read_config(d)
    archs = cfg.get("architectures") or []
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if family is None:
        raise ConfigError(
            f"{d / CONFIG_NAME}: architectures {archs!r}: supported are {', '.join(ARCHITECTURES)}"
        )
    name = d.resolve().name.lower() or "hf-model"
    try:
        if family == "gpt":
            return _gpt2_spec(cfg, d, name, seq_len)
        return _llama_spec(cfg, d, name, seq_len, family)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{d / CONFIG_NAME}: missing or malformed key: {exc!r}") from exc


# Keys of a Llama-shaped config that do not change the math of training: bookkeeping,
# tokens' ids, inference switches and initialisation (the weights are given).
_HARMLESS = frozenset(
    {
        "_name_or_path", "architectures", "model_type", "transformers_version", "dtype",
        "torch_dtype", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
        "initializer_range", "id2label", "label2id", "output_attentions",
        "output_hidden_states", "return_dict", "problem_type", "chunk_size_feed_forward",
        "is_encoder_decoder", "tokenizer_class", "pretraining_tp",
    }
)  # fmt: skip
# Keys elasticpp reads (and checks) for every Llama-shaped architecture.
_LLAMA_SHAPED = frozenset(
    {
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
        "hidden_act", "head_dim", "rope_theta", "rope_parameters", "rope_scaling",
        "partial_rotary_factor", "original_max_position_embeddings", "tie_word_embeddings",
        "attention_dropout",
    }
)  # fmt: skip
# ... and those only some of them have.
_ARCH_KEYS = {
    "llama": frozenset({"attention_bias", "mlp_bias"}),
    "mistral": frozenset({"sliding_window"}),
    "qwen2": frozenset(
        {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
    ),
    "qwen3": frozenset(
        {
            "attention_bias",
            "use_sliding_window",
            "sliding_window",
            "max_window_layers",
            "layer_types",
        }
    ),
}
_ROPE_KEYS = frozenset(
    {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "low_freq_factor",
     "high_freq_factor", "original_max_position_embeddings"}
)  # fmt: skip
_LLAMA3_KEYS = {
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
}


def _rope_options(cfg: Mapping[str, Any], d: Path, positions: int) -> list[tuple[str, OptionValue]]:
    """The family options of the rotary embedding: `rope_parameters` (transformers 5) or
    the older `rope_scaling` and `rope_theta`; only the default and `llama3` kinds."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(key) or {}
    _require(cfg, key, isinstance(rope, dict), "a JSON object", d)
    older = cfg.get("rope_scaling") or {}
    if key == "rope_parameters" and older:  # both: they must not disagree
        same = isinstance(older, dict) and all(rope.get(k) == v for k, v in older.items())
        _require(cfg, "rope_scaling", same, "none, or what rope_parameters says", d)
    unknown = sorted(set(rope) - _ROPE_KEYS)
    _require(cfg, key, not unknown, f"unknown key(s) {', '.join(unknown)}", d)
    kind = rope.get("rope_type", rope.get("type", "default"))
    _require(cfg, key, kind in ("default", "llama3"), "rope_type default or llama3", d)
    for where, factor in (
        (f"{key}.partial_rotary_factor", rope.get("partial_rotary_factor")),
        ("partial_rotary_factor", cfg.get("partial_rotary_factor")),
    ):
        if factor not in (None, 1, 1.0):
            raise ConfigError(
                f"{d / CONFIG_NAME}: {where} = {factor!r} is not supported (1.0: every "
                "dimension of a head rotates)"
            )
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    out: list[tuple[str, OptionValue]] = [("rope_theta", theta)]
    if kind == "default":
        extra = sorted(set(rope) & {*_LLAMA3_KEYS, "original_max_position_embeddings"})
        _require(cfg, key, not extra, f"no {', '.join(extra)} without rope_type llama3", d)
        return out
    for hf_key, option in _LLAMA3_KEYS.items():
        if hf_key not in rope:
            raise ConfigError(f"{d / CONFIG_NAME}: {key}: rope_type llama3 needs {hf_key}")
        out.append((option, float(rope[hf_key])))
    # As transformers does: a top-level original_max_position_embeddings wins, then the
    # rope dict's, then max_position_embeddings.
    original = cfg.get(
        "original_max_position_embeddings",
        rope.get("original_max_position_embeddings", positions),
    )
    out += [("rope_type", "llama3"), ("rope_original_max_positions", int(original))]
    return out


def _window_options(
    cfg: Mapping[str, Any], d: Path, family: str, seq_len: int
) -> list[tuple[str, OptionValue]]:
    """A sliding attention window. elasticpp implements full causal attention, which a
    window of at least seq_len is exactly: Mistral's `sliding_window` (null: none) is kept
    when it is that long and refused when shorter; Qwen2/3's `use_sliding_window` (a window
    on the layers from `max_window_layers` on) is refused."""
    if family in ("qwen2", "qwen3"):
        types = cfg.get("layer_types") or []
        odd = sorted({str(t) for t in types if t not in ("full_attention", "sliding_attention")})
        _require(cfg, "layer_types", not odd, "full_attention or sliding_attention", d)
        use = cfg.get("use_sliding_window", False)
        _require(cfg, "use_sliding_window", use is False, "false: full causal attention", d)
        return []  # without use_sliding_window, transformers' sliding layers do not slide
    window = cfg.get("sliding_window")
    if window is None:
        return []
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ConfigError(f"{d / CONFIG_NAME}: sliding_window = {window!r}: not a positive integer")
    if window < seq_len:
        raise ConfigError(
            f"{d / CONFIG_NAME}: sliding_window = {window} is not supported for seq_len "
            f"{seq_len}: elasticpp trains full causal attention, which equals the window only "
            f"for seq_len <= {window} (choose a shorter seq_len)"
        )
    return [("sliding_window", window)]


def _llama_spec(
    cfg: Mapping[str, Any], d: Path, name: str, seq_len: int | None, arch: str
) -> ModelSpec:
    """Llama, Mistral, Qwen2 and Qwen3: one family, `llama`, with options for what differs."""
    unknown = sorted(set(cfg) - _HARMLESS - _LLAMA_SHAPED - _ARCH_KEYS[arch])
    if unknown:
        raise ConfigError(
            f"{d / CONFIG_NAME}: key(s) {', '.join(unknown)} are not supported for "
            f"{ARCH_NAMES[arch]} (elasticpp cannot tell that they leave the model unchanged)"
        )
    H, nh = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    _require(cfg, "hidden_act", cfg.get("hidden_act", "silu") == "silu", "silu", d)
    _require(cfg, "mlp_bias", not cfg.get("mlp_bias", False), "false", d)
    dropout = cfg.get("attention_dropout", 0.0)
    _require(cfg, "attention_dropout", dropout in (0, 0.0), "0 (dropout is a job setting)", d)
    bias = cfg.get("attention_bias", False)
    _require(cfg, "attention_bias", isinstance(bias, bool), "true or false", d)
    head_dim = int(cfg.get("head_dim") or H // nh)
    _require(cfg, "head_dim", head_dim > 0 and head_dim % 2 == 0, "an even number", d)
    positions = int(cfg.get("max_position_embeddings", 2048))
    seq = seq_len or positions
    options: list[tuple[str, OptionValue]] = [
        ("max_positions", positions),
        ("norm_eps", float(cfg.get("rms_norm_eps", 1e-6))),
        ("tie_embeddings", bool(cfg.get("tie_word_embeddings", False))),
        *_rope_options(cfg, d, positions),
        *_window_options(cfg, d, arch, seq),
    ]
    if head_dim != H // nh:
        options.append(("head_dim", head_dim))
    if arch == "qwen2" or bias:
        options.append(("qkv_bias", True))
    if bias:
        options.append(("o_bias", True))
    if arch == "qwen3":
        options.append(("qk_norm", True))
    if arch != "llama":
        options.append(("hf_model_type", arch))
    return ModelSpec(
        name=name,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=H,
        num_heads=nh,
        vocab_size=int(cfg["vocab_size"]),
        seq_len=seq,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_kv_heads=int(cfg.get("num_key_value_heads") or nh),
        family="llama",
        options=tuple(options),
    )


_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "exact"}


def _gpt2_spec(cfg: Mapping[str, Any], d: Path, name: str, seq_len: int | None) -> ModelSpec:
    act = cfg.get("activation_function", "gelu_new")
    _require(cfg, "activation_function", act in _GELU, ", ".join(_GELU), d)
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        _require(cfg, key, not cfg.get(key, False), "false", d)
    _require(cfg, "scale_attn_weights", cfg.get("scale_attn_weights", True), "true", d)
    H = int(cfg["n_embd"])
    positions = int(cfg["n_positions"])
    return ModelSpec(
        name=name,
        num_layers=int(cfg["n_layer"]),
        hidden_size=H,
        num_heads=int(cfg["n_head"]),
        vocab_size=int(cfg["vocab_size"]),
        seq_len=seq_len or positions,
        ffn_hidden_size=int(cfg.get("n_inner") or 4 * H),
        family="gpt",
        options=(
            ("gelu", _GELU[act]),
            ("max_positions", positions),
            ("norm_eps", float(cfg.get("layer_norm_epsilon", 1e-5))),
            ("tie_embeddings", bool(cfg.get("tie_word_embeddings", True))),
        ),
    )


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory (from its index when it has one)."""
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            names = sorted(
                set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: cannot read the weight map: {exc!r}") from exc
        files = [directory / n for n in names]
        for f in files:
            if f.parent != directory or not f.is_file():
                raise CheckpointError(f"{index}: names a missing or outside file {f.name!r}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{directory}: no *.safetensors weights (pickled weights are refused)"
        )
    return files


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The `config.json` of a spec of the `llama` or `gpt` family."""
    o = dict(spec.options)
    if spec.family == "llama":
        return _llama_config(spec)
    if spec.family == "gpt":
        gelu = {"tanh": "gelu_new", "exact": "gelu"}[str(o.get("gelu", "exact"))]
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": spec.hidden_size,
            "n_layer": spec.num_layers,
            "n_head": spec.num_heads,
            "n_inner": spec.ffn_hidden_size,
            "n_positions": o.get("max_positions", spec.seq_len),
            "vocab_size": spec.vocab_size,
            "layer_norm_epsilon": o.get("norm_eps", 1e-5),
            "activation_function": gelu,
            "tie_word_embeddings": bool(o.get("tie_embeddings", False)),
            "dtype": "float32",
        }
    raise ConfigError(
        f"model {spec.name!r}: only the llama and gpt families export to Hugging Face, "
        f"not {spec.family!r}"
    )


def _llama_config(spec: ModelSpec) -> dict[str, Any]:
    """The config of the Hugging Face class a `llama`-family spec came from (its
    `hf_model_type`), with every option that changes the math written back."""
    o = dict(spec.options)
    kind = str(o.get("hf_model_type", "llama"))
    theta = float(o.get("rope_theta", 10000.0))  # type: ignore[arg-type]
    rope: dict[str, Any] = {"rope_theta": theta, "rope_type": str(o.get("rope_type", "default"))}
    if rope["rope_type"] == "llama3":
        rope.update({hf: o[option] for hf, option in _LLAMA3_KEYS.items()})
        rope["original_max_position_embeddings"] = o["rope_original_max_positions"]
    qkv_bias, o_bias = bool(o.get("qkv_bias", False)), bool(o.get("o_bias", False))
    if kind == "qwen2" and (not qkv_bias or o_bias):
        raise ConfigError(f"model {spec.name!r}: Qwen2 has q/k/v biases and no output bias")
    if kind in ("qwen2", "mistral") and o_bias:
        raise ConfigError(f"model {spec.name!r}: {kind} has no attention output bias")
    if kind != "qwen2" and qkv_bias != o_bias:
        raise ConfigError(
            f"model {spec.name!r}: {ARCH_NAMES[kind]} has biases on all of q, k, v and o or on none"
        )
    if bool(o.get("qk_norm", False)) != (kind == "qwen3"):
        raise ConfigError(f"model {spec.name!r}: qk_norm is Qwen3's, and Qwen3 has it")
    config: dict[str, Any] = {
        "architectures": [ARCH_NAMES[kind]],
        "model_type": kind,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": o.get("head_dim", spec.head_dim),
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": o.get("max_positions", spec.seq_len),
        "rms_norm_eps": o.get("norm_eps", 1e-5),
        "rope_parameters": rope,
        "rope_theta": theta,
        "tie_word_embeddings": bool(o.get("tie_embeddings", False)),
        "hidden_act": "silu",
        "dtype": "float32",
    }
    window = o.get("sliding_window")
    if window is not None and kind != "mistral":
        raise ConfigError(f"model {spec.name!r}: a sliding_window exports only to Mistral")
    if kind == "llama":
        config.update({"attention_bias": o_bias, "mlp_bias": False})
    elif kind == "mistral":
        config["sliding_window"] = window
    else:
        config.update({"use_sliding_window": False, "sliding_window": None})
        if kind == "qwen3":
            config["attention_bias"] = o_bias
    return config


def fingerprint(directory: str | Path) -> dict[str, str]:
    """File name -> sha256, for the config, the weights index and every safetensors file (of
    its header, which lists every tensor's name, dtype, shape and offsets, and its size: a
    cheap stand-in for hashing gigabytes of weights on every agent start)."""
    d = Path(directory)
    out: dict[str, str] = {}
    for name in (CONFIG_NAME, INDEX_NAME):
        path = d / name
        if path.is_file():
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    for path in weight_files(d):
        with path.open("rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            header = f.read(min(size, 100 << 20))
        digest = hashlib.sha256(header + b"\0" + str(path.stat().st_size).encode())
        out[path.name] = digest.hexdigest()
    return out
