"""The model contract: declarations are checked before anything runs, names share one
character set with piece files, and the planner's numbers come from the declaration."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from elasticpp.checkpoint.manifest import FORMAT_VERSION, Manifest, PieceEntry, PieceKey
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.names import parse_name
from elasticpp.plan import MODEL_PRESETS, ModelSpec
from elasticpp.plan.cost import ModelCosts
from elasticpp.train.model.contract import (
    Boundary,
    ContractError,
    ModelDef,
    Param,
    Split,
    Unit,
    describe,
    init_unit,
    model_numbers,
    validate,
)
from elasticpp.train.model.families import build_model


def _ident(ctx, params, x):
    return x


def _tiny_def(**changes: object) -> ModelDef:
    first = Unit("in", (Param("tok", (10, 4), Split.VOCAB),), _ident)
    block = Unit("mix.0", (Param("w", (4, 4), Split.COLUMN), Param("b", (4,))), _ident)
    last = Unit("out", (Param("proj", (10, 4), Split.VOCAB, tied_to="in/tok"),), _ident)
    base = ModelDef("toy", (first,), (block,), (last,), Boundary((3, 4)), 10, 3)
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    "name", ["embed", "block.0007", "model.layers.0.mlp.up_proj.weight", "a-b_c"]
)
def test_names_of_the_documented_character_set_are_accepted(name: str) -> None:
    assert parse_name(name) == name


@pytest.mark.parametrize("name", ["", "..", ".hidden", "a/b", "Embed", "x" * 129, "a b", 3])
def test_names_outside_the_character_set_are_refused(name: object) -> None:
    with pytest.raises(ConfigError, match="not a valid name"):
        parse_name(name)


@pytest.mark.parametrize(
    "name", ["../x.tp0-1.safetensors", "/etc.tp0-1.safetensors", "a/b.tp0-1.safetensors"]
)
def test_piece_names_cannot_be_paths(name: str) -> None:
    with pytest.raises(ConfigError):
        PieceKey.parse(name)


def test_a_unit_name_with_dots_round_trips_through_its_piece_name() -> None:
    key = PieceKey("model.layers.3", 1, 2)
    assert PieceKey.parse(key.filename) == key


def test_manifest_records_units_generation_and_epoch_reads_versions_2_3_and_refuses_a_newer() -> (
    None
):
    entry = PieceEntry(PieceKey("in", 0, 1), 10, "ab" * 32)
    manifest = Manifest(4, ("in", "mix.0", "out"), (entry,), generation=7, epoch=3)
    data = json.loads(manifest.to_json())
    assert data["format_version"] == FORMAT_VERSION == 4
    assert data["units"] == ["in", "mix.0", "out"] and data["generation"] == 7
    assert data["epoch"] == 3
    back = Manifest.from_json(manifest.to_json())
    assert back.units == manifest.units and back.missing_units() == ["mix.0", "out"]
    assert back.generation == 7 and back.epoch == 3
    v3 = {k: v for k, v in data.items() if k != "epoch"} | {"format_version": 3}
    assert Manifest.from_json(json.dumps(v3)).epoch == 0  # an earlier release: epoch 0
    v2 = {k: v for k, v in v3.items() if k != "generation"} | {"format_version": 2}
    assert Manifest.from_json(json.dumps(v2)).generation == 0
    data["format_version"] = 5
    with pytest.raises(CheckpointError, match="format_version 5"):
        Manifest.from_json(json.dumps(data))


def test_a_valid_declaration_passes_and_describes_itself_as_numbers() -> None:
    model = _tiny_def()
    validate(model)
    spec = describe(model, family="pkg.mod:build", options={"width": 4})
    assert spec.units == ("in", "mix.0", "out")
    assert spec.numbers is not None
    assert spec.numbers.first_params == 40 and spec.numbers.last_params == 0  # tied: counted once
    assert spec.numbers.block_params == 20
    assert 10 in spec.tp_divisors and 4 in spec.tp_divisors
    assert not spec.tp_fits(3)
    assert ModelSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"blocks": ()}, "at least one first unit, one block"),
        ({"first": (Unit("Bad Name", (), _ident),)}, "not a valid name"),
        ({"last": (Unit("in", (), _ident),)}, "used twice"),
        (
            {"blocks": (Unit("m", (Param("b", (4,), Split.ROW),), _ident),)},
            "ROW split needs a matrix",
        ),
        ({"blocks": (Unit("m", (Param("w", (4, 0)),), _ident),)}, "shape must be positive"),
        ({"blocks": (Unit("m", (Param("w", (4,)), Param("w", (4,))), _ident),)}, "declared twice"),
        (
            {"last": (Unit("o", (Param("p", (10, 4), Split.VOCAB, tied_to="in/nope"),), _ident),)},
            "not an untied",
        ),
        (
            {"last": (Unit("o", (Param("p", (10, 5), Split.VOCAB, tied_to="in/tok"),), _ident),)},
            "differs",
        ),
        ({"first": (Unit("in", (Param("tok", (9, 4), Split.VOCAB),), _ident),)}, "needs 10 rows"),
        ({"boundary": Boundary((3, 4), "int8")}, "boundary dtype"),
    ],
)
def test_declarations_that_break_the_contract_are_refused_naming_the_part(
    change: dict[str, object], message: str
) -> None:
    with pytest.raises(ContractError, match=message):
        validate(_tiny_def(**change))


@pytest.mark.parametrize("preset", ["tiny", "gpt-1.3b", "llama-7b", "llama-70b", "llama-tiny"])
def test_declared_parameter_counts_equal_the_cost_models_for_the_builtin_families(
    preset: str,
) -> None:
    spec = MODEL_PRESETS[preset]
    if spec.hidden_size > 2048:  # keep the test fast: the same formula at a smaller width
        spec = dataclasses.replace(
            spec,
            hidden_size=spec.hidden_size // 8,
            ffn_hidden_size=spec.ffn_hidden_size // 8,
            units=(),
        )
    numbers = model_numbers(build_model(spec))
    costs = ModelCosts.of(spec)
    assert numbers.block_params == costs.block_params
    assert numbers.first_params == costs.embed_params
    assert numbers.last_params == costs.head_params
    assert numbers.block_flops_per_token * spec.seq_len == pytest.approx(
        costs.block_fwd_flops_per_sample
    )


def test_llama_70b_counts_grouped_query_attention_and_the_gated_mlp() -> None:
    spec = MODEL_PRESETS["llama-70b"]
    costs = ModelCosts.of(spec)
    h, kv, f = 8192, 8 * 128, 28672
    assert costs.block_params == 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    assert not spec.tp_fits(16) and spec.tp_fits(8)  # 8 kv heads


def test_tp_slices_of_a_tied_vocabulary_split_unit_concatenate_to_the_whole() -> None:
    model = _tiny_def()
    whole = init_unit(model.unit("out"), 1, 0, 1)["proj"]
    parts = [init_unit(model.unit("out"), 1, r, 2)["proj"] for r in range(2)]
    assert torch.equal(torch.cat(parts), whole)
    # A tied parameter starts as its original.
    assert torch.equal(whole, init_unit(model.unit("in"), 1, 0, 1)["tok"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"colour": 1}, "unknown option"),
        ({"gelu": "relu"}, "gelu must be"),
        ({"tie_embeddings": "yes"}, "tie_embeddings must be"),
    ],
)
def test_family_options_are_checked(options: dict[str, object], message: str) -> None:
    spec = dataclasses.replace(MODEL_PRESETS["tiny"], options=tuple(options.items()))
    with pytest.raises(ContractError, match=message):
        build_model(spec)
