"""Hugging Face interop: a `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM` or `GPT2LMHeadModel` directory (its `config.json` and `*.safetensors`)
in, the same architecture on the model contract out, and back again
(`elasticpp.train.model.hfconfig` reads and writes the configuration).

- `units_from_hf` / `hf_from_units` map tensors between Hugging Face names and
  `unit -> parameter` (GPT-2's fused, transposed `Conv1D` weights are split and transposed;
  both directions are exact, so import then export is bit-for-bit).
- `write_initial_step` turns imported weights into an elasticpp step directory at step 0
  (whole tp=1 pieces, zero AdamW moments) that any layout loads; `export_hf` writes a
  directory `from_pretrained` loads from any saved step.

Only safetensors are read: nothing is unpickled.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from elasticpp.checkpoint.durable import durable_write
from elasticpp.checkpoint.manifest import Manifest, PieceKey, write_manifest
from elasticpp.checkpoint.tensors import KINDS, PieceMeta, load_units, write_piece
from elasticpp.errors import CheckpointError
from elasticpp.plan.specs import UNIT_EMBED, UNIT_HEAD, ModelSpec, block_unit
from elasticpp.train.model.families import build_model
from elasticpp.train.model.hfconfig import CONFIG_NAME, hf_config, spec_from_hf, weight_files

_GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of old GPT-2 saves


def read_hf_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory, by Hugging Face name, as float32."""
    out: dict[str, torch.Tensor] = {}
    for path in weight_files(Path(directory)):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    out[key] = f.get_tensor(key).to(torch.float32)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not readable safetensors: {exc}") from exc
    return out


def _name_map(spec: ModelSpec) -> dict[str, tuple[str, str]]:
    """Hugging Face name -> (unit, parameter) for tensors that map one to one."""
    m: dict[str, tuple[str, str]] = {}
    if spec.family == "llama":
        o = spec.option_map
        biases = [x for x, on in (("q", "qkv_bias"), ("k", "qkv_bias"), ("v", "qkv_bias"),
                                  ("o", "o_bias")) if o.get(on, False)]  # fmt: skip
        m["model.embed_tokens.weight"] = (UNIT_EMBED, "tok.weight")
        m["model.norm.weight"] = (UNIT_HEAD, "norm.weight")
        m["lm_head.weight"] = (UNIT_HEAD, "lm_head.weight")
        for i in range(spec.num_layers):
            u, hf = block_unit(i), f"model.layers.{i}."
            m[hf + "input_layernorm.weight"] = (u, "attn_norm.weight")
            m[hf + "post_attention_layernorm.weight"] = (u, "mlp_norm.weight")
            for x in "qkvo":
                m[hf + f"self_attn.{x}_proj.weight"] = (u, f"attn.{x}.weight")
            for x in biases:
                m[hf + f"self_attn.{x}_proj.bias"] = (u, f"attn.{x}.bias")
            if o.get("qk_norm", False):
                for x in "qk":
                    m[hf + f"self_attn.{x}_norm.weight"] = (u, f"attn.{x}_norm.weight")
            for x in ("gate", "up", "down"):
                m[hf + f"mlp.{x}_proj.weight"] = (u, f"mlp.{x}.weight")
        return m
    m["transformer.wte.weight"] = (UNIT_EMBED, "tok.weight")
    m["transformer.wpe.weight"] = (UNIT_EMBED, "pos.weight")
    m["transformer.ln_f.weight"] = (UNIT_HEAD, "ln_f.weight")
    m["transformer.ln_f.bias"] = (UNIT_HEAD, "ln_f.bias")
    m["lm_head.weight"] = (UNIT_HEAD, "lm_head.weight")
    for i in range(spec.num_layers):
        u, hf = block_unit(i), f"transformer.h.{i}."
        for k in ("weight", "bias"):
            m[hf + f"ln_1.{k}"] = (u, f"ln1.{k}")
            m[hf + f"ln_2.{k}"] = (u, f"ln2.{k}")
            m[hf + f"attn.c_proj.{k}"] = (u, f"attn.o.{k}")
            m[hf + f"mlp.c_fc.{k}"] = (u, f"mlp.fc1.{k}")
            m[hf + f"mlp.c_proj.{k}"] = (u, f"mlp.fc2.{k}")
    return m


def _conv1d(name: str) -> bool:
    """GPT-2's Conv1D stores weights as [in, out]: transposed against a linear's."""
    return name.endswith(("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"))


