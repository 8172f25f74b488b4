"""The planner stays pure: planning imports neither torch nor etcd nor grpc nor protobuf."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "etcd3", "grpc", "google.protobuf")

PROBE = """
import json, sys
import elasticpp.plan, elasticpp.cli.plan
from elasticpp.plan import ClusterSpec, load_device_spec, load_model_spec, plan, plan_all
device = load_device_spec("a100-80g")
plan(load_model_spec("gpt-13b"), ClusterSpec.uniform(4, 8, device), 256)
plan_all(load_model_spec("gpt-1.3b"), device, 8, 1, 4, 64)
heavy = %r
loaded = [m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy)]
print(json.dumps(sorted(loaded)))
"""


@pytest.mark.timeout(60)
def test_planning_imports_no_heavy_package():
    proc = subprocess.run(
        [sys.executable, "-c", PROBE % (HEAVY,)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
