"""CPU of a few processes over time, to tell what a window of a run used (bench/scale.py:
the CPU from the leader's decision until the last node held the plan, and how many of the
machine's cores that was, which says whether the hold waited for CPU or for something else).

A thread reads each process's user + system time from /proc every `every_s`; `used` gives
the CPU seconds between two monotonic instants, interpolated between the samples around
each (Linux accounts CPU in clock ticks, 10 ms by default: a window's figure is good to a
tick or two per process).
"""

from __future__ import annotations

import bisect
import os
import threading
import time


def proc_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process `pid` has used; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def at(samples: list[tuple[float, float]], t: float) -> float | None:
    """The CPU seconds at monotonic `t`, linear between the samples around it; None outside
    the samples (nothing measured then)."""
    if not samples or t < samples[0][0] or t > samples[-1][0]:
        return None
    i = bisect.bisect_left(samples, (t, float("-inf")))
    if samples[i][0] == t or i == 0:
        return samples[i][1]
    (t0, c0), (t1, c1) = samples[i - 1], samples[i]
    return c0 + (c1 - c0) * (t - t0) / (t1 - t0)


class CpuSampler:
    """Samples the CPU of processes `pids` (by name) every `every_s` on a thread of its own."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.02) -> None:
        self._pids = dict(pids)
        self._every_s = every_s
        self._lock = threading.Lock()
        self._samples: dict[str, list[tuple[float, float]]] = {name: [] for name in pids}
        self._stop = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        for name, pid in self._pids.items():
            cpu = proc_cpu_s(pid)
            if cpu is not None:
                now = time.monotonic()
                with self._lock:
                    self._samples[name].append((now, cpu))

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self._sample()

    def used(self, name: str, t0: float, t1: float) -> float | None:
        """CPU seconds process `name` used from monotonic `t0` to `t1`; None if not sampled
        over the whole window."""
        with self._lock:
            samples = list(self._samples[name])
        a, b = at(samples, t0), at(samples, t1)
        return None if a is None or b is None else b - a

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
