"""The CPU sampler of the scale bench (bench/cpusample.py): interpolation between samples,
and a real process's CPU over a window."""

from __future__ import annotations

import os
import time

from bench.cpusample import CpuSampler, at


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
        time.sleep(0.05)  # a sample before the window
        t0 = time.monotonic()
        end = time.thread_time() + 0.3
        while time.thread_time() < end:  # 0.3 s of CPU on this thread
            pass
        t1 = time.monotonic()
        time.sleep(0.05)  # and one after it
        used = sampler.used("me", t0, t1)
        assert used is not None and 0.2 <= used <= 0.3 + (t1 - t0)
        assert sampler.used("me", t1 + 60.0, t1 + 61.0) is None  # not sampled yet
    finally:
        sampler.close()


def test_a_windows_cpu_by_kind_of_thread_comes_from_the_samples_around_it() -> None:
    import threading

    from bench.scaleproc import ThreadSampler

    sampler = ThreadSampler(every_s=0.01)
    try:
        spans: list[float] = []
        done = threading.Event()

        def busy() -> None:
            time.sleep(0.05)  # a sample before
            spans.append(time.monotonic())
            end = time.thread_time() + 0.2
            while time.thread_time() < end:
                pass
            spans.append(time.monotonic())
            done.wait()  # alive until sampled after (the live threads are sampled)

        worker = threading.Thread(target=busy, name="busy-7")
        worker.start()
        while len(spans) < 2:
            time.sleep(0.01)
        time.sleep(0.05)  # a sample after
        used = sampler.window(spans[0], spans[1])
        done.set()
        worker.join()
        assert 0.15 <= used.get("busy-#", 0.0) <= 0.2 + (spans[1] - spans[0])
        assert sampler.window(spans[1] + 60.0, spans[1] + 61.0) == {}  # not sampled yet
    finally:
        sampler.close()
