"""`elasticpp job ...` run as an operator runs it, against a LocalCluster's etcd (the tests
of job stop, checkpoint, cordon and events)."""

from __future__ import annotations

import subprocess
import sys

from elasticpp.agent.localcluster import LocalCluster


def job(
    lc: LocalCluster, *args: str, name: str = "llm", timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """`elasticpp job <args> --etcd <lc's> --name <name>`, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "elasticpp.cli.main", "job", *args, "--etcd", lc.etcd.endpoint,
         "--name", name],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
