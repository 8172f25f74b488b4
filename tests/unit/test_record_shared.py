"""`GenerationRecord.shared`: one parsed record for equal text in a process (every agent of a
simulated process parsed and checked the O(N) record itself: O(N^2) a process), a bounded
memo, bad text refused every time; and `Plan.shared` answers the same dict again without
serialising it (the plan of a shared record)."""

from __future__ import annotations

import json

import pytest

from elasticpp.cluster.errors import ClusterDataError
from elasticpp.cluster.records import SHARED_RECORDS, GenerationRecord
from elasticpp.plan import Plan
from elasticpp.plan import layout as layout_mod
from tests.records import record_of as _record_of


def test_equal_text_gives_one_record_object() -> None:
    text = _record_of(["n0", "n1"], 8).to_json()
    first = GenerationRecord.shared(text)
    again = GenerationRecord.shared("".join(text))  # another string, equal: another agent's
    assert again is first
    assert first == GenerationRecord.from_json(text)
    other = _record_of(["n0", "n1", "n2"], 8).to_json()
    assert GenerationRecord.shared(other) is not first
    assert GenerationRecord.shared(text.encode()) == first  # bytes read as the same record


def test_the_memo_keeps_the_newest_records_only() -> None:
    texts = [GenerationRecord(g, {}, "n0", 1.0).to_json() for g in range(1, SHARED_RECORDS + 2)]
    records = [GenerationRecord.shared(t) for t in texts]
    assert GenerationRecord.shared(texts[-1]) is records[-1]
    assert GenerationRecord.shared(texts[0]) is not records[0]  # the oldest was let go
    assert GenerationRecord.shared(texts[0]) == records[0]


def test_a_bad_record_is_refused_every_time() -> None:
    bad = json.dumps({"format_version": 1, "generation": 0, "plan": {}, "leader": "n1"})
    for _ in range(2):
        with pytest.raises(ClusterDataError, match="generation must be"):
            GenerationRecord.shared(bad)


def test_the_plan_of_a_shared_record_is_not_serialised_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    record = GenerationRecord.shared(_record_of(["n0", "n1"], 8).to_json())
    plan = Plan.shared(record.plan)
    dumps: list[int] = []
    real = json.dumps

    def counted(*args: object, **kwargs: object) -> str:
        dumps.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(layout_mod.json, "dumps", counted)
    assert Plan.shared(record.plan) is plan
    assert dumps == []  # the same dict: answered by identity
    copy = json.loads(real(record.plan))
    assert Plan.shared(copy) is plan  # an equal dict: by its serialised form, as before
    assert dumps == [1]


def test_the_planned_nodes_as_a_set_are_made_once_per_record() -> None:
    record = GenerationRecord.shared(_record_of(["n2", "n0", "n1"], 8).to_json())
    assert record.planned_set == frozenset(record.planned_nodes) == {"n0", "n1", "n2"}
    assert record.planned_set is record.planned_set
