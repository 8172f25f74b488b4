"""The whole path a user takes, under the agent: a Llama exported from `transformers`
(grouped-query attention), a token file made by `elasticpp data prepare` with a tokenizer
trained here, an elastic job with `model: DIR` that loses a node, and the loss curve of the
uninterrupted `elasticpp train` run of the same job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM

from elasticpp.agent.localcluster import LocalCluster
from elasticpp.cli.main import main as cli_main
from elasticpp.cluster.client import ClusterClient
from elasticpp.proctree import descendants
from tests.recovery import RECOVERY_SPEC as AGENT_SPEC
from tests.workers import tiny_llama_config

STEPS = 12
SEQ = 16
TEXT = Path(__file__).resolve().parents[2] / "docs"  # the project's own docs as a corpus


@pytest.fixture(scope="module")
def job_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("user-job")
    docs = sorted(TEXT.glob("*.md"))
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"], show_progress=False)
    tok.train([str(d) for d in docs], trainer)
    assert tok.get_vocab_size() <= 256  # the model's vocabulary
    tok.save(str(root / "tokenizer.json"))
    corpus = root / "corpus.bin"
    code = cli_main(
        ["data", "prepare", "--tokenizer", str(root / "tokenizer.json"), "--out", str(corpus)]
        + [str(d) for d in docs]
    )
    assert code == 0
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(root / "llama")
    return {"model": root / "llama", "data": corpus}


def _spec(files: dict[str, Path]) -> dict[str, Any]:
    return {
        "name": "user-job",
        "model": str(files["model"]),
        "seq_len": SEQ,
        "data": str(files["data"]),
        "data_dtype": "uint16",
        "global_batch": 12,
        "micro_batch": 2,
        "steps": STEPS,
        "seed": 3,
        "min_nodes": 1,
        "max_nodes": 3,
        "lease_ttl_s": 3,
        "join_settle_s": 0.5,
        "hang_timeout_s": 6,
        # Latency-free slots, so the planner picks tensor-parallel layouts and the recovery
        # moves TP-sliced state of the grouped-query attention.
        "device": AGENT_SPEC["device"],
    }


@pytest.fixture
def cluster(tmp_path: Path, job_files: dict[str, Path]) -> Iterator[LocalCluster]:
    lc = LocalCluster(tmp_path / "job", _spec(job_files), nodes=3, slots=2)
    try:
        yield lc
    finally:
        lc.close()
        left = list(descendants(os.getpid()))
        assert not left, f"processes left behind: {left}"


def _reference(files: dict[str, Path], out: Path) -> dict[int, float]:
    done = subprocess.run(
        [
            sys.executable, "-m", "elasticpp.cli.main", "train", "--model", str(files["model"]),
            "--seq-len", str(SEQ), "--data", str(files["data"]), "--data-dtype", "uint16",
            "--layout", "pp=1,tp=1,dp=1", "--global-batch", "12", "--micro-batch", "2",
            "--steps", str(STEPS), "--seed", "3", "--metrics", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return {int(r["step"]): float(r["loss"]) for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.timeout(300)
def test_a_hugging_face_llama_on_prepared_tokens_survives_a_node_loss_on_its_curve(
    cluster: LocalCluster, job_files: dict[str, Path], tmp_path: Path
) -> None:
    reference = _reference(job_files, tmp_path / "reference.jsonl")
    cluster.start()
    cluster.wait_for(lambda: cluster.max_step() >= 3, 120, "step 3")
    with ClusterClient([cluster.etcd.endpoint], "user-job") as c:
        leader = c.leader()
    victim = next(n.node_id for n in cluster.nodes if n.node_id != leader)
    cluster.kill_node(victim)
    cluster.wait_finished(200)
    curve = cluster.curve()
    assert sorted(curve) == list(range(STEPS)), sorted(curve)
    for step, (loss, _gen) in curve.items():
        assert loss == pytest.approx(reference[step], rel=1e-4), step
    timelines = cluster.timelines()
    assert any(victim in str(t["reason"]) or "failure" in str(t["reason"]) for t in timelines)
    layouts = {str(t.get("layout_after")) for t in timelines}
    assert any("tp=2" in layout for layout in layouts), layouts  # GQA heads were split
