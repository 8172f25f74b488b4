"""`elasticpp export CHECKPOINT --hf OUT`: a saved step as a Hugging Face model directory.

CHECKPOINT is a step directory with a manifest, or a root of them (the newest is taken): a
`--save` of `elasticpp train` or an agent's persistent checkpoint, saved under any layout.
OUT gets `config.json` and `model.safetensors`, loadable with `from_pretrained`. The model
comes from the checkpoint's manifest when it is a built-in family (its fields are data);
`--model` names it for checkpoints that do not record it (version 1) and for a user's model,
whose code is named here, never taken from a file: a manifest that names a
`package.module:function` is refused without it. Bad input exits 2 and writes nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from elasticpp.cli import flagtypes
from elasticpp.cli.output import add_output_flag, emit, message_table
from elasticpp.errors import CheckpointError, ConfigError


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", type=flagtypes.path, help="a step directory, or a root of them"
    )
    parser.add_argument("--hf", type=flagtypes.path, required=True, help="the directory to write")
    parser.add_argument(
        "--model", type=flagtypes.nonempty, default=None, help="the model, if the manifest lacks it"
    )
    parser.add_argument("--force", action="store_true", help="write into a non-empty --hf")
    add_output_flag(parser)


def run(args: argparse.Namespace) -> int:
    from elasticpp.checkpoint.manifest import find_step_dir, verify_step_dir
    from elasticpp.plan.specs import FAMILIES
    from elasticpp.train.model.hf import export_hf
    from elasticpp.train.model.modelref import resolve_model

    step_dir = find_step_dir(args.checkpoint, what="export")
    manifest = verify_step_dir(step_dir)
    if args.model is not None:
        spec = resolve_model(args.model).spec
    elif manifest.model is not None and manifest.model.family in FAMILIES:
        spec = manifest.model
    elif manifest.model is not None:
        raise ConfigError(
            f"{step_dir}: the manifest names the model code {manifest.model.family!r:.80}, "
            "which export does not import from a file; give --model to name it"
        )
    else:
        raise ConfigError(f"{step_dir}: the manifest does not record its model; give --model")
    if manifest.units != spec.units or not manifest.is_full_model():
        raise CheckpointError(
            f"{step_dir}: not a full state of {spec.name} "
            f"(missing: {', '.join(manifest.missing_units()[:6]) or 'none'}"
            f"{'' if manifest.units == spec.units else '; its units differ from the model'})"
        )
    out: Path = args.hf
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        raise ConfigError(f"--hf {out}: exists and is not empty (use --force to write into it)")
    written = export_hf(spec, step_dir, out)
    names = ", ".join(p.name for p in written)
    result = {
        "step": manifest.step,
        "model": spec.name,
        "out": str(out),
        "files": [p.name for p in written],
        "message": f"exported step {manifest.step} of {spec.name} to {out} ({names})",
    }
    emit(result, args.output, message_table)
    return 0
