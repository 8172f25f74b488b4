"""Hugging Face models under elasticpp, with `transformers` itself as the oracle: logits,
loss and one step's gradients of small random Llama (grouped-query attention) and GPT-2
(tied embeddings) models, under several layouts; import then export is bit-for-bit."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from elasticpp.checkpoint.tensors import load_units
from elasticpp.cli.main import main as cli_main
from elasticpp.plan import MODEL_PRESETS, ClusterSpec, Layout, build_plan, load_device_spec
from elasticpp.train.config import TrainConfig
from elasticpp.train.data.samples import open_corpus
from elasticpp.train.model.contract import UnitContext
from elasticpp.train.model.families import build_model
from elasticpp.train.model.hf import hf_from_units, import_hf, read_hf_state, units_from_hf
from elasticpp.train.model.hfconfig import spec_from_hf
from elasticpp.train.model.stage import Stage
from tests.workers import tiny_llama_config

HELPER = Path(__file__).resolve().parent / "helpers" / "logits_rank.py"
SEQ = 16
MODEL_UNITS_TINY = MODEL_PRESETS["tiny"].units


def _perturb_norms(model: torch.nn.Module) -> None:
    """Random norm weights and biases, so a swapped or missing one cannot go unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)


def _save(model: torch.nn.Module, path: Path) -> Path:
    _perturb_norms(model)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    llama = tiny_llama_config(rope_theta=500.0)
    llama_tied = LlamaConfig(**{**llama.to_dict(), "tie_word_embeddings": True})
    gpt2 = GPT2Config(vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=64)
    return {
        "llama": _save(LlamaForCausalLM(llama), root / "llama"),
        "llama-tied": _save(LlamaForCausalLM(llama_tied), root / "llama-tied"),
        "gpt2": _save(GPT2LMHeadModel(gpt2), root / "gpt2"),
    }


def _hf_model(path: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()  # no dropout: elasticpp's dropout is a job setting, off here
    return model


def _tokens(n: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (n, SEQ), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", ["llama", "llama-tied", "gpt2"])
def test_logits_on_one_rank_equal_transformers(hf_dirs: dict[str, Path], name: str) -> None:
    spec = spec_from_hf(hf_dirs[name], seq_len=SEQ)
    units = units_from_hf(spec, read_hf_state(hf_dirs[name]))
    model = build_model(spec)
    stage = Stage.for_stage(model, spec, ((0, spec.num_layers),), 0)
    tokens = _tokens()
    with torch.no_grad():
        ours = stage.forward(units, tokens, 0, 1, None, None)
        theirs = _hf_model(hf_dirs[name])(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _logits_under(spec_dir: Path, layout: str, tmp: Path, options: dict) -> torch.Tensor:
    spec = spec_from_hf(spec_dir, seq_len=SEQ)
    if options:
        spec = type(spec).from_dict({**spec.to_dict(), "options": {**spec.option_map, **options}})
    step_dir = tmp / "step-0000000000"
    units = units_from_hf(spec, read_hf_state(spec_dir))
    from elasticpp.train.model.hf import write_initial_step

    write_initial_step(spec, units, step_dir)
    L = Layout.parse(layout)
    plan = build_plan(
        spec,
        ClusterSpec.uniform(1, L.world_size, load_device_spec("cpu")),
        L,
        global_batch=3,
        micro_batch=3,
    )
    (tmp / "plan.json").write_text(plan.to_json())
    save_file({"tokens": _tokens()}, str(tmp / "tokens.safetensors"))
    out = tmp / "logits.safetensors"
    port = _free_port()
    files = [str(tmp / "plan.json"), str(step_dir), str(tmp / "tokens.safetensors"), str(out)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(HELPER), str(r), str(L.world_size), str(port), *files],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(L.world_size)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    return load_file(str(out))["logits"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("name", "layout", "options"),
    [
        ("llama", "pp=2,tp=2,dp=1", {}),  # TP=2 splits 4 query and 2 key/value heads
        ("llama-tied", "pp=1,tp=2,dp=1", {"vocab_parallel": True}),
        ("gpt2", "pp=2,tp=2,dp=1", {"vocab_parallel": True}),
    ],
)
def test_logits_under_a_layout_equal_transformers(
    hf_dirs: dict[str, Path], tmp_path: Path, name: str, layout: str, options: dict
) -> None:
    ours = _logits_under(hf_dirs[name], layout, tmp_path, options)
    with torch.no_grad():
        theirs = _hf_model(hf_dirs[name])(_tokens()).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def _reference_step(path: Path, data: Path, batch: int) -> tuple[float, float, dict]:
    """transformers' loss, global gradient norm and clipped gradients of step 0's batch."""
    model = _hf_model(path)
    corpus = open_corpus(TrainConfig(data=str(data), data_dtype="uint16"), SEQ, 256)
    inputs, targets = corpus.batch(0, batch)
    logits = model(inputs).logits
    per_token = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1), reduction="none")
    loss = per_token.view(batch, SEQ).mean(dim=1).mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())))
    clip = 1.0 / (norm + 1e-6) if norm > 1.0 else 1.0
    return float(loss.detach()), norm, {n: g * clip for n, g in grads.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("name", "layout", "options"),
    [
        ("llama", "pp=1,tp=1,dp=1", []),
        ("llama", "pp=2,tp=2,dp=1", []),
        ("llama-tied", "pp=2,tp=1,dp=2", ["--model-option", "vocab_parallel=true"]),
        ("gpt2", "pp=2,tp=2,dp=1", []),  # tied embeddings on different stages
    ],
)
def test_one_training_step_equals_transformers_loss_and_gradients(
    hf_dirs: dict[str, Path], tmp_path: Path, name: str, layout: str, options: list[str]
) -> None:
    data = tmp_path / "corpus.bin"  # token ids without a sidecar: --data-dtype says uint16
    ids = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1))
    ids.numpy().astype("<u2").tofile(data)
    save, metrics = tmp_path / "save", tmp_path / "metrics.jsonl"
    code = cli_main(
        [
            "train", "--model", str(hf_dirs[name]), "--seq-len", str(SEQ), "--layout", layout,
            "--global-batch", "4", "--micro-batch", "2", "--steps", "1", "--warmup-steps", "0",
            "--data", str(data), "--data-dtype", "uint16",
            "--save", str(save), "--metrics", str(metrics), *options,
        ]
    )  # fmt: skip
    assert code == 0
    row = json.loads(metrics.read_text().splitlines()[0])
    loss, norm, grads = _reference_step(hf_dirs[name], data, 4)
    assert row["loss"] == pytest.approx(loss, rel=1e-5)
    assert row["grad_norm"] == pytest.approx(norm, rel=1e-4)
    # AdamW's first moment after one step is (1 - beta1) * the clipped gradient.
    spec = spec_from_hf(hf_dirs[name], seq_len=SEQ)
    loaded = load_units(save / "step-0000000001", spec.units, 0, 1)
    moments = {
        u: {
            n.removeprefix("exp_avg/"): t / 0.1
            for n, t in got.tensors.items()
            if n.startswith("exp_avg/")
        }
        for u, got in loaded.items()
    }
    ours = hf_from_units(spec, moments)
    assert set(ours) <= set(grads)
    for hf_name, g in ours.items():
        torch.testing.assert_close(g, grads[hf_name], rtol=1e-3, atol=1e-6, msg=hf_name)


