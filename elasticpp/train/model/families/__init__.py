"""Model families on the contract (`elasticpp.train.model.contract`), and the one place that turns a
`ModelSpec` into a `ModelDef`: a built-in family (`gpt`, `llama`) or a user's
`package.module:function`, called with the spec's options.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from elasticpp.plan.specs import UNIT_EMBED, ModelSpec, OptionValue
from elasticpp.train.model.contract import (
    Boundary,
    ContractError,
    ModelDef,
    Param,
    Split,
    Unit,
    UnitContext,
    check_matches,
    normal,
    validate,
)

INIT_STD = 0.02


def check_options(
    family: str, options: Mapping[str, OptionValue], allowed: Mapping[str, type | tuple[type, ...]]
) -> None:
    """Refuse unknown options and options of the wrong type, naming them."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ContractError(
            f"{family}: unknown option(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}"
        )
    for key, value in options.items():
        kinds = allowed[key]
        if isinstance(value, bool) and bool not in (
            kinds if isinstance(kinds, tuple) else (kinds,)
        ):
            raise ContractError(f"{family}: option {key} must be {kinds}, got {value!r}")
        if not isinstance(value, kinds):
            raise ContractError(f"{family}: option {key} must be {kinds}, got {value!r}")


def vocab_split(options: Mapping[str, OptionValue]) -> Split:
    return Split.VOCAB if options.get("vocab_parallel", False) else Split.REPLICATED


def lm_head_param(spec: ModelSpec) -> Param:
    """The LM head of the decoder families: `[vocab, hidden]`, split as the embedding is,
    tied to the token embedding when `tie_embeddings` is set."""
    tie = bool(spec.option_map.get("tie_embeddings", False))
    return Param(
        "lm_head.weight",
        (spec.vocab_size, spec.hidden_size),
        vocab_split(spec.option_map),
        normal(INIT_STD),
        tied_to=f"{UNIT_EMBED}/tok.weight" if tie else None,
    )


def to_vocab(ctx: UnitContext, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits (this rank's vocabulary slice when the head is split) of hidden states."""
    if weight.shape[0] != ctx.vocab_size:  # vocabulary-split: every rank needs all of h
        h = ctx.copy_to_tp(h)
    return F.linear(h, weight)


def decoder(
    spec: ModelSpec, embed: Unit, blocks: tuple[Unit, ...], head: Unit, **extra: object
) -> ModelDef:
    """A decoder's `ModelDef`: one embedding unit, the blocks, one head unit; the boundary
    is the hidden state of every position."""
    return ModelDef(
        name=spec.name,
        first=(embed,),
        blocks=blocks,
        last=(head,),
        boundary=Boundary((spec.seq_len, spec.hidden_size)),
        vocab_size=spec.vocab_size,
        seq_len=spec.seq_len,
        num_heads=spec.num_heads,
        **extra,  # type: ignore[arg-type]
    )


def option_float(options: Mapping[str, OptionValue], key: str, default: float) -> float:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ContractError(f"option {key} must be a positive number, got {value!r}")
    return float(value)


def load_entry_point(entry: str) -> object:
    """The function named by `package.module:function`; `ContractError` naming what is wrong."""
    module_name, sep, attr = entry.partition(":")
    if not sep or not module_name or not attr:
        raise ContractError(f"model {entry!r}: expected 'package.module:function'")
    top = module_name.partition(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        # A model is a user's package: an entry point into the standard library can only be
        # a mistake or an attack (`subprocess:getoutput` runs a shell command).
        raise ContractError(f"model {entry!r}: {top} is a standard-library module, not a model")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ContractError(f"model {entry!r}: cannot import {module_name}: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise ContractError(f"model {entry!r}: module {module_name} has no {attr!r}")
    if not callable(fn):
        raise ContractError(f"model {entry!r}: {attr} is not callable")
    return fn


def build_user_model(entry: str, options: Mapping[str, OptionValue]) -> ModelDef:
    """Call a user's model function with its options and check what it returns."""
    fn = load_entry_point(entry)
    try:
        model = fn(dict(options))  # type: ignore[operator]
    except ContractError:
        raise
    except Exception as exc:
        raise ContractError(
            f"model {entry!r}: the function failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(model, ModelDef):
        raise ContractError(
            f"model {entry!r}: the function returned {type(model).__name__}, not a ModelDef"
        )
    validate(model)
    return model


def build_model(spec: ModelSpec) -> ModelDef:
    """The model definition a spec names, checked against the spec."""
    if spec.family == "gpt":
        from elasticpp.train.model.families import gpt

        model = gpt.build(spec)
    elif spec.family == "llama":
        from elasticpp.train.model.families import llama

        model = llama.build(spec)
    else:
        model = build_user_model(spec.family, spec.option_map)
    validate(model)
    check_matches(model, spec)
    return model
