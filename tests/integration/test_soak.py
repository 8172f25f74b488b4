"""A short soak in CI: the kinds `bench/soak.py` can inject here, once each (but for those
below), drawn in a seeded order against a 3-node job. Every fault must be survived, the loss
curve must be its own layouts' replayed without faults (and near the uninterrupted run's,
`bench/soak.py`), no committed step (the published safe step at the
moment of a fault) may be lost and no process left behind. The long soak (100+ faults) is
`python bench/soak.py`.

The full disk and the network partition need root, nftables and cgroup v2 (a tmpfs per
node, a firewall rule on one node's cgroup); where those are missing they are not drawn,
and a failure's report says so.

The kinds whose recovery waits out a long timer, and which a test of their own already runs
end to end on the reference curve, are left to those tests and to `python bench/soak.py`
(which draws every kind): the sick-node kinds (a node restarted sick, set aside, trained
without, healed; a minute or more each: test_agent_sick.py), worker_hang (the hang timeout:
test_a_hung_worker_is_detected_and_the_job_recovers) and etcd_outage_worker_death (etcd down
6 s: test_a_worker_failure_seen_while_etcd_is_down_is_reported_when_it_returns). For the
same reason the run stops once the job is steady after its last fault, the curve compared
over the steps trained by then: the room the job keeps for faults (60 steps each) is not
trained out. A job's end after recoveries is what every test in test_agent_recovery.py checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import KINDS, SICK_KINDS, run_soak, table, unavailable

# Run end to end by tests of their own (see above); `python bench/soak.py` draws them too.
OWN_TESTS = (*SICK_KINDS, "worker_hang", "etcd_outage_worker_death")


def _kinds() -> list[str]:
    return [k for k in KINDS if unavailable(k) is None and k not in OWN_TESTS]


@pytest.mark.timeout(1200)
def test_a_short_soak_survives_every_fault_kind_once_on_the_reference_curve(
    tmp_path: Path,
) -> None:
    kinds = _kinds()
    faults = len(kinds)
    lines: list[str] = []
    result = run_soak(
        tmp_path,
        faults=faults,
        seed=1,
        nodes=3,
        slots=1,
        kinds=kinds,
        finish=False,
        log=lines.append,
    )
    left_out = sorted(set(KINDS) - set(kinds))
    report = "\n".join([*lines, table(result), f"kinds left out here: {left_out or 'none'}"])
    print(report)  # the harness's log, with -s
    assert len(result.faults) == faults, report
    assert {f.kind for f in result.faults} == set(kinds), report
    assert all(f.survived for f in result.faults), report
    assert result.curve_ok, f"{result.curve_errors}\n{report}"
    assert result.layout_runs >= 2, report  # a recovery's resume was replayed
    assert result.lost_steps == 0, report
    assert not result.leftover_processes, report
