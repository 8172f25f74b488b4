"""Model families on the contract (`elasticpp.train.contract`), and the one place that turns a
`ModelSpec` into a `ModelDef`: a built-in family (`gpt`, `llama`) or a user's
`package.module:function`, called with the spec's options.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from elasticpp.plan.specs import ModelSpec, OptionValue
from elasticpp.train.contract import ContractError, ModelDef, check_matches, validate


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
        from elasticpp.train.families import gpt

        model = gpt.build(spec)
    elif spec.family == "llama":
        from elasticpp.train.families import llama

        model = llama.build(spec)
    else:
        model = build_user_model(spec.family, spec.option_map)
    validate(model)
    check_matches(model, spec)
    return model
