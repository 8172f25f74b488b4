"""Model FLOPs of a training step, and the peak a device reaches: what model TFLOP/s and MFU
(`elasticpp_model_tflops`, `elasticpp_mfu`, bench/gpu.py) are computed from. Pure Python.

The count (`forward_flops`, per token; a training step is 3x its forward):

- A weight matrix of `n` entries applied to a token costs `2n` FLOPs forward (a multiply-add
  is 2) and `4n` backward (the gradients of its input and of its weight): `6n` in all. Every
  matrix of the blocks counts, and the LM head (tied to the embedding or not: it is a matmul).
- An embedding lookup counts 0 (it gathers rows); norms, activations, softmax, rotary
  embeddings, dropout and the loss count 0: model FLOPs are the matmuls'.
- Attention's two matmuls (scores `Q K^T`, their use `P V`) cost `4 s q` FLOPs per token and
  layer forward at full width (`s` the sequence length, `q` = heads x head_dim), twice that
  backward, and are **counted as the kernel computes them**. elasticpp's blocks call
  `scaled_dot_product_attention(..., is_causal=True)`, which runs a fused kernel on every
  device elasticpp trains on: flash attention under bf16 on CUDA (FlashAttention-2's or
  cuDNN's), the memory-efficient kernel under fp32 on CUDA, and torch's flash kernel for
  CPU. Each of them skips the key blocks above the diagonal, so causal attention counts
  half: `2 s q` per token and layer forward (`CAUSAL_ATTENTION_COMPUTED`). Only the math
  kernel computes the masked half; it runs where no fused kernel applies, and is not
  elasticpp's path. (The diagonal blocks a kernel computes whole are not counted: a few
  percent of attention at `s` = 2048.)
- Activation recomputation is not counted: MFU counts the model's FLOPs, not the hardware's.
- A user's model (a `ModelSpec` with `numbers`) counts the forward FLOPs its units declare
  (`Unit.flops_per_token`, by default 2 per entry of its weight matrices, with attention
  only where the unit declares it); its opening units count 0, as embeddings.

The peak (`device_peak_tflops`): dense (no sparsity) TFLOP/s by the GPU's name as
`torch.cuda.get_device_name()` gives it, and the matmul dtype (bf16/fp16; tf32, which
elasticpp's fp32 runs use on CUDA; fp32). A name the table does not know has no peak: MFU is
then reported only under a job's `peak_tflops`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from elasticpp.errors import ConfigError
from elasticpp.plan.layout import Plan
from elasticpp.plan.specs import ModelSpec

# Share of causal attention's scores a fused (flash, memory-efficient) kernel computes.
CAUSAL_ATTENTION_COMPUTED = 0.5
TRAIN_PASSES = 3.0  # forward + backward (twice the forward)


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs per token of a model's units (`train_per_token` is a step's)."""

    num_layers: int
    block_matmul: float  # one block's weight matmuls (the mean block of a declared model)
    block_attention: float  # one block's scores and values, as the kernel computes them
    last: float  # the closing units: the LM head
    first: float = 0.0  # the opening units: embedding lookups

    @property
    def block(self) -> float:
        return self.block_matmul + self.block_attention

    @property
    def per_token(self) -> float:
        return self.first + self.num_layers * self.block + self.last

    @property
    def train_per_token(self) -> float:
        """FLOPs of one token's forward and backward through the whole model."""
        return TRAIN_PASSES * self.per_token

    def stage_per_token(self, blocks: int, is_first: bool, is_last: bool) -> float:
        """Forward FLOPs per token of a pipeline stage of `blocks` blocks."""
        return (
            blocks * self.block
            + (self.first if is_first else 0.0)
            + (self.last if is_last else 0.0)
        )


def forward_flops(
    model: ModelSpec, attention_computed: float = CAUSAL_ATTENTION_COMPUTED
) -> ForwardFlops:
    """The forward FLOPs per token of `model`'s units (the module docstring says what
    counts). `attention_computed`: the share of the `s x s` scores the attention kernel
    computes (1.0: the math kernel, or a planner that ignores the mask)."""
    if model.numbers is not None:
        n = model.numbers
        return ForwardFlops(model.num_layers, n.block_flops_per_token, 0.0, n.last_flops_per_token)
    h, f, s, v = model.hidden_size, model.ffn_hidden_size, model.seq_len, model.vocab_size
    q = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    mlp_mats = 3 if model.gated_mlp else 2
    matrices = 2 * h * q + 2 * h * kv + mlp_mats * h * f  # q and o; k and v; the MLP
    return ForwardFlops(
        num_layers=model.num_layers,
        block_matmul=2.0 * matrices,
        block_attention=4.0 * s * q * attention_computed,
        last=2.0 * h * v,
    )


def step_flops(model: ModelSpec, global_batch: int) -> float:
    """Model FLOPs of one training step of `global_batch` samples of `seq_len` tokens."""
    return forward_flops(model).train_per_token * global_batch * model.seq_len