def units_from_hf(
    spec: ModelSpec, state: Mapping[str, torch.Tensor]
) -> dict[str, dict[str, torch.Tensor]]:
    """Whole tensors per unit and parameter, checked against the declaration's shapes."""
    state = dict(state)
    if spec.family == "gpt":
        # Saves without the `transformer.` prefix (the base GPT2Model) map the same way.
        state = {
            (k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"): v
            for k, v in state.items()
            if not k.endswith(_GPT2_BUFFERS)
        }
    model = build_model(spec)
    tie = dict(spec.options).get("tie_embeddings", False)
    out: dict[str, dict[str, torch.Tensor]] = {u: {} for u in spec.units}
    names = _name_map(spec)
    used: set[str] = set()
    for hf_name, (unit, pname) in names.items():
        if hf_name in state:
            t = state[hf_name]
            out[unit][pname] = t.t().contiguous() if _conv1d(hf_name) else t
            used.add(hf_name)
    if spec.family == "gpt":
        for i in range(spec.num_layers):
            hf = f"transformer.h.{i}.attn.c_attn."
            if hf + "weight" in state and hf + "bias" in state:
                w, b = state[hf + "weight"].t(), state[hf + "bias"]
                for x, wx, bx in zip("qkv", w.chunk(3, dim=0), b.chunk(3, dim=0), strict=True):
                    out[block_unit(i)][f"attn.{x}.weight"] = wx.contiguous()
                    out[block_unit(i)][f"attn.{x}.bias"] = bx.contiguous()
                used.update((hf + "weight", hf + "bias"))
    if tie:
        out[UNIT_HEAD]["lm_head.weight"] = out[UNIT_EMBED]["tok.weight"].clone()
    unknown = sorted(set(state) - used)
    if unknown:
        raise CheckpointError(
            f"{spec.name}: weights without a place in the model: {', '.join(unknown[:6])}"
            + (f" and {len(unknown) - 6} more" if len(unknown) > 6 else "")
        )
    for decl in model.units:
        for p in decl.params:
            got = out[decl.name].get(p.name)
            if got is None:
                raise CheckpointError(f"{spec.name}: no weights for {decl.name}/{p.name}")
            if tuple(got.shape) != p.shape:
                raise CheckpointError(
                    f"{spec.name}: {decl.name}/{p.name} has shape {tuple(got.shape)}, "
                    f"the model declares {p.shape}"
                )
    return out


def hf_from_units(
    spec: ModelSpec, units: Mapping[str, Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Hugging Face names and layouts of whole per-unit tensors (exact inverse of import)."""
    tie = dict(spec.options).get("tie_embeddings", False)
    out: dict[str, torch.Tensor] = {}
    for hf_name, (unit, pname) in _name_map(spec).items():
        if tie and hf_name == "lm_head.weight":
            continue  # tied: from_pretrained takes it from the embedding
        t = units[unit][pname]
        out[hf_name] = t.t().contiguous() if _conv1d(hf_name) else t.contiguous()
    if spec.family == "gpt":
        for i in range(spec.num_layers):
            u, hf = units[block_unit(i)], f"transformer.h.{i}.attn.c_attn."
            out[hf + "weight"] = torch.cat([u[f"attn.{x}.weight"] for x in "qkv"]).t().contiguous()
            out[hf + "bias"] = torch.cat([u[f"attn.{x}.bias"] for x in "qkv"]).contiguous()
    return out


def write_initial_step(
    spec: ModelSpec, units: Mapping[str, Mapping[str, torch.Tensor]], step_dir: Path
) -> Manifest:
    """An elasticpp step directory at step 0 from whole weights: one tp=1 piece per unit,
    AdamW moments zero. Any layout loads it (`checkpoint.tensors.load_units` reshards)."""
    model = build_model(spec)
    entries = []
    for unit in model.units:
        tensors: dict[str, torch.Tensor] = {}
        dims: dict[str, int | None] = {}
        for p in unit.params:
            value = units[unit.name][p.name].to(torch.float32).contiguous()
            for kind in KINDS:
                tensors[f"{kind}/{p.name}"] = value if kind == "param" else torch.zeros_like(value)
                dims[f"{kind}/{p.name}"] = p.shard_dim
        key = PieceKey(unit.name, 0, 1)
        entries.append(write_piece(step_dir, key, tensors, PieceMeta(unit.name, 0, 1, 0, dims)))
    manifest = Manifest(0, spec.units, tuple(entries), model=spec)
    write_manifest(step_dir, manifest)
    return manifest


def import_hf(directory: str | Path, step_dir: Path, *, seq_len: int | None = None) -> ModelSpec:
    """Read a Hugging Face directory into an elasticpp step directory at step 0."""
    spec = spec_from_hf(directory, seq_len=seq_len)
    write_initial_step(spec, units_from_hf(spec, read_hf_state(directory)), step_dir)
    return spec


def write_init_step(spec: ModelSpec, source: Path, work_dir: Path) -> Path:
    """A step-0 directory under `work_dir` with the weights of `source` (a Hugging Face
    directory, or an elasticpp step directory or root of the same model) and fresh optimizer
    state: how a new job starts from trained weights (`--init-from`, `init_from:`)."""
    from elasticpp.checkpoint.manifest import find_step_dir, step_dirname, verify_step_dir
    from elasticpp.train.model.hfconfig import is_hf_dir

    if is_hf_dir(source):
        units = units_from_hf(spec, read_hf_state(source))
    else:
        step_dir = find_step_dir(source, what="init_from")
        manifest = verify_step_dir(step_dir)
        if manifest.units != spec.units or not manifest.is_full_model():
            raise CheckpointError(f"init_from {step_dir}: not a full state of {spec.name}")
        units = read_whole_units(spec, step_dir)
    out = work_dir / step_dirname(0)
    if out.exists():
        shutil.rmtree(out)  # a stale conversion of an earlier run: never half-reused
    write_initial_step(spec, units, out)
    return out


def read_whole_units(spec: ModelSpec, step_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The parameters of every unit of a saved step (any tp size), whole."""
    loaded = load_units(step_dir, spec.units, 0, 1)
    return {
        unit: {
            name.removeprefix("param/"): t
            for name, t in got.tensors.items()
            if name.startswith("param/")
        }
        for unit, got in loaded.items()
    }


def export_hf(spec: ModelSpec, step_dir: Path, out: Path) -> list[Path]:
    """Write `config.json` and `model.safetensors` of a saved step into `out`."""
    config = hf_config(spec)
    tensors = hf_from_units(spec, read_whole_units(spec, step_dir))
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "model.safetensors"
    tmp = out / ".model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(weights)
    durable_write(out / CONFIG_NAME, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    return [out / CONFIG_NAME, weights]
