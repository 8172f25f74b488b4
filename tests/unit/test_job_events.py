"""`elasticpp job events`' pure parts: the time `--since` takes, a timeline read as a recovery
event (one without its numbers is left out, not misread), and what `--follow` reports as
ended between two reads. End to end against real agents: tests/integration/test_job_cordon.py."""

from __future__ import annotations

import argparse
import time

import pytest

from elasticpp.cli import flagtypes
from elasticpp.cluster.events import JobEvent, _recovery, gone


def test_since_takes_a_duration_back_from_now_or_an_iso_time() -> None:
    now = time.time()
    assert abs(flagtypes.since("10m") - (now - 600)) < 5
    assert abs(flagtypes.since("1.5h") - (now - 5400)) < 5
    assert flagtypes.since("2026-12-04T19:00:00Z") == flagtypes.since("2026-12-04T19:00:00")
    assert flagtypes.since("2026-12-04T20:00:00+01:00") == flagtypes.since("2026-12-04T19:00:00")
    for bad in ("yesterday", "-5m", "m", "nanm", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="duration back from now"):
            flagtypes.since(bad)


def test_a_timeline_is_a_recovery_event_at_its_end_and_one_without_numbers_is_left_out() -> None:
    timeline = {
        "generation": 4, "reason": "lost node(s) n3", "resume_step": 120, "steps_recomputed": 2,
        "detected_at": 1000.0, "planned_s": 0.1, "stopped_s": 0.2, "moved_s": 0.5,
        "resumed_s": 1.25,
    }  # fmt: skip
    event = _recovery(timeline)
    assert event is not None and event.at == 1001.25 and event.generation == 4
    assert "resumed at step 120 1.25 s after the detection" in event.message
    assert "2 step(s) recomputed: lost node(s) n3" in event.message
    assert _recovery({**timeline, "resumed_s": "soon"}) is None
    assert _recovery({k: v for k, v in timeline.items() if k != "detected_at"}) is None


def test_follow_reports_a_lifted_quarantine_and_a_removed_cordon_once_gone() -> None:
    q = JobEvent(10.0, "quarantine", "node a quarantined", node="a", key="a@10.0")
    c = JobEvent(11.0, "cordon", "node b cordoned", node="b", key="b@11.0")
    g = JobEvent(12.0, "generation", "generation 2", generation=2, key="2")
    before = {e.identity: e for e in (q, c, g)}
    ended = gone(before, [g], 20.0)
    assert [(e.kind, e.node, e.at) for e in ended] == [
        ("lifted", "a", 20.0), ("uncordoned", "b", 20.0)
    ]  # fmt: skip
    assert gone(before, [q, c, g], 20.0) == []