@pytest.mark.parametrize("name", ["llama", "llama-tied", "gpt2"])
def test_import_then_export_is_bit_exact_and_loads_in_transformers(
    hf_dirs: dict[str, Path], tmp_path: Path, name: str
) -> None:
    step_dir = tmp_path / "ckpt" / "step-0000000000"
    import_hf(hf_dirs[name], step_dir, seq_len=SEQ)
    out = tmp_path / "out"
    assert cli_main(["export", str(tmp_path / "ckpt"), "--hf", str(out)]) == 0
    original, exported = read_hf_state(hf_dirs[name]), read_hf_state(out)
    assert sorted(exported) == sorted(original)
    for key, t in original.items():
        assert torch.equal(exported[key], t), key
    reloaded = _hf_model(out)
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, _hf_model(hf_dirs[name])(tokens).logits)


def test_export_refuses_a_non_empty_target_and_writes_nothing(
    hf_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import_hf(hf_dirs["llama"], tmp_path / "ckpt" / "step-0000000000", seq_len=SEQ)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli_main(["export", str(tmp_path / "ckpt"), "--hf", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_export_refuses_a_manifest_that_names_code_and_runs_nothing(
    hf_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint is data: a manifest whose model names `package.module:function` (here
    the security review's F4 family, `subprocess:getoutput`) is not imported by export;
    the user names a model of theirs with `--model`."""
    step_dir = tmp_path / "ckpt" / "step-0000000000"
    import_hf(hf_dirs["llama"], step_dir, seq_len=SEQ)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    marker = tmp_path / "PWNED.txt"
    manifest["model"]["family"] = "subprocess:getoutput"
    manifest["model"]["options"] = {f"echo FORGED > {marker}": 1}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "out"
    assert cli_main(["export", str(tmp_path / "ckpt"), "--hf", str(out)]) == 2
    assert "names the model code 'subprocess:getoutput'" in capsys.readouterr().err
    assert not marker.exists() and not out.exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope"),
        ({"architectures": ["BertModel"]}, "supported are"),
    ],
)
def test_configurations_elasticpp_would_train_wrongly_are_refused(
    hf_dirs: dict[str, Path], tmp_path: Path, change: dict, message: str
) -> None:
    cfg = json.loads((hf_dirs["llama"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(Exception, match=message):
        spec_from_hf(tmp_path)


def test_vocabulary_parallel_cross_entropy_gathers_to_the_whole() -> None:
    ctx = UnitContext("head", 0, 1, None, 256, None)
    logits = torch.randn(2, SEQ, 256)
    assert torch.equal(ctx.gather_vocab(logits), logits)


@pytest.mark.timeout(300)
def test_init_from_an_elasticpp_checkpoint_starts_a_new_job_from_its_weights(
    tmp_path: Path,
) -> None:
    common = ["--model", "tiny", "--global-batch", "4", "--micro-batch", "2"]
    first = ["train", *common, "--steps", "2", "--save", str(tmp_path / "a")]
    assert cli_main([*first, "--layout", "pp=2,tp=1,dp=1"]) == 0
    second = ["train", *common, "--steps", "5", "--stop-at", "0", "--lr", "3e-4"]
    second += ["--init-from", str(tmp_path / "a"), "--save", str(tmp_path / "b")]
    assert cli_main([*second, "--layout", "pp=1,tp=2,dp=1"]) == 0
    units = MODEL_UNITS_TINY
    trained = load_units(tmp_path / "a" / "step-0000000002", units, 0, 1)
    started = load_units(tmp_path / "b" / "step-0000000000", units, 0, 1)
    for unit in units:
        assert started[unit].step == 0
        for name, t in trained[unit].tensors.items():
            if name.startswith("param/"):
                assert torch.equal(started[unit].tensors[name], t), (unit, name)
            else:  # a new job: fresh optimizer state
                assert not started[unit].tensors[name].any(), (unit, name)
