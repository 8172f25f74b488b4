"""`elasticpp job whatif --nodes N`: what the leader would plan for N nodes, from a spec file
(here; from the spec in etcd: tests/integration/test_cli_job.py), with the planner call the
leader makes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from elasticpp.agent.jobspec import load_job_spec
from elasticpp.cli import main as cli_main
from elasticpp.plan import ClusterSpec
from elasticpp.plan.search import plan as plan_layout

pytestmark = pytest.mark.timeout(60)
SPEC = (
    "name: llm\nmodel: gpt-1.3b\nglobal_batch: 64\nmicro_batch: 2\nsteps: 10\nseed: 0\n"
    "min_nodes: 2\nmax_nodes: 4\ndevice: a100-80g\n"
)


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(SPEC)
    return path


def _whatif(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli_main.main(["job", "whatif", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("nodes", [2, 3, 4])
def test_whatif_prints_what_the_leaders_planner_chooses(
    capsys: pytest.CaptureFixture[str], spec: Path, nodes: int
) -> None:
    code, out, _ = _whatif(capsys, "--spec", str(spec), "--slots", "8", "--nodes", str(nodes),
                           "-o", "json")  # fmt: skip
    assert code == 0
    got = json.loads(out)
    job = load_job_spec(spec)
    best = plan_layout(
        job.model, ClusterSpec.uniform(nodes, 8, job.device_spec()), 64, micro_batch=2, top_k=0
    ).candidates[0]
    assert {k: got[k] for k in best.to_dict()} == best.to_dict()
    assert got["grad_accumulation"] == list(best.microbatches)
    assert sum(got["grad_accumulation"]) * got["micro_batch"] == 64
    assert (got["nodes"], got["planned_nodes"], got["spare_nodes"], got["gpus"]) == (
        nodes, nodes, 0, 8 * nodes,
    )  # fmt: skip


def test_whatif_past_max_nodes_plans_max_nodes_and_counts_spares(
    capsys: pytest.CaptureFixture[str], spec: Path
) -> None:
    args = ["--spec", str(spec), "--slots", "8"]
    _, at_max, _ = _whatif(capsys, *args, "--nodes", "4", "-o", "yaml")
    _, past, _ = _whatif(capsys, *args, "--nodes", "6", "-o", "yaml")
    a, b = yaml.safe_load(at_max), yaml.safe_load(past)
    assert (b["planned_nodes"], b["spare_nodes"]) == (4, 2)
    assert {k: v for k, v in b.items() if k not in ("nodes", "spare_nodes")} == {
        k: v for k, v in a.items() if k not in ("nodes", "spare_nodes")
    }
    code, table, _ = _whatif(capsys, *args, "--nodes", "6")
    assert code == 0 and "4 planned x 8 slots, 2 spare" in table
    assert f"pp={b['pp']} tp={b['tp']} dp={b['dp']}" in table and "est. step time" in table


@pytest.mark.parametrize(
    "args, why",
    [
        (["--nodes", "1", "--slots", "8"], "below the job's min_nodes 2"),
        (["--nodes", "2"], "--slots is needed with --spec"),
    ],
)
def test_whatif_refuses_what_it_cannot_answer_with_exit_2(
    capsys: pytest.CaptureFixture[str], spec: Path, args: list[str], why: str
) -> None:
    code, out, err = _whatif(capsys, "--spec", str(spec), *args)
    assert code == 2 and out == "" and why in err


def test_a_spec_file_is_planned_without_etcd_whatever_the_etcd_flags(
    capsys: pytest.CaptureFixture[str], spec: Path
) -> None:
    # ELASTICPP_ETCD set in an operator's shell must not send `--spec` to etcd.
    code, out, err = _whatif(capsys, "--spec", str(spec), "--slots", "8", "--nodes", "2",
                             "--etcd", "127.0.0.1:1", "--name", "other", "-o", "json")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["job"] == "llm"


def test_whatif_needs_a_spec_or_a_job_in_etcd(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _whatif(capsys, "--nodes", "2")
    assert code == 2 and "--spec FILE, or --etcd and --name" in err
