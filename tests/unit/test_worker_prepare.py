"""A warm worker pays every import before it says ready: after `prepare`, an assignment's
optimizer and update import nothing. And the optimizer never imports torch's compiler stack:
a `torch.optim.Optimizer` does when it is built, which cost every rank of every new
generation 3-7 s of its start on a busy 2-core machine (the "state_s" of its started
event)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys
{prepare}
import torch
from elasticpp.train.engine.kernels import AdamW
before = set(sys.modules)
w = torch.zeros(4, 4, requires_grad=True)
(w * 2.0).sum().backward()
opt = AdamW([w], [torch.zeros_like(w)], [torch.zeros_like(w)], [True],
            betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, step=7)
opt.step([w.grad], lr=1e-3)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _new_modules(prepare: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(prepare=prepare)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return list(json.loads(proc.stdout.splitlines()[-1]))


def test_after_prepare_the_optimizer_and_its_update_import_nothing() -> None:
    assert _new_modules("from elasticpp.train.worker.main import prepare; prepare(False)") == []


def test_the_optimizer_does_not_import_torchs_compiler_even_unprepared() -> None:
    new = _new_modules("import elasticpp.train.engine.trainer")
    assert not [m for m in new if m.startswith("torch._dynamo")], new
