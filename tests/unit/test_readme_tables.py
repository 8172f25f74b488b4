"""The README's tables against the code: every metric an agent exports is in the metrics
table, and the table names no metric the agent does not export."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import generate_latest

from elasticpp.agent.metrics import AgentMetrics

README = Path(__file__).resolve().parents[2] / "README.md"


def _table_after(heading: str) -> str:
    text = README.read_text()
    section = text.split(heading, 1)[1]
    return section.split("\n\n|", 1)[1].split("\n\n", 1)[0]


def test_the_metrics_table_lists_exactly_the_metrics_an_agent_exports() -> None:
    # (prometheus_client's own `<counter>_created` series are not the agent's metrics.)
    exported = {
        name
        for name in re.findall(
            r"^# TYPE (\S+) ",
            generate_latest(AgentMetrics.create("n0", "job").registry).decode(),
            re.M,
        )
        if not name.endswith("_created")
    }
    listed = set(re.findall(r"^\| `(elasticpp_[a-z_]+)", _table_after("\n## Metrics\n"), re.M))
    assert exported - listed == set(), "exported, not in the README's table"
    assert listed - exported == set(), "in the README's table, not exported"