def rank_step_flops(plan: Plan, rank: int, flops: ForwardFlops | None = None) -> float:
    """The model FLOPs rank `rank` computes in a step of `plan`: its stage's units over its
    replica's samples, a `1/tp` share of each (a layer that every tensor-parallel rank
    computes whole, as an LM head that is not vocabulary-split, is still counted once over
    the ranks). Summed over the ranks: `step_flops`."""
    f = forward_flops(plan.model) if flops is None else flops
    coord = plan.slot(rank).coord
    first, end = plan.stages[coord.pp]
    per_token = f.stage_per_token(end - first, coord.pp == 0, coord.pp == plan.pp - 1)
    tokens = plan.microbatches[coord.dp] * plan.micro_batch * plan.model.seq_len
    return TRAIN_PASSES * per_token * tokens / plan.tp


def node_step_flops(plan: Plan, node_id: str) -> float:
    """The model FLOPs the ranks of `plan` on node `node_id` compute in a step."""
    f = forward_flops(plan.model)
    return sum(rank_step_flops(plan, s.rank, f) for s in plan.ranks_on(node_id))


# --- peaks

# Matmul dtypes of the peak table, and the one each `TrainConfig.precision` runs its
# matmuls in on CUDA (fp32 precision allows TF32 there: elasticpp.train.engine.kernels.set_tf32).
DTYPES = ("bf16", "fp16", "tf32", "fp32")
PRECISION_DTYPE = {"bf16": "bf16", "fp32": "tf32"}


@dataclass(frozen=True)
class DevicePeak:
    """Dense TFLOP/s of one GPU model (NVIDIA's data sheets; no 2:4 sparsity)."""

    name: str
    bf16: float  # fp16 is the same on these GPUs
    tf32: float
    fp32: float

    def tflops(self, dtype: str) -> float:
        return self.bf16 if dtype == "fp16" else float(getattr(self, dtype))


# Matched on the words of the CUDA device name, in order: the first entry whose words are all
# in the name wins ("NVIDIA H100 PCIe" before "NVIDIA H100 80GB HBM3"; "L40S" is not "L40").
PEAKS: tuple[tuple[tuple[str, ...], DevicePeak], ...] = (
    (("H100", "PCIE"), DevicePeak("H100 PCIe", 756.0, 378.0, 51.2)),
    (("H100", "NVL"), DevicePeak("H100 NVL", 835.0, 418.0, 60.0)),
    (("H100",), DevicePeak("H100 SXM", 989.0, 495.0, 67.0)),
    (("H800", "PCIE"), DevicePeak("H800 PCIe", 756.0, 378.0, 51.2)),
    (("H800",), DevicePeak("H800 SXM", 989.0, 495.0, 67.0)),
    (("H200", "NVL"), DevicePeak("H200 NVL", 835.0, 418.0, 60.0)),
    (("H200",), DevicePeak("H200 SXM", 989.0, 495.0, 67.0)),
    (("GH200",), DevicePeak("GH200", 989.0, 495.0, 67.0)),
    (("A100",), DevicePeak("A100", 312.0, 156.0, 19.5)),  # 40 and 80 GB, SXM and PCIe
    (("A800",), DevicePeak("A800", 312.0, 156.0, 19.5)),
    (("L40S",), DevicePeak("L40S", 362.0, 183.0, 91.6)),
    (("L40",), DevicePeak("L40", 181.0, 90.5, 90.5)),
    (("L4",), DevicePeak("L4", 121.0, 60.0, 30.3)),
    (("A10",), DevicePeak("A10", 125.0, 62.5, 31.2)),  # not the A10G: its own figures
)


def device_peak(device_name: str) -> DevicePeak | None:
    """The table's entry for a CUDA device name, or None."""
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for needed, peak in PEAKS:
        if all(w in words for w in needed):
            return peak
    return None


def device_peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak of one device of that name for a job of `precision` (bf16 or fp32),
    or None where the table does not know the device."""
    peak = device_peak(device_name)
    if peak is None or precision not in PRECISION_DTYPE:
        return None
    return peak.tflops(PRECISION_DTYPE[precision])


def slot_peak(
    override_tflops: float | None, device_name: str, precision: str
) -> tuple[float | None, str]:
    """The peak TFLOP/s of one training slot, and a sentence saying where it comes from (or
    why there is none): the job spec's `peak_tflops`, else the table for a CUDA device. A
    CPU slot has no peak unless the job declares one."""
    if override_tflops is not None:
        return float(override_tflops), f"peak {override_tflops:g} TFLOP/s a slot (job spec)"
    if device_name in ("", "cpu"):
        return None, "CPU slots have no peak to measure MFU against (job spec: peak_tflops)"
    peak = device_peak(device_name)
    value = device_peak_tflops(device_name, precision)
    if peak is None or value is None:
        return None, (
            f"no peak known for {device_name!r} ({precision}): give the job spec's peak_tflops"
        )
    dtype = PRECISION_DTYPE[precision]
    return value, f"peak {value:g} TFLOP/s a slot ({peak.name}, dense {dtype})"


def check_peak_tflops(value: object, owner: str) -> float | None:
    """A job spec's `peak_tflops`: None or a positive finite number."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{owner}: peak_tflops must be a positive number or null, got {value!r}")
    return float(value)
