"""The CPU samplers of the scale bench (bench/cpusample.py, bench/scaleproc.ThreadSampler):
interpolation between samples, and a real thread's CPU over a window. Each sampler takes a
sample when it starts, so a window that begins after that has one before it; the sample
after a window is waited for, with a deadline."""

from __future__ import annotations

import os
import threading
import time

from bench.cpusample import CpuSampler, at
from bench.scaleproc import ThreadSampler
from elasticpp.waiting import wait_until


def _burn(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_cpu_at_an_instant_is_interpolated_between_the_samples_around_it() -> None:
    samples = [(1.0, 10.0), (2.0, 10.5), (4.0, 11.5)]
    assert at(samples, 1.0) == 10.0
    assert at(samples, 1.5) == 10.25
    assert at(samples, 2.0) == 10.5
    assert at(samples, 3.0) == 11.0
    assert at(samples, 0.5) is None and at(samples, 4.5) is None and at([], 1.0) is None


def test_a_busy_window_of_this_process_is_measured_and_an_unsampled_one_is_not() -> None:
    sampler = CpuSampler({"me": os.getpid()}, every_s=0.01)
    try:
        t0 = time.monotonic()
        _burn(0.3)  # 0.3 s of CPU on this thread
        t1 = time.monotonic()
        assert wait_until(lambda: sampler.used("me", t0, t1) is not None, 10.0, interval_s=0.01)
        used = sampler.used("me", t0, t1)
        assert used is not None and 0.2 <= used <= 0.3 + (t1 - t0)
        assert sampler.used("me", t1 + 60.0, t1 + 61.0) is None  # not sampled yet
    finally:
        sampler.close()


def test_a_windows_cpu_by_kind_of_thread_comes_from_the_samples_around_it() -> None:
    sampler = ThreadSampler(every_s=0.01)
    spans: list[float] = []
    measured, done = threading.Event(), threading.Event()

    def busy() -> None:
        spans.append(time.monotonic())
        _burn(0.2)
        spans.append(time.monotonic())
        measured.set()
        done.wait(30)  # alive until sampled after (the live threads are sampled)

    worker = threading.Thread(target=busy, name="busy-7")
    try:
        worker.start()
        assert measured.wait(30)
        assert wait_until(lambda: "busy-#" in sampler.window(*spans), 10.0, interval_s=0.01)
        used = sampler.window(*spans)
        assert 0.15 <= used["busy-#"] <= 0.2 + (spans[1] - spans[0])
        assert sampler.window(spans[1] + 60.0, spans[1] + 61.0) == {}  # not sampled yet
    finally:
        done.set()
        worker.join()
        sampler.close()
