"""The tables of the README and the docs against the code: every metric an agent exports is
in the metrics table (docs/metrics.md), and the table names no metric the agent does not
export; the agent's flags table (docs/usage.md) lists its flags exactly, the README's
commands table every command, and the output paragraph (docs/usage.md) every command that
takes `-o`."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from prometheus_client import generate_latest

from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
USAGE = ROOT / "docs" / "usage.md"
METRICS = ROOT / "docs" / "metrics.md"


def _table_after(heading: str, doc: Path) -> str:
    text = doc.read_text()
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
    table = _table_after("# Metrics\n", METRICS)
    listed = set(re.findall(r"^\| `(elasticpp_[a-z_]+)", table, re.M))
    assert exported - listed == set(), "exported, not in docs/metrics.md's table"
    assert listed - exported == set(), "in docs/metrics.md's table, not exported"


def _first_table(heading: str, doc: Path) -> str:
    """The first table of the section under `heading` in `doc`."""
    lines = doc.read_text().split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        max(a.option_strings, key=len): a
        for a in parser._actions
        if a.option_strings and "--help" not in a.option_strings
    }


def _subparser(*words: str) -> argparse.ArgumentParser:
    parser, _ = cli_main.build_parser({})
    for word in words:
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[word]
    return parser


def test_the_agent_flags_table_lists_exactly_the_agents_flags_and_which_are_required() -> None:
    table = _first_table("\n## Run an elastic job\n", USAGE)
    assert table.startswith("| flag | default | meaning |")
    rows = [r.split(" | ") for r in table.splitlines()[2:]]
    listed = {flag: row[1] for row in rows for flag in re.findall(r"`(--[a-z-]+)`", row[0])}
    flags = _flags(_subparser("agent"))
    assert set(flags) - set(listed) == set(), "agent flags docs/usage.md's table lacks"
    assert set(listed) - set(flags) == set(), "in docs/usage.md's table, not agent flags"
    for flag, action in flags.items():
        assert (listed[flag] == "required") == action.required, flag


def test_the_commands_table_lists_every_command() -> None:
    table = _first_table("\n## Using it\n", README)
    listed = set(re.findall(r"^\| `elasticpp ([a-z]+)", table, re.M))
    assert listed == set(cli_main.SUBCOMMANDS)


def test_the_output_paragraph_names_every_command_that_takes_o() -> None:
    text = USAGE.read_text().split("**Output.**", 1)[1].split("\n\n", 1)[0]
    named = set()
    for command, subs in re.findall(
        r"`(plan|ctl|job|data|export)((?: [a-z|]+)?)", text.replace("\n", " ")
    ):
        named |= {(command, s) for s in subs.strip().split("|")} if subs else {(command, "")}
    takes = set()
    for command in cli_main.SUBCOMMANDS:
        parser = _subparser(command)
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for name, sub in subs[0].choices.items() if subs else [("", parser)]:
            if "--output" in _flags(sub):
                takes.add((command, name))
    assert takes == named
