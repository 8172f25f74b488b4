"""The security review's findings, each replayed against a live agent (a real etcd, a real
agent process with its workers, real gRPC on loopback) as the review reproduced it: every
test here failed before its fix.

One job runs for the whole module (a long one: it is stopped when the module ends); the
tests act on it one after the other and each leaves it training.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.localcluster import LocalCluster
from elasticpp.cluster import ClusterClient
from elasticpp.cluster.etcd_client import EtcdKV
from elasticpp.cluster.records import GenerationRecord
from elasticpp.proctree import descendants
from tests.integration.test_agent_recovery import scrape

SPEC: dict[str, Any] = {
    "name": "secjob",
    "model": "tiny",
    "global_batch": 4,
    "micro_batch": 2,
    "steps": 100_000,
    "seed": 0,
    "min_nodes": 1,
    "max_nodes": 2,
    "lease_ttl_s": 3,
    "snapshot_every": 10,
    "replication_copies": 0,
}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    lc = LocalCluster(tmp_path_factory.mktemp("sec") / "job", SPEC, nodes=1, slots=1)
    try:
        lc.start()
        lc.wait_for(lambda: lc.max_step() >= 2, 120, "step 2")
        yield lc
    finally:
        lc.close()
        left = list(descendants(os.getpid()))
        assert not left, f"processes left behind: {left}"


def _generation(lc: LocalCluster) -> tuple[GenerationRecord, str]:
    with ClusterClient([lc.etcd.endpoint], SPEC["name"]) as c:
        record, _ = c.read_generation()
        assert record is not None
        return record, c.keys.generation


def _skipped(lc: LocalCluster) -> float:
    return scrape(lc.nodes[0].metrics_port).get("elasticpp_etcd_values_skipped_total", 0.0)


def _trains_on(lc: LocalCluster, past_step: int, timeout_s: float = 120) -> None:
    lc.wait_for(lambda: lc.max_step() > past_step, timeout_s, f"a step after {past_step}")


@pytest.mark.timeout(240)
def test_F4_a_forged_plan_naming_code_is_refused_and_nothing_it_names_runs(
    job: LocalCluster, tmp_path: Path
) -> None:
    """The review's F4: one anonymous etcd write of a plan whose model family is
    `subprocess:getoutput` ran a shell command in a worker. Now every node builds the model
    of its own job spec: the forged record is skipped and counted, the leader writes over it
    (blaming nobody), and training goes on; the command never runs."""
    marker = tmp_path / "PWNED.txt"
    current, key = _generation(job)
    skipped_before = _skipped(job)
    # An earlier release's form, the model spelled out (the review's reproduction) ...
    spelled = copy.deepcopy(current.plan)
    spelled.pop("model_fingerprint", None)
    spelled["format_version"] = 2
    spelled["model"] = {
        **json.loads(json.dumps(_tiny_model())),
        "family": "subprocess:getoutput",
        "options": {f"echo FORGED > {marker}": 1},
    }
    # ... and the record form with a model section added and another fingerprint.
    other = {**copy.deepcopy(current.plan), "model_fingerprint": "0" * 64}
    other["model"] = spelled["model"]
    raw = EtcdKV([job.etcd.endpoint])
    try:
        generation = current.generation
        for plan in (spelled, other):
            generation += 1
            forged = json.loads(current.to_json())
            forged["generation"] = generation
            forged["plan"] = {**plan, "generation": generation}
            forged["extra"]["reason"] = "forged by an etcd writer"
            raw.put(key, json.dumps(forged))

            def superseded(g: int = generation) -> bool:
                return _generation(job)[0].generation > g

            job.wait_for(superseded, 60, f"the leader to write over forged generation {generation}")
            record, _ = _generation(job)
            assert "refused" in record.extra["reason"], record.extra
            generation = record.generation
    finally:
        raw.close()
    _trains_on(job, job.max_step())
    assert not marker.exists(), marker.read_text()
    assert _skipped(job) > skipped_before
    log = job.nodes[0].log_path.read_text()
    assert "ContractError" not in log  # no worker was handed the forged model
    assert f"etcd value of {key} skipped" in log
    with ClusterClient([job.etcd.endpoint], SPEC["name"]) as c:
        assert not c.quarantined(), "a healthy node was blamed for a forged record"


def _tiny_model() -> dict[str, Any]:
    from elasticpp.plan.specs import MODEL_PRESETS

    return MODEL_PRESETS["tiny"].to_dict()

