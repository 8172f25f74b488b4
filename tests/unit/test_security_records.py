"""Nothing read from etcd or a checkpoint is code, and no value poisons a read (the security
review's F4 and F12, their pure parts): a generation record's plan is built with the reader's
own model or refused; a value nested to exhaust the parser, or one over the size bound, is
skipped like any unreadable value; a resume instruction cannot ask for more sources than the
node needs; an entry point into the standard library is no model."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from elasticpp.agent.jobspec import JobSpec, parse_job_spec
from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.errors import ClusterDataError
from elasticpp.cluster.records import MAX_VALUE_BYTES, GenerationRecord, KeyValue, dumps, loads
from elasticpp.errors import ConfigError
from elasticpp.plan.layout import PLAN_RECORD_FORMAT_VERSION, Layout, Plan, build_plan
from elasticpp.plan.specs import DEVICE_PRESETS, ClusterSpec, NodeSpec
from elasticpp.store.instruction import encode, node_fetches
from elasticpp.train.model.contract import ContractError
from elasticpp.train.model.families import load_entry_point
from tests.records import SECURITY_SPEC as SPEC
from tests.records import SPEC_FIELDS

FORGED_FAMILY = "subprocess:getoutput"


def _plan(spec: JobSpec = SPEC) -> Plan:
    cluster = ClusterSpec((NodeSpec("n0", 2),), DEVICE_PRESETS["cpu"])
    return build_plan(
        spec.model, cluster, Layout(1, 1, 2), global_batch=4, micro_batch=2
    ).with_generation(3)


def _from_etcd(data: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(data))  # as a record's plan comes back from etcd


def test_a_record_plan_holds_the_model_fingerprint_not_the_model() -> None:
    data = _from_etcd(SPEC.plan_record(_plan()))
    assert "model" not in data and data["model_fingerprint"] == SPEC.model_fingerprint
    assert data["format_version"] == PLAN_RECORD_FORMAT_VERSION
    assert SPEC.plan_of(data) == _plan()


def test_a_plan_made_for_another_model_or_data_is_refused() -> None:
    for change in (
        {"model": "small"},
        {"model_options": {"tie_embeddings": True}},
        {"data": "/other/corpus"},
    ):
        other = parse_job_spec({**SPEC_FIELDS, **change})
        assert other.model_fingerprint != SPEC.model_fingerprint, change
        with pytest.raises(ConfigError, match="made for the model with fingerprint"):
            SPEC.plan_of(_from_etcd(other.plan_record(_plan(other))))


def test_a_model_section_in_a_record_is_never_built() -> None:
    """The review's F4 reproduction: a record whose model names `subprocess:getoutput`.
    In the record form a model section is refused outright; in an earlier release's form it
    is read only when it is this spec's model, and the plan's model is the spec's own."""
    forged_model = {**SPEC.model.to_dict(), "family": FORGED_FAMILY, "options": {"id": 1}}
    record_form = {**_from_etcd(SPEC.plan_record(_plan())), "model": forged_model}
    with pytest.raises(ConfigError, match="carries no model section"):
        SPEC.plan_of(record_form)
    earlier = _from_etcd(_plan().to_dict())
    assert SPEC.plan_of(earlier).model is SPEC.model
    with pytest.raises(ConfigError, match=r"differs from this job spec's model.*subprocess"):
        SPEC.plan_of({**earlier, "model": forged_model})
    with pytest.raises(ConfigError, match="format_version 99"):
        SPEC.plan_of({**earlier, "format_version": 99})


def test_shared_plans_are_kept_apart_by_the_readers_fingerprint() -> None:
    data = _from_etcd(SPEC.plan_record(_plan()))
    assert SPEC.plan_of(data) is SPEC.plan_of(data)
    other = parse_job_spec({**SPEC_FIELDS, "model_options": {"tie_embeddings": True}})
    with pytest.raises(ConfigError, match="fingerprint"):
        other.plan_of(data)  # the same dict, read against another spec: not the first's plan


def test_F12_a_value_nested_to_exhaust_the_parser_is_skipped_not_raised() -> None:
    """The review's F12: `values_once([good, bad_json, deep])` raised RecursionError and
    lost the good record with it."""
    deep = '{"format_version": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(ClusterDataError, match="nested too deeply"):
        loads(deep, "a value")
    with pytest.raises(ClusterDataError, match="over"):
        loads(" " * (MAX_VALUE_BYTES + 1), "a value")
    client = ClusterClient(["127.0.0.1:1"], "j")  # never connects
    try:
        prefix = "/elasticpp/j/barriers/stopped-2/"
        good = dumps({"node_id": "good", "value": {"step": 1}, "at": 1.0})
        kvs = [
            KeyValue(prefix + "good", good, 5, 5, 0),
            KeyValue(prefix + "bad", "{not json", 6, 6, 0),
            KeyValue(prefix + "deep", deep, 7, 7, 0),
        ]
        out = client.reads.values_once(kvs, "stopped-2 arrival", lambda _n, r: r["value"])
        assert out == {"good": {"step": 1}} and client.skipped_values == 2
    finally:
        client.close()


def test_a_generation_record_nested_too_deeply_is_unreadable() -> None:
    record = GenerationRecord(1, SPEC.plan_record(_plan()), "n0", time.time())
    text = record.to_json().replace('"extra":{}', '"extra":{"x":' + "[" * 50_000 + "]" * 50_000)
    text = text[: text.rindex("}")] + "}}"
    with pytest.raises(ClusterDataError):
        GenerationRecord.from_json(text)


def test_F12_a_resume_run_longer_than_the_pieces_needed_is_refused_before_it_is_built() -> None:
    plan = _plan()
    value = _from_etcd(encode(None, plan, step=0))
    value["pieces"] = {PieceKey(u, 0, 1).filename: ["0" * 64, 1] for u in SPEC.model.units}
    value["nodes"] = ["n0"]
    value["by_node"] = {"n0": [[10**10, 0]]}  # before: a list of 10^10 pairs, then the check
    started = time.monotonic()
    with pytest.raises(ConfigError, match="bad run for n0"):
        node_fetches(value, plan, "n0")
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("entry", [FORGED_FAMILY, "os:system", "builtins:eval", "json:loads"])
def test_an_entry_point_into_the_standard_library_is_no_model(entry: str) -> None:
    with pytest.raises(ContractError, match="standard-library module"):
        load_entry_point(entry)


@pytest.mark.parametrize(
    "stored",
    ["[1]", "{}", '{"format_version": 1}', "[" * 100_000, '{"format_version": 1, "model": 3}'],
)
def test_a_job_spec_in_etcd_that_cannot_be_read_is_a_config_error(stored: str) -> None:
    with pytest.raises(ConfigError, match="job spec in etcd"):
        JobSpec.from_json(stored)


def test_the_job_keys_live_under_the_configured_prefix_and_a_bad_prefix_is_refused() -> None:
    from elasticpp.cluster.keys import JobKeys

    assert JobKeys("j").generation == "/elasticpp/j/generation"
    keys = JobKeys("j", "/elasticpp/team-a")
    assert keys.root == "/elasticpp/team-a/j/" and keys.node("n0").startswith(keys.root)
    for bad in ("", "/", "elasticpp", "/Elasticpp", "/a/../b", "/a/", "/a/b/c/d/e", "/a\n"):
        with pytest.raises(ConfigError, match="etcd prefix"):
            JobKeys("j", bad)
