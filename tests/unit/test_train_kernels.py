"""The engine's gradient buckets, on their own."""

from __future__ import annotations

import pytest

from elasticpp.train.buckets import assign_buckets


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
