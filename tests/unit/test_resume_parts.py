"""The resume instruction's pieces table in parts (`barriers.split_resume` / `join_resume`):
what the client writes reads back as the instruction the leader made, and an instruction
whose parts are missing or mixed up is refused, never used with a partial table."""

from __future__ import annotations

import json

import pytest

from elasticpp.cluster.arrivals import resume_records
from elasticpp.cluster.barriers import (
    RESUME_MEMBER,
    RESUME_PART_BYTES,
    check_arrival,
    join_resume,
    resume_part_member,
    split_resume,
)
from elasticpp.cluster.errors import ClusterDataError


def _instruction(pieces: int) -> dict[str, object]:
    return {
        "format_version": 2,
        "step": 7,
        "pieces": {f"block.{i:04d}.tp{i % 8}": [f"{i:064x}", 1000 + i] for i in range(pieces)},
        "reshard": {},
        "reshard_by_node": {},
        "nodes": ["n0", "n1"],
        "by_node": {"n1": [[3, 0]]},
        "infos_by_node": {},
    }


def _read_back(records: list[tuple[str, str]]) -> dict[str, object]:
    # As ClusterClient.barrier_state does: each member checked, then the parts joined.
    members = {}
    for member, record in records:
        members[member] = check_arrival("resume-4", member, json.loads(record)["value"])
    return join_resume(members, RESUME_MEMBER)


@pytest.mark.parametrize("pieces", [3, 700, 5000])
def test_what_is_written_reads_back_as_the_instruction(pieces: int) -> None:
    value = _instruction(pieces)
    records = resume_records(value, "n0", 1.0)
    assert all(len(r) <= RESUME_PART_BYTES + 4096 for _, r in records)
    assert (len(records) > 1) == (pieces > 100)
    assert _read_back(records) == {RESUME_MEMBER: value}


def test_a_small_table_stays_in_the_instruction() -> None:
    main, parts = split_resume(_instruction(3))
    assert parts == [] and "pieces_parts" not in main


def test_a_missing_or_foreign_part_is_refused() -> None:
    records = resume_records(_instruction(5000), "n0", 1.0)
    assert len(records) >= 3
    members = {m: json.loads(r)["value"] for m, r in records}
    without = {m: v for m, v in members.items() if m != resume_part_member(1)}
    with pytest.raises(ClusterDataError, match="part 1 of"):
        join_resume(without, RESUME_MEMBER)
    swapped = dict(members)
    swapped[resume_part_member(0)] = members[resume_part_member(1)]
    with pytest.raises(ClusterDataError, match="part 0 of"):
        join_resume(swapped, RESUME_MEMBER)


def test_a_part_of_the_wrong_shape_is_refused_by_the_barrier_check() -> None:
    with pytest.raises(ClusterDataError, match="pieces must be an object"):
        check_arrival("resume-4", resume_part_member(0), {"part": 0, "of": 2, "pieces": []})
