"""What `--model` (and a job spec's `model:`) may name, resolved to a `ModelSpec`.

A model reference is one of:
- a preset name (`tiny`, `llama-7b`, ... see `elasticpp.plan.MODEL_PRESETS`);
- a YAML/JSON model spec file with `ModelSpec`'s fields;
- a Hugging Face model directory (`config.json` and `*.safetensors` of a
  `LlamaForCausalLM` or `GPT2LMHeadModel`): that architecture, starting from its weights;
- `package.module:function`: a user's model definition (`elasticpp.train.model.contract`),
  imported from the Python path and called with the model options.

Relative paths are resolved against `base_dir` (a job spec's directory). Every reference
also gets a fingerprint of the files it depends on (the spec file, the Hugging Face config,
weights index and safetensors headers, the user module's source), so agents of one job can
refuse to train from files that differ. Bad references are refused with a `ConfigError`
naming what is wrong, before any worker starts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from elasticpp.errors import ConfigError
from elasticpp.plan.specs import MODEL_PRESETS, ModelSpec, OptionValue, load_model_spec
from elasticpp.train.model import hfconfig

KINDS = ("preset", "spec", "hf", "entry")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_ENTRY_RE = re.compile(rf"{_IDENT}(\.{_IDENT})*:{_IDENT}")


@dataclass(frozen=True)
class ModelRef:
    kind: str  # one of KINDS
    ref: str  # the preset name, the absolute path, or the entry point
    spec: ModelSpec
    files: dict[str, str]  # file name -> sha256 of what the reference depends on
    init_dir: str | None = None  # a Hugging Face directory whose weights start the job


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resolve_model(
    ref: str,
    *,
    base_dir: Path | None = None,
    seq_len: int | None = None,
    options: Mapping[str, OptionValue] | None = None,
) -> ModelRef:
    """Resolve a model reference; `options` are the family's or the user function's."""
    if not isinstance(ref, str) or not ref:
        raise ConfigError("model: expected a preset, a spec file, a directory or module:function")
    if seq_len is not None and (
        isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0
    ):
        raise ConfigError(f"model: seq_len must be a positive integer, got {seq_len!r}")
    opts = dict(options or {})
    if _ENTRY_RE.fullmatch(ref) and not Path(ref).exists():
        return _entry(ref, opts, seq_len)
    if ref in MODEL_PRESETS:
        spec = MODEL_PRESETS[ref]
        kind, absolute, files = "preset", ref, {}
    else:
        path = Path(ref)
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        path = path.resolve()
        if path.is_dir():
            if not hfconfig.is_hf_dir(path):
                raise ConfigError(
                    f"model {ref!r}: a directory needs a Hugging Face config.json and "
                    "*.safetensors weights"
                )
            spec = hfconfig.spec_from_hf(path, seq_len=seq_len)
            return ModelRef(
                "hf",
                str(path),
                _with_options(spec, opts, ref),
                hfconfig.fingerprint(path),
                str(path),
            )
        if not path.is_file():
            raise ConfigError(
                f"unknown model {ref!r}: not a preset ({', '.join(MODEL_PRESETS)}), "
                "not a spec file or model directory, not package.module:function"
            )
        spec = load_model_spec(str(path))
        kind, absolute, files = "spec", str(path), {path.name: _sha256_file(path)}
    if seq_len is not None:
        spec = spec.with_seq_len(seq_len)
    return ModelRef(kind, absolute, _with_options(spec, opts, ref), files)


def _with_options(spec: ModelSpec, opts: Mapping[str, OptionValue], ref: str) -> ModelSpec:
    if not opts:
        return spec
    merged = {**spec.option_map, **opts}
    spec = replace(spec, options=tuple(merged.items()))
    from elasticpp.train.model.families import build_model  # checks the options now, naming them

    try:
        build_model(spec)
    except ConfigError as exc:
        raise ConfigError(f"model {ref!r}: {exc}") from exc
    return spec


def _entry(ref: str, opts: dict[str, OptionValue], seq_len: int | None) -> ModelRef:
    from elasticpp.train.model.contract import describe
    from elasticpp.train.model.families import build_user_model

    if seq_len is not None:
        opts.setdefault("seq_len", seq_len)
    module_name = ref.partition(":")[0]
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"model {ref!r}: cannot find module {module_name}: {exc}") from exc
    if found is None or found.origin is None:
        raise ConfigError(f"model {ref!r}: no module {module_name} on the Python path")
    model = build_user_model(ref, opts)
    spec = describe(model, family=ref, options=opts)
    origin = Path(found.origin)
    files = {origin.name: _sha256_file(origin)} if origin.is_file() else {}
    return ModelRef("entry", ref, spec, files)
