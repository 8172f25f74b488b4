"""Model references in job specs and flags: resolved against the spec's directory, recorded
with their files' fingerprints, refused with a message naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from elasticpp.agent.jobspec import diff, parse_job_spec
from elasticpp.errors import ConfigError
from elasticpp.train.model.modelref import resolve_model

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
}
BASE = {
    "name": "j",
    "global_batch": 4,
    "micro_batch": 2,
    "steps": 3,
    "seed": 0,
    "min_nodes": 1,
    "max_nodes": 2,
}


def _model_dir(root: Path, config: dict) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    save_file({"w": torch.zeros(2)}, str(root / "model.safetensors"))
    return root


def test_a_model_directory_is_resolved_against_the_spec_and_starts_the_job(tmp_path: Path) -> None:
    _model_dir(tmp_path / "m", LLAMA)
    spec = parse_job_spec({**BASE, "model": "m", "seq_len": 16}, base_dir=tmp_path)
    assert spec.model.family == "llama" and spec.model.num_kv_heads == 2
    assert spec.model.seq_len == 16
    assert spec.model_ref["kind"] == "hf"
    assert spec.model_ref["ref"] == str((tmp_path / "m").resolve())
    assert set(spec.model_ref["files"]) == {"config.json", "model.safetensors"}
    assert spec.init_from == str((tmp_path / "m").resolve())
    assert parse_job_spec({**BASE, "model": "m", "seq_len": 16}, base_dir=tmp_path) == spec


def test_agents_whose_model_files_differ_are_told_which(tmp_path: Path) -> None:
    _model_dir(tmp_path / "a" / "m", LLAMA)
    _model_dir(tmp_path / "b" / "m", {**LLAMA, "rms_norm_eps": 1e-5})
    a = parse_job_spec({**BASE, "model": "m"}, base_dir=tmp_path / "a")
    b = parse_job_spec({**BASE, "model": str((tmp_path / "a" / "m").resolve())})
    assert diff(a, b) == []  # the same files, named another way
    c = parse_job_spec({**BASE, "model": str((tmp_path / "b" / "m").resolve())})
    fields = diff(a, c)
    assert "model file config.json" in fields and "model_ref" in fields
    assert "model file model.safetensors" not in fields


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("no-such-model", "unknown model 'no-such-model'"),
        ("empty", "needs a Hugging Face config.json"),
    ],
)
def test_unknown_references_are_refused_naming_them(tmp_path: Path, ref: str, message: str) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=message):
        parse_job_spec({**BASE, "model": ref}, base_dir=tmp_path)


def test_init_from_is_resolved_and_must_exist(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    spec = parse_job_spec({**BASE, "model": "tiny", "init_from": "ckpt"}, base_dir=tmp_path)
    assert spec.init_from == str((tmp_path / "ckpt").resolve())
    with pytest.raises(ConfigError, match="init_from 'nope': no such directory"):
        parse_job_spec({**BASE, "model": "tiny", "init_from": "nope"}, base_dir=tmp_path)


def test_model_options_reach_the_family_and_bad_ones_are_refused() -> None:
    ref = resolve_model("tiny", options={"gelu": "tanh"})
    assert ref.spec.option_map == {"gelu": "tanh"}
    with pytest.raises(ConfigError, match="unknown option"):
        parse_job_spec({**BASE, "model": "tiny", "model_options": {"colour": "red"}})
