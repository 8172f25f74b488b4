"""The model families users bring, with `transformers` itself as the oracle: Llama 3.x rotary
scaling, Llama with attention biases, Qwen2 (q/k/v biases, tied embeddings), Qwen3 (per-head
q/k norms, a head_dim other than hidden/heads) and Mistral (a sliding window as long as the
sequence). Small random models built here: logits on one rank, one training step's loss,
gradients and updated weights under a layout that is both tensor- and pipeline-parallel,
import then export bit for bit; and the configurations elasticpp would train wrongly are
refused, naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from elasticpp.checkpoint.tensors import load_units
from elasticpp.cli.main import main as cli_main
from elasticpp.errors import ConfigError
from elasticpp.train.config import TrainConfig
from elasticpp.train.data.samples import open_corpus
from elasticpp.train.model.families import build_model
from elasticpp.train.model.families.llama import Llama3Scaling, inverse_frequencies
from elasticpp.train.model.hf import hf_from_units, import_hf, read_hf_state, units_from_hf
from elasticpp.train.model.hfconfig import spec_from_hf
from elasticpp.train.model.stage import Stage

SEQ = 16
VOCAB = 256
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so that the 8 frequencies of a 16-wide head fall in all three bands.
    "original_max_position_embeddings": 32,
}


def _shape(**changes: Any) -> dict[str, Any]:
    """Two layers (one per pipeline stage at pp=2), 4 query and 2 key/value heads."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        **changes,
    }


