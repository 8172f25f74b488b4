"""What every `elasticpp` command shares, as a user runs it (a real subprocess): the version,
the log level refused with the allowed values, and a reader that goes away."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
from typing import Any

import pytest

from elasticpp.cli import main as cli_main

PLAN = [
    "plan", "--nodes", "16", "--gpus-per-node", "8", "--device", "a100-80g",
    "--model", "gpt-175b", "--global-batch", "1536",
]  # fmt: skip
AGENT = [
    "agent", "--etcd", "127.0.0.1:1", "--job-spec", "job.yaml", "--node-id", "n0",
    "--state-dir", "state",
]  # fmt: skip


def _elasticpp(
    *args: str, stdout: Any = subprocess.PIPE, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elasticpp.cli.main", *args],
        env=env,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_installed_version_and_exits_0(flag: str) -> None:
    run = _elasticpp(flag)
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"elasticpp {importlib.metadata.version('elasticpp')}\n"


@pytest.mark.timeout(60)
def test_a_bogus_log_level_exits_2_naming_the_allowed_levels() -> None:
    run = _elasticpp(*AGENT, "--log-level", "bogus")
    assert run.returncode == 2
    [line] = run.stderr.splitlines()  # one line, no usage dump and no agent started
    assert "--log-level" in line and "'BOGUS'" in line
    for level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        assert level in line


def test_a_log_level_is_taken_in_any_case() -> None:
    parser, _ = cli_main.build_parser()
    assert parser.parse_args([*AGENT, "--log-level", "debug"]).log_level == "DEBUG"
    assert parser.parse_args(AGENT).log_level == "INFO"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("args", [PLAN, ["--version"]], ids=["plan", "version"])
def test_a_command_whose_reader_went_away_ends_quietly_with_141(
    args: list[str], buffered: bool
) -> None:
    # `elasticpp plan ... | head -1`, with the reader gone before the first write: the same
    # every run (a reader that leaves later may find everything already in the pipe). A
    # buffered stdout fails at its flush, an unbuffered one (PYTHONUNBUFFERED=1, as the systemd
    # unit and the images set) at the write itself.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        run = _elasticpp(*args, stdout=write_end, env=env)
    finally:
        os.close(write_end)
    assert run.returncode == cli_main.EXIT_READER_GONE == 141
    assert run.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored" line


def test_a_broken_pipe_that_is_not_stdouts_keeps_its_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A worker's pipe or a socket whose peer left is a failure to report, not a reader
    # that went away: stdout here is pytest's capture, whose reader is still there.
    class Breaks:
        @staticmethod
        def run(args: argparse.Namespace) -> int:
            raise BrokenPipeError("a worker's pipe")

    def build_parser() -> tuple[argparse.ArgumentParser, dict[str, object]]:
        parser = argparse.ArgumentParser()
        parser.add_argument("command")
        return parser, {"breaks": Breaks}

    monkeypatch.setattr(cli_main, "build_parser", build_parser)
    with pytest.raises(BrokenPipeError, match="a worker's pipe"):
        cli_main.main(["breaks"])
