"""Job spec validation: every refusal names the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elasticpp.agent.jobspec import (
    SNAPSHOT_EVERY_S_DEFAULT,
    JobSpec,
    diff,
    load_job_spec,
    parse_job_spec,
)
from elasticpp.errors import ConfigError
from elasticpp.train.config import TrainConfig

MINIMAL = {
    "name": "job-a",
    "model": "tiny",
    "global_batch": 16,
    "micro_batch": 2,
    "steps": 10,
    "seed": 1,
    "min_nodes": 1,
    "max_nodes": 4,
}


def test_minimal_spec_gets_train_defaults_of_elasticpp_train() -> None:
    spec = parse_job_spec(dict(MINIMAL))
    cfg = spec.train_config()
    default = TrainConfig()
    assert (cfg.lr, cfg.warmup_steps, cfg.schedule, cfg.clip_grad) == (
        default.lr,
        default.warmup_steps,
        default.schedule,
        default.clip_grad,
    )
    assert (cfg.steps, cfg.seed) == (10, 1)


def test_round_trip_through_canonical_json() -> None:
    spec = parse_job_spec({**MINIMAL, "optimizer": {"lr": 3e-4}, "schedule": "gpipe"})
    again = JobSpec.from_json(spec.to_json())
    assert again == spec and again.to_json() == spec.to_json()
    assert again.train_config().lr == 3e-4 and again.train_config().schedule == "gpipe"


def test_compile_and_snapshot_when_busy_are_kept_and_default_off_and_wait() -> None:
    plain = parse_job_spec(dict(MINIMAL))
    assert plain.train_config().compile is False and plain.snapshot_when_busy == "wait"
    spec = parse_job_spec({**MINIMAL, "compile": True, "snapshot_when_busy": "skip"})
    again = JobSpec.from_json(spec.to_json())
    assert again.train_config().compile is True and again.snapshot_when_busy == "skip"


def test_snapshots_default_to_the_time_rule_and_a_step_rule_replaces_it() -> None:
    plain = parse_job_spec(dict(MINIMAL))
    assert (plain.snapshot_every, plain.snapshot_every_s) == (0, SNAPSHOT_EVERY_S_DEFAULT)
    assert plain.worker_snapshots() == {
        "snapshot_every": 0,
        "snapshot_every_s": SNAPSHOT_EVERY_S_DEFAULT,
        "snapshot_align": 1,
    }
    steps = parse_job_spec({**MINIMAL, "snapshot_every": 3})
    assert (steps.snapshot_every, steps.snapshot_every_s) == (3, 0.0)
    assert steps.worker_snapshots() == {"snapshot_every": 3, "snapshot_every_s": 0.0}
    # Either way the resolved pair is what etcd stores, and it reads back equal.
    for spec in (plain, steps, parse_job_spec({**MINIMAL, "snapshot_every_s": 0.5})):
        again = JobSpec.from_json(spec.to_json())
        assert again == spec and again.to_json() == spec.to_json()
    # A spec stored before the time rule existed (snapshot_every only) keeps its step rule.
    old = json.loads(steps.to_json())
    del old["snapshot_every_s"]
    assert JobSpec.from_json(json.dumps(old)).snapshot_every == 3


def test_time_rule_snapshots_land_on_anchors_and_on_persistent_checkpoints() -> None:
    spec = parse_job_spec(
        {**MINIMAL, "replication_every": 4, "persist_dir": "/ckpt", "persist_every": 10}
    )
    assert spec.worker_snapshots() == {
        "snapshot_every": 10,  # every persistent checkpoint's step is a snapshot
        "snapshot_every_s": SNAPSHOT_EVERY_S_DEFAULT,
        "snapshot_align": 4,  # a timed snapshot waits for an anchor step
    }
    unreplicated = parse_job_spec({**MINIMAL, "replication_every": 4, "replication_copies": 0})
    assert unreplicated.worker_snapshots()["snapshot_align"] == 1


def test_precision_is_copied_to_the_train_config_and_defaults_to_fp32() -> None:
    assert parse_job_spec(dict(MINIMAL)).train_config().precision == "fp32"
    spec = parse_job_spec({**MINIMAL, "precision": "bf16"})
    assert JobSpec.from_json(spec.to_json()).train_config().precision == "bf16"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"global_batch": 0}, "global_batch"),
        ({"micro_batch": 3}, "micro_batch"),
        ({"min_nodes": 5}, "min_nodes"),
        ({"model": "gpt-9000"}, "gpt-9000"),
        ({"name": "Bad Name"}, "name"),
        ({"lease_ttl_s": 1}, "lease_ttl_s"),
        ({"lease_ttl_s": 2}, "lease_ttl_s"),  # no time to act before self-fencing
        ({"lease_ttl_s": 7.5}, "lease_ttl_s"),  # etcd grants whole seconds
        ({"optimizer": {"learning_rate": 1}}, "learning_rate"),
        ({"colour": "blue"}, "colour"),
        ({"schedule": "zigzag"}, "schedule"),
        ({"precision": "fp16"}, "precision must be one of fp32, bf16"),
        ({"compile": "yes"}, "compile must be true or false"),
        ({"snapshot_when_busy": "drop"}, "snapshot_when_busy must be wait or skip"),
        ({"data": "t.bin", "data_dtype": "float16"}, "data_dtype"),
        ({"data": "t.npy", "data_shuffle": "off"}, "data_shuffle"),
        ({"data": "corpus.txt", "data_shuffle": False}, "data_shuffle"),
        ({"data_dtype": "uint16"}, "data_dtype"),
        ({"persist_every": 5}, "persist_dir"),
        ({"snapshot_every": -1}, "snapshot_every must be an integer >= 0"),
        ({"snapshot_every_s": -0.5}, "snapshot_every_s must be a number >= 0"),
        ({"snapshot_every_s": "2s"}, "snapshot_every_s must be a number >= 0"),
        ({"snapshot_every": 4, "snapshot_every_s": 2}, "give one of snapshot_every"),
        ({"snapshot_every": 0, "snapshot_every_s": 0}, "both 0"),
        ({"device": "tpu"}, "tpu"),
        ({"device": {"memory_gib": 8, "peak_tflops": 1}}, "intra_node_gbps"),
        ({"device": {"memory_gib": 8, "colour": 1}}, "colour"),
    ],
)
def test_bad_values_are_refused_naming_the_field(change: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_job_spec({**MINIMAL, **change})


def test_a_device_without_a_preset_is_given_by_its_fields() -> None:
    fields = {"memory_gib": 8, "peak_tflops": 0.03, "intra_node_gbps": 5, "inter_node_gbps": 1}
    spec = parse_job_spec({**MINIMAL, "device": fields})
    dev = spec.device_spec()
    assert (dev.name, dev.peak_tflops, dev.intra_node_gbps) == ("custom", 0.03, 5)
    assert JobSpec.from_json(spec.to_json()).device_spec() == dev


def test_missing_required_keys_are_named() -> None:
    data = {k: v for k, v in MINIMAL.items() if k not in ("steps", "seed")}
    with pytest.raises(ConfigError, match="steps, seed"):
        parse_job_spec(data)


def test_diff_names_the_fields_that_differ() -> None:
    a = parse_job_spec(dict(MINIMAL))
    b = parse_job_spec({**MINIMAL, "global_batch": 32, "optimizer": {"lr": 0.1}})
    assert diff(a, b) == ["global_batch", "lr"]
    assert diff(a, a) == []


def test_load_from_yaml_with_a_model_file_beside_it(tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text(
        "num_layers: 2\nhidden_size: 32\nnum_heads: 2\nvocab_size: 256\nseq_len: 16\n"
    )
    (tmp_path / "job.yaml").write_text(
        "\n".join(f"{k}: {v}" for k, v in {**MINIMAL, "model": "m.yaml"}.items())
    )
    spec = load_job_spec(tmp_path / "job.yaml")
    assert spec.model.num_layers == 2 and spec.model.ffn_hidden_size == 128
    with pytest.raises(ConfigError, match="not valid YAML"):
        (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
        load_job_spec(tmp_path / "bad.yaml")


def test_data_keys_reach_the_train_config_and_survive_the_round_trip() -> None:
    spec = parse_job_spec(
        {**MINIMAL, "data": "/corpus/t.bin", "data_dtype": "uint32", "data_shuffle": False}
    )
    cfg = spec.train_config()
    assert (cfg.data, cfg.data_dtype, cfg.data_shuffle) == ("/corpus/t.bin", "uint32", False)
    assert JobSpec.from_json(spec.to_json()) == spec
    assert diff(spec, parse_job_spec({**MINIMAL, "data": "/corpus/t.bin"})) == [
        "data_dtype",
        "data_shuffle",
    ]


def test_a_relative_data_path_is_resolved_beside_the_spec_file(tmp_path: Path) -> None:
    (tmp_path / "specs").mkdir()
    spec_file = tmp_path / "specs" / "job.yaml"
    spec_file.write_text(
        "\n".join(f"{k}: {v}" for k, v in {**MINIMAL, "data": "../data/t.bin"}.items())
        + "\ndata_dtype: uint16\n"
    )
    cfg = load_job_spec(spec_file).train_config()
    assert cfg.data == str(tmp_path / "data" / "t.bin") and cfg.data_dtype == "uint16"
    absolute = parse_job_spec({**MINIMAL, "data": "/srv/t.npy"}, base_dir=tmp_path)
    assert absolute.train_config().data == "/srv/t.npy"


def test_relative_shard_paths_of_a_data_list_are_resolved_beside_the_spec_file(
    tmp_path: Path,
) -> None:
    (tmp_path / "specs").mkdir()
    spec_file = tmp_path / "specs" / "job.yaml"
    spec_file.write_text(
        "\n".join(f"{k}: {v}" for k, v in MINIMAL.items())
        + "\ndata: [part-1.bin, ../data/part-0.bin, /srv/part-2.bin]\ndata_dtype: uint16\n"
    )
    cfg = load_job_spec(spec_file).train_config()
    assert set(cfg.data or ()) == {
        str(tmp_path / "specs" / "part-1.bin"),
        str(tmp_path / "data" / "part-0.bin"),
        "/srv/part-2.bin",
    }
    # Without a spec file there is no directory to resolve against: still refused.
    with pytest.raises(ConfigError, match=r"absolute paths, got 'part-1\.bin'"):
        parse_job_spec({**MINIMAL, "data": ["part-1.bin", "/srv/part-2.bin"]})


def test_the_jobs_identity_changes_with_what_its_state_depends_on_only() -> None:
    base = parse_job_spec(dict(MINIMAL)).identity()
    assert base.name == "job-a" and len(base.fingerprint) == 64
    assert parse_job_spec(dict(MINIMAL)).identity() == base  # stable
    how = {"max_nodes": 8, "min_nodes": 2, "micro_batch": 4, "replication_copies": 2}
    assert parse_job_spec({**MINIMAL, **how}).identity() == base
    for what in ({"seed": 2}, {"global_batch": 32}, {"optimizer": {"lr": 3e-4}}, {"steps": 11}):
        assert parse_job_spec({**MINIMAL, **what}).identity() != base, what
    assert parse_job_spec({**MINIMAL, "name": "job-b"}).identity() != base


def test_the_workers_train_config_and_its_dict_are_built_once_per_spec() -> None:
    # Every node built them again (three conversions, ~1 ms) at every assignment.
    spec = parse_job_spec(dict(MINIMAL))
    train = spec.worker_train
    assert train == spec.train_config() and spec.worker_train is train
    assert train.shared_dict == train.to_dict() and train.shared_dict is train.shared_dict
    assert train.steps == 10 and train.seed == 1
    other = parse_job_spec({**MINIMAL, "steps": 20})
    assert other.worker_train.shared_dict["steps"] == 20  # its own spec's, not a shared cache
    assert spec == parse_job_spec(dict(MINIMAL))  # equality is of the fields alone
