"""The engine's gradient buckets, its AdamW kernel and its step timer, on their own."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elasticpp.train.engine.buckets import GradReducer, assign_buckets
from elasticpp.train.engine.kernels import AdamW, PhaseTimer, set_tf32

BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1


def test_buckets_take_parameters_in_reverse_order_up_to_the_cap() -> None:
    sizes = [40, 10, 10, 30, 100, 5]
    kinds = ["f32"] * 6
    assert assign_buckets(sizes, kinds, 50) == [[5], [4], [3, 2, 1], [0]]
    # Every parameter exactly once, in reverse order of declaration.
    for cap in (1, 20, 50, 1000):
        flat = [i for b in assign_buckets(sizes, kinds, cap) for i in b]
        assert flat == list(reversed(range(6)))
    assert assign_buckets(sizes, kinds, 10**6) == [[5, 4, 3, 2, 1, 0]]


def test_a_bucket_holds_one_kind_of_tensor() -> None:
    kinds = ["f32", "f32", "bf16", "f32"]
    assert assign_buckets([1, 1, 1, 1], kinds, 100) == [[3], [2], [1, 0]]
    with pytest.raises(ValueError, match="bucket cap"):
        assign_buckets([1], ["f32"], 0)


class _Work:
    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> None:
        self.waited = True


def test_reducer_launches_buckets_in_order_once_final_and_only_in_the_last_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launched: list[tuple[int, bool]] = []  # (bucket's buffer, was c's gradient final then)
    works: list[_Work] = []
    c_final = [False]

    def fake_all_reduce(t: torch.Tensor, group: Any = None, async_op: bool = False) -> _Work:
        assert group == "dp" and async_op
        launched.append((t.data_ptr(), c_final[0]))
        works.append(_Work())
        return works[-1]

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    a, b, c, unused = (torch.ones(4, requires_grad=True) for _ in range(4))
    # One parameter per bucket: buckets [unused], [c], [b], [a].
    reducer = GradReducer([a, b, c, unused], "dp", cap_bytes=16)
    c.register_post_accumulate_grad_hook(lambda _: c_final.__setitem__(0, True))

    def backward() -> None:
        # c is used first, so backward finishes its gradient last: bucket 1 is final after
        # buckets 2 and 3, and waits for them no longer than for bucket 0 (never final).
        y = c * 2
        ((y * a).sum() + (b * 3).sum()).backward()

    reducer.zero_grad()
    backward()  # a first micro-batch: accumulates, launches nothing
    assert launched == []
    reducer.arm()
    backward()
    # Bucket 0 (the unused parameter) never becomes final, so nothing may launch out of order.
    assert launched == []
    reducer.finish()
    order = [buf.data_ptr() for buf in reducer.buffers]
    assert [ptr for ptr, _ in launched] == order
    assert all(w.waited for w in works)
    # Gradients accumulated in place in the buckets: two micro-batches, twice one's.
    assert torch.equal(a.grad, torch.full((4,), 4.0)) and torch.equal(b.grad, torch.full((4,), 6.0))
    assert a.grad.data_ptr() == reducer.buffers[3].data_ptr()

    # Without the unused parameter, every bucket launches from a hook, each once final.
    launched.clear()
    reducer.remove_hooks()
    reducer = GradReducer([a, b, c], "dp", cap_bytes=16)
    reducer.zero_grad()
    reducer.arm()
    c_final[0] = False
    backward()
    assert [ptr for ptr, _ in launched] == [buf.data_ptr() for buf in reducer.buffers]
    assert launched[0][1]  # c's bucket left only once c's gradient was final
    reducer.finish()
    assert len(launched) == 3


def _reference_adamw(
    params: list[torch.Tensor],
    m1s: list[torch.Tensor],
    m2s: list[torch.Tensor],
    decay: list[bool],
    grads: list[torch.Tensor],
    lr: float,
    clip: float,
    t: int,
) -> None:
    """The engine's per-parameter AdamW loop before torch's kernels replaced it."""
    b1, b2 = BETAS
    bias1 = 1 - b1**t
    bias2_sqrt = math.sqrt(1 - b2**t)
    with torch.no_grad():
        for p, m1, m2, d, gr in zip(params, m1s, m2s, decay, grads, strict=True):
            if clip != 1.0:
                gr = gr * clip
            if d:
                p.mul_(1 - lr * WEIGHT_DECAY)
            m1.mul_(b1).add_(gr, alpha=1 - b1)
            m2.mul_(b2).addcmul_(gr, gr, value=1 - b2)
            denom = (m2.sqrt() / bias2_sqrt).add_(EPS)
            p.addcdiv_(m1, denom, value=-lr / bias1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_torch_adamw_follows_the_reference_loop_over_many_steps(fused: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (256, 64), (7,)]
    decay = [True, False, True, False]
    start = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    ref = [t.clone() for t in start]
    ref_m1 = [torch.zeros_like(t) for t in start]
    ref_m2 = [torch.zeros_like(t) for t in start]
    got = [t.clone().requires_grad_(True) for t in start]
    m1 = [torch.zeros_like(t) for t in start]
    m2 = [torch.zeros_like(t) for t in start]
    opt = AdamW(
        got, m1, m2, decay, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, step=0, fused=fused
    )
    assert opt.fused == fused
    for t in range(1, 51):
        grads = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]
        lr, clip = 1e-3 * (0.5 + 0.5 * math.cos(t / 50)), (0.5 if t % 3 == 0 else 1.0)
        _reference_adamw(ref, ref_m1, ref_m2, decay, [g.clone() for g in grads], lr, clip, t)
        opt.step([g.clone() for g in grads], lr, clip)
    # torch's kernels round differently (a lerp for the first moment; the fused kernel's own
    # decay): over these 50 steps, measured 1.5e-8 on parameters of size 0.02 (about 8 ulps)
    # and 2.8e-9 on first moments of size 9e-3, fused or foreach, on CPU.
    for a, b in zip(ref, got, strict=True):
        assert torch.allclose(b.detach(), a, rtol=0, atol=1e-7)
    # The moments updated are the caller's own tensors (what snapshots read).
    for a, b in zip(ref_m1, m1, strict=True):
        assert torch.allclose(b, a, rtol=0, atol=2e-8)
    for a, b in zip(ref_m2, m2, strict=True):
        assert torch.allclose(b, a, rtol=0, atol=1e-10)


def test_adamw_resumes_the_bias_correction_from_the_step_it_is_given() -> None:
    p = torch.ones(4, requires_grad=True)
    m1, m2 = torch.full((4,), 0.01), torch.full((4,), 1e-4)
    ref, ref_m1, ref_m2 = p.detach().clone(), m1.clone(), m2.clone()
    opt = AdamW([p], [m1], [m2], [False], betas=BETAS, eps=EPS, weight_decay=0.0, step=7)
    g = torch.full((4,), 0.02)
    opt.step([g.clone()], 1e-2)
    _reference_adamw([ref], [ref_m1], [ref_m2], [False], [g.clone()], 1e-2, 1.0, 8)
    assert torch.allclose(p.detach(), ref, rtol=0, atol=1e-7)


def test_adamw_refuses_moments_or_flags_that_do_not_match_its_parameters() -> None:
    """A missing moment or flag would leave a parameter out of every update, silently."""
    p = [torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)]
    m = [torch.zeros(2), torch.zeros(3)]
    with pytest.raises(ValueError, match="2 parameters, 2 and 1 moments, 2 decay flags"):
        AdamW(p, m, m[:1], [True, False], betas=BETAS, eps=EPS, weight_decay=0.0, step=0)
    with pytest.raises(ValueError, match="1 decay flags"):
        AdamW(p, m, m, [True], betas=BETAS, eps=EPS, weight_decay=0.0, step=0)


def test_phase_timer_sums_each_phases_spans_on_the_injected_clock() -> None:
    now = [0.0]
    timer = PhaseTimer(torch.device("cpu"), clock=lambda: now[0])
    timer.start("pipeline")
    for _ in range(3):
        with timer.span("busy"):
            now[0] += 0.5
        now[0] += 1.0  # waiting for a neighbour
    timer.stop("pipeline")
    assert timer.seconds("busy") == pytest.approx(1.5)
    assert timer.seconds("pipeline") == pytest.approx(4.5)
    assert timer.seconds("never") == 0.0


def test_tf32_is_left_alone_off_cuda() -> None:
    before = torch.backends.cuda.matmul.allow_tf32
    assert set_tf32(torch.device("cpu"), "fp32") is False
    assert torch.backends.cuda.matmul.allow_tf32 == before
