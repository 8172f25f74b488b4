"""`ELASTICPP_PROFILE_DIR`: torch's profiler over two steps of a worker (see `StepProfile`)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("elasticpp.train.worker")


class StepProfile:
    """`ELASTICPP_PROFILE_DIR=DIR`: torch's profiler over two steps of every rank (the third
    and fourth it trains, past the warm-up), its table of operators by device time written to
    `DIR/rank-R.txt` and its trace to `DIR/rank-R.json`. Off (a no-op) without the variable."""

    FIRST, COUNT = 2, 2

    def __init__(self, directory: Path | None, rank: int, start_step: int) -> None:
        self.directory, self.rank = directory, rank
        self.first = start_step + self.FIRST
        self._prof: Any = None

    @classmethod
    def from_env(cls, rank: int, start_step: int) -> StepProfile:
        value = os.environ.get("ELASTICPP_PROFILE_DIR")
        return cls(Path(value) if value else None, rank, start_step)

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        if self.directory is None or not self.first <= step < self.first + self.COUNT:
            yield
            return
        import torch.profiler as tp

        if self._prof is None:
            kinds = [tp.ProfilerActivity.CPU]
            if torch_cuda_available():
                kinds.append(tp.ProfilerActivity.CUDA)
            self._prof = tp.profile(activities=kinds, record_shapes=True)
            self._prof.__enter__()
        yield
        if step == self.first + self.COUNT - 1:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            self.directory.mkdir(parents=True, exist_ok=True)
            sort = "self_cuda_time_total" if torch_cuda_available() else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=60)
            (self.directory / f"rank-{self.rank}.txt").write_text(table, encoding="utf-8")
            prof.export_chrome_trace(str(self.directory / f"rank-{self.rank}.json"))
            log.info(
                "rank %d: profile of steps %d-%d in %s", self.rank, self.first, step, self.directory
            )


def torch_cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())
