"""Pure parts of the cluster layer: the key layout and the records. No etcd."""

from __future__ import annotations

import json

import pytest

from elasticpp.cluster.errors import ClusterDataError
from elasticpp.cluster.keys import JobKeys, last_segment, prefix_end
from elasticpp.cluster.records import (
    GenerationRecord,
    GenerationSummary,
    incarnation_tag,
    loads,
)
from elasticpp.errors import ConfigError
from elasticpp.plan import ClusterSpec, Layout, NodeSpec, build_plan, load_model_spec
from elasticpp.plan.specs import DEVICE_PRESETS
from tests.records import record_of as _record_of


def test_key_layout_is_under_one_job_root_and_refuses_slashes() -> None:
    keys = JobKeys("job-a")
    assert keys.node("n1") == "/elasticpp/job-a/nodes/n1"
    assert keys.leader == "/elasticpp/job-a/leader"
    assert keys.generation_history(12) == "/elasticpp/job-a/generations/000000000012"
    assert keys.commit(3, "n1") == "/elasticpp/job-a/commits/000000000003/n1"
    assert keys.barrier("gen3-stopped", "n2") == "/elasticpp/job-a/barriers/gen3-stopped/n2"
    assert last_segment(keys.node("n7")) == "n7"
    assert prefix_end("/a/") == "/a0"
    with pytest.raises(ConfigError, match="node_id"):
        keys.node("a/b")
    with pytest.raises(ConfigError, match="job"):
        JobKeys("")


def test_generation_record_round_trips_as_versioned_json() -> None:
    record = GenerationRecord(
        generation=4,
        plan={"layout": {"pp": 2}},
        leader="n1",
        created_at=1.5,
        resume_step=17,
        store_address="127.0.0.1:9",
        extra={"reason": "node n3 lost"},
    )
    text = record.to_json()
    assert json.loads(text)["format_version"] == 1
    assert GenerationRecord.from_json(text) == record


def test_records_of_unknown_format_or_bad_fields_are_refused() -> None:
    with pytest.raises(ClusterDataError, match="format_version"):
        loads(json.dumps({"format_version": 99}), "x")
    with pytest.raises(ClusterDataError, match="not JSON"):
        loads("{", "x")
    bad = json.dumps({"format_version": 1, "generation": 0, "plan": {}, "leader": "n1"})
    with pytest.raises(ClusterDataError, match="generation"):
        GenerationRecord.from_json(bad)
    missing = json.dumps({"format_version": 1, "generation": 1, "plan": {}})
    with pytest.raises(ClusterDataError, match="bad field"):
        GenerationRecord.from_json(missing)


def _full_record(generation: int) -> GenerationRecord:
    nodes = [f"n{i}" for i in range(3)]
    cluster = ClusterSpec(tuple(NodeSpec(n, 4) for n in nodes), DEVICE_PRESETS["h100-80g"])
    plan = build_plan(
        load_model_spec("tiny"), cluster, Layout(2, 2, 3), global_batch=6, micro_batch=1
    )
    return GenerationRecord(
        generation=generation,
        plan=plan.with_generation(generation).to_dict(),
        leader="n0",
        created_at=12.5,
        resume_step=40,
        store_address="10.0.0.1:7070",
        extra={
            "reason": "lost n3",
            "nodes": {n: f"{n}:7070" for n in nodes},
            "sources": {n: f"{n}:7070" for n in nodes},
            "incarnations": dict.fromkeys(nodes, "abc"),
            "previous_layout": "pp=2,tp=2,dp=4",
        },
    )


def test_the_history_summary_keeps_who_when_layout_nodes_and_why() -> None:
    record = _full_record(7)
    summary = GenerationSummary.of(record)
    assert summary == GenerationSummary(
        7, "n0", 12.5, "pp=2,tp=2,dp=3", 3, "lost n3", "pp=2,tp=2,dp=4"
    )
    text = summary.to_json()
    assert "plan" not in json.loads(text) and "sources" not in text
    assert len(text) < len(record.to_json()) / 4
    assert GenerationSummary.from_json(text) == summary


def test_a_full_copy_written_as_history_by_an_earlier_release_reads_as_its_summary() -> None:
    record = _full_record(5)
    assert GenerationSummary.from_json(record.to_json()) == GenerationSummary.of(record)
    bare = GenerationRecord(2, {"layout": {"pp": 2}}, "n1", 1.0)  # nothing to summarise
    assert GenerationSummary.from_json(bare.to_json()) == GenerationSummary(2, "n1", 1.0, "", 0)


def test_a_history_summary_with_bad_fields_is_refused() -> None:
    good = json.loads(GenerationSummary.of(_full_record(3)).to_json())
    for field, value, match in [
        ("generation", 0, "generation 0"),
        ("nodes", -1, "nodes -1"),
        ("nodes", True, "nodes True"),
    ]:
        with pytest.raises(ClusterDataError, match=match):
            GenerationSummary.from_json(json.dumps({**good, field: value}))
    del good["layout"]
    with pytest.raises(ClusterDataError, match=r"bad field.*layout"):
        GenerationSummary.from_json(json.dumps(good))


def test_a_generation_record_names_its_nodes_through_the_plan_and_tags_their_incarnations() -> None:
    nodes = ["n2", "n0", "n1"]
    record = GenerationRecord.from_json(_record_of(nodes, 8).to_json())
    # The plan's nodes by first rank, then the one planned without a rank (a spare).
    assert record.planned_nodes == ("n2", "n0", "n1")
    assert record.extra["spares"] == ["n1"] and "nodes" not in record.extra
    assert record.incarnation_tags == {n: incarnation_tag(f"inc-{n}") for n in nodes}
    assert all(len(t) == 4 for t in record.incarnation_tags.values())
    assert GenerationSummary.of(record).nodes == 3
    # A planned node whose member key holds another incarnation restarted; absent: not so.
    members = {n: {"incarnation": f"inc-{n}"} for n in nodes}
    assert record.reregistered(members) == set()
    members["n0"] = {"incarnation": "inc-new"}
    del members["n1"]
    assert record.reregistered({**members, "n9": {"incarnation": "x"}}) == {"n0"}


def test_a_record_of_an_earlier_release_with_per_node_maps_still_reads() -> None:
    old = _full_record(4)
    record = GenerationRecord.from_json(old.to_json())
    assert record.planned_nodes == ("n0", "n1", "n2")
    assert record.incarnation_tags == dict.fromkeys(("n0", "n1", "n2"), incarnation_tag("abc"))
    assert record.reregistered({"n1": {"incarnation": "abc"}, "n2": {"incarnation": "d"}}) == {"n2"}


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("incarnations", "AAAA", "incarnations must be 4 characters for each of the 3"),
        ("incarnations", 17, "incarnations must be"),
        ("spares", "n1", "spares must be node ids"),
    ],
)
def test_a_record_whose_node_fields_do_not_add_up_is_refused_naming_them(
    field: str, value: object, match: str
) -> None:
    text = _record_of(["n0", "n1", "n2"], 8, **{field: value}).to_json()
    with pytest.raises(ClusterDataError, match=match):
        GenerationRecord.from_json(text)


def test_a_record_of_an_unknown_format_is_refused_by_name() -> None:
    data = json.loads(_record_of(["n0", "n1"], 8).to_json())
    with pytest.raises(ClusterDataError, match="format_version 2 not supported"):
        GenerationRecord.from_json(json.dumps({**data, "format_version": 2}))