def _perturb(model: torch.nn.Module) -> None:
    """Random norm weights and biases, so a swapped or missing one cannot go unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)


MODELS = {
    "llama3": lambda: LlamaForCausalLM(LlamaConfig(**_shape(rope_parameters=dict(LLAMA3)))),
    "llama-bias": lambda: LlamaForCausalLM(LlamaConfig(**_shape(attention_bias=True))),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_shape(tie_word_embeddings=True))),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_shape(head_dim=32))),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_shape(sliding_window=SEQ))),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for i, (name, make) in enumerate(MODELS.items()):
        torch.manual_seed(i)
        model = make()
        _perturb(model)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def _hf_model(path: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()  # no dropout: elasticpp's dropout is a job setting, off here
    return model


def _tokens(n: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize(
    ("head_dim", "theta", "factor", "low", "high", "original"),
    [(16, 10000.0, 8.0, 1.0, 4.0, 32), (64, 500000.0, 32.0, 1.0, 4.0, 8192)],
)
def test_llama3_inverse_frequencies_equal_transformers(
    head_dim: int, theta: float, factor: float, low: float, high: float, original: int
) -> None:
    cfg = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=4 * original,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        },
    )
    theirs, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    assert attention_scaling == 1.0  # nothing to scale the cos/sin by
    scaling = Llama3Scaling(factor, low, high, original)
    ours = inverse_frequencies(head_dim, theta, scaling, torch.device("cpu"))
    plain = inverse_frequencies(head_dim, theta, None, torch.device("cpu"))
    assert not torch.equal(ours, plain)  # the scaling does something at these sizes
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", list(MODELS))
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


def _reference_step(path: Path, data: Path, batch: int) -> tuple[float, float, dict]:
    """transformers' loss, global gradient norm and clipped gradients of step 0's batch."""
    model = _hf_model(path)
    corpus = open_corpus(TrainConfig(data=str(data), data_dtype="uint16"), SEQ, VOCAB)
    inputs, targets = corpus.batch(0, batch)
    logits = model(inputs).logits
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    loss = per_token.view(batch, SEQ).mean(dim=1).mean()
    loss.backward()
    # A tied head is not a parameter of its own here: its gradient is in the embedding's.
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())))
    clip = 1.0 / (norm + 1e-6) if norm > 1.0 else 1.0
    return float(loss.detach()), norm, {n: g * clip for n, g in grads.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(MODELS))
def test_one_training_step_under_tp_and_pp_equals_transformers(
    hf_dirs: dict[str, Path], tmp_path: Path, name: str
) -> None:
    """pp=2, tp=2: q/k/v (and their biases) split by heads, the blocks on two stages, a
    tied head on another stage than its embedding (qwen2)."""
    data = tmp_path / "corpus.bin"  # token ids without a sidecar: --data-dtype says uint16
    ids = torch.randint(0, VOCAB, (4096,), generator=torch.Generator().manual_seed(1))
    ids.numpy().astype("<u2").tofile(data)
    save, metrics = tmp_path / "save", tmp_path / "metrics.jsonl"
    lr, wd, eps = 1e-3, 0.1, 1e-8
    code = cli_main(
        [
            "train", "--model", str(hf_dirs[name]), "--seq-len", str(SEQ),
            "--layout", "pp=2,tp=2,dp=1", "--global-batch", "4", "--micro-batch", "2",
            "--steps", "1", "--warmup-steps", "0", "--lr", str(lr), "--min-lr", str(lr),
            "--data", str(data), "--data-dtype", "uint16",
            "--save", str(save), "--metrics", str(metrics),
        ]
    )  # fmt: skip
    assert code == 0
    row = json.loads(metrics.read_text().splitlines()[0])
    loss, norm, grads = _reference_step(hf_dirs[name], data, 4)
    assert row["loss"] == pytest.approx(loss, rel=1e-5)
    assert row["grad_norm"] == pytest.approx(norm, rel=1e-4)
    spec = spec_from_hf(hf_dirs[name], seq_len=SEQ)
    saved = load_units(save / "step-0000000001", spec.units, 0, 1)

    def kind(prefix: str) -> dict[str, dict[str, torch.Tensor]]:
        return {
            u: {n.removeprefix(prefix): t for n, t in got.tensors.items() if n.startswith(prefix)}
            for u, got in saved.items()
        }

    # AdamW's first moment after one step is (1 - beta1) * the clipped gradient.
    first_moments = kind("exp_avg/")
    moments = hf_from_units(
        spec, {u: {n: t / 0.1 for n, t in m.items()} for u, m in first_moments.items()}
    )
    assert set(moments) <= set(grads)
    for hf_name, g in moments.items():
        torch.testing.assert_close(g, grads[hf_name], rtol=1e-3, atol=1e-6, msg=hf_name)
    # The updated weights: one AdamW step from zero moments moves each weight by
    # lr * g / (|g| + eps) after decaying matrices by lr * wd.
    before = units_from_hf(spec, read_hf_state(hf_dirs[name]))
    ref_grads = units_from_hf(spec, grads)
    after = kind("param/")
    for unit in build_model(spec).units:
        for p in unit.params:
            w, g = before[unit.name][p.name], ref_grads[unit.name][p.name]
            want = w * (1 - lr * wd) if p.weight_decay else w.clone()
            want -= lr * g / (g.abs() + eps)
            got = after[unit.name][p.name]
            # Where the reference gradient is at rounding level (a key bias, whose gradient
            # is zero in exact arithmetic) its sign is noise: only the step's size is known.
            sure = g.abs() > 1e-6
            where = f"{unit.name}/{p.name}"
            torch.testing.assert_close(got[sure], want[sure], rtol=0, atol=1e-6, msg=where)
            assert (got - want).abs().max() <= 2 * lr + 1e-6, where


@pytest.mark.parametrize("name", list(MODELS))
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
    config = json.loads((out / "config.json").read_text())
    source = json.loads((hf_dirs[name] / "config.json").read_text())
    assert config["architectures"] == source["architectures"]
    assert config["rope_parameters"] == source["rope_parameters"]
    reloaded, first = _hf_model(out), _hf_model(hf_dirs[name])
    assert type(reloaded) is type(first)
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, first(tokens).logits)
    again, spec = spec_from_hf(out, seq_len=SEQ), spec_from_hf(hf_dirs[name], seq_len=SEQ)
    assert again.options == spec.options  # every option survives the round trip


def _rope(**changes: Any) -> dict[str, Any]:
    return {"rope_parameters": {**LLAMA3, **changes}}


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("llama3", _rope(rope_type="yarn"), r"rope_parameters = .*yarn.* \(rope_type default"),
        ("llama3", _rope(rope_type="linear"), "rope_parameters"),
        ("llama3", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "factor"),
        ("llama3", _rope(partial_rotary_factor=0.5), "partial_rotary_factor"),
        ("llama3", _rope(mscale=2.0), "unknown key.*mscale"),
        ("llama3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ("llama-bias", {"attention_bias": "qkv"}, "attention_bias = 'qkv'"),
        ("llama-bias", {"mlp_bias": True}, "mlp_bias"),
        ("llama-bias", {"attention_dropout": 0.1}, "attention_dropout"),
        ("llama-bias", {"quantization_config": {"bits": 4}}, "quantization_config"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
        ("qwen2", {"attention_bias": True}, "attention_bias"),  # Qwen2 has no such key
        ("qwen3", {"layer_types": ["chunked_attention"] * 2}, "layer_types"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act"),
        ("mistral", {"sliding_window": SEQ - 1}, f"sliding_window = {SEQ - 1} .*seq_len {SEQ}"),
    ],
)
def test_configurations_elasticpp_would_train_wrongly_are_refused_naming_the_key(
    hf_dirs: dict[str, Path], tmp_path: Path, name: str, change: dict, message: str
) -> None:
    cfg = json.loads((hf_dirs[name] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ConfigError, match=message):
        spec_from_hf(tmp_path, seq_len=SEQ)


def test_a_llama3_config_of_transformers_4_reads_as_the_same_model(
    hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Hub checkpoints of Llama 3.x say `rope_scaling` (with `rope_type` or `type`) and a
    top-level `rope_theta`; transformers 5 writes `rope_parameters`."""
    cfg = json.loads((hf_dirs["llama3"] / "config.json").read_text())
    rope = {k: v for k, v in cfg.pop("rope_parameters").items() if k != "rope_theta"}
    rope["type"] = rope.pop("rope_type")
    (tmp_path / "config.json").write_text(
        json.dumps({**cfg, "rope_scaling": rope, "rope_theta": LLAMA3["rope_theta"]})
    )
    old, new = spec_from_hf(tmp_path, seq_len=SEQ), spec_from_hf(hf_dirs["llama3"], seq_len=SEQ)
    assert old.options == new.options
    assert old.option_map["rope_type"] == "llama3"


def test_a_mistral_window_is_refused_when_the_sequence_outgrows_it(
    hf_dirs: dict[str, Path],
) -> None:
    assert spec_from_hf(hf_dirs["mistral"], seq_len=SEQ).option_map["sliding_window"] == SEQ
    with pytest.raises(ConfigError, match="sliding_window"):
        spec_from_hf(hf_dirs["mistral"], seq_len=SEQ + 1)
    with pytest.raises(ConfigError, match="sliding_window"):
        spec_from_hf(hf_dirs["mistral"])  # seq_len defaults to max_position_embeddings
    # A spec whose sequence grew after it was read is refused by the family itself.
    spec = spec_from_hf(hf_dirs["mistral"], seq_len=SEQ).with_seq_len(2 * SEQ)
    with pytest.raises(ConfigError, match="option sliding_window 16 is shorter than seq_len 32"):
        build_model(spec)
