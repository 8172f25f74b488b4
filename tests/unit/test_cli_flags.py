"""Every flag refuses nonsense (elasticpp.cli.flagtypes): exit code 2 and one line naming the
flag, before a command runs. A table of bad values per command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elasticpp.cli import main as cli_main

pytestmark = pytest.mark.timeout(60)

ETCD = ["--etcd", "127.0.0.1:2379"]
AGENT = ["agent", *ETCD, "--job-spec", "j.yaml", "--node-id", "n0", "--state-dir", "s"]
PLAN = ["plan", "--model", "tiny", "--global-batch", "8"]
PREPARE = ["data", "prepare", "--tokenizer", "t.json", "--out", "o.bin", "f.txt"]

# (command line, "@" where the bad flag goes if not at the end; the flag; its bad value; what
# the message says)
BAD = [
    (["ctl", "@", "status"], "--timeout", "0", "> 0"),
    (["ctl", "@", "status"], "--timeout", "-1", "> 0"),
    (["ctl", "@", "status"], "--timeout", "nan", "finite"),
    (["ctl", "@", "status"], "--agent", "", "HOST:PORT"),
    (["ctl", "@", "status"], "--agent", "gpu-017", "HOST:PORT"),
    (["ctl", "@", "status"], "--agent", "gpu-017:http", "HOST:PORT"),
    (["ctl", "@", "status"], "--agent", "gpu-017:0", "port 0"),
    (["ctl", "@", "status"], "--agent", "unix:", "unix:PATH"),
    (["ctl", "@", "status"], "--tls-cert", "", "empty"),
    (["ctl", "@", "status"], "--token-file", "", "empty"),
    (["ctl", "status"], "-o", "xml", "invalid choice"),
    (["ctl", "drain"], "--wait", "-5", ">= 0"),
    (["ctl", "drain"], "--wait", "inf", "finite"),
    (["job", "status", *ETCD], "--name", "Bad Name", "must be"),
    (["job", "status", "--name", "llm"], "--etcd", "", "at least one"),
    (["job", "status", "--name", "llm"], "--etcd", "etcd-0", "host:port"),
    (["job", "status", "--name", "llm"], "--etcd", "etcd-0:99999", "host:port"),
    (["job", "status", "--name", "llm", *ETCD], "--etcd-prefix", "elasticpp", "etcd prefix"),
    (["job", "status", "--name", "llm", *ETCD], "--etcd-user", "", "empty"),
    (["job", "status", "--name", "llm", *ETCD], "--etcd-password-file", "", "empty"),
    (["job", "nodes", "--name", "llm", *ETCD], "-o", "wide", "invalid choice"),
    (["job", "whatif", "--spec", "j.yaml"], "--nodes", "0", "positive"),
    (["job", "whatif", "--spec", "j.yaml", "--nodes", "2"], "--slots", "-1", "positive"),
    (AGENT, "--slots", "0", "positive"),
    (AGENT, "--listen", "0.0.0.0", "HOST:PORT"),
    (AGENT, "--listen", ":7430", "HOST:PORT"),
    (AGENT, "--health-listen", "probe", "HOST:PORT"),
    (AGENT, "--metrics-port", "-1", "[0, 65535]"),
    (AGENT, "--metrics-port", "65536", "[0, 65535]"),
    (AGENT, "--node-id", "", "must be"),
    (AGENT, "--state-dir", "", "empty"),
    (AGENT, "--tls-shared-identity", " ", "empty"),
    (AGENT, "--device", "tpu", "invalid choice"),
    (AGENT, "--on-job-end", "sleep", "invalid choice"),
    (AGENT, "--log-format", "xml", "invalid choice"),
    (PLAN, "--nodes", "0", "positive"),
    (PLAN, "--gpus-per-node", "-8", "positive"),
    (PLAN, "--global-batch", "1.5", "whole number"),
    (PLAN, "--micro-batch", "0", "positive"),
    (PLAN, "--seq-len", "0", "positive"),
    (PLAN, "--top", "-1", ">= 0"),
    (PLAN, "--node-gpus", "8,x", "whole numbers"),
    (PLAN, "--node-gpus", "8,-1", ">= 0"),
    (PLAN, "--device", "tpu-v5", "unknown device"),
    (PLAN, "--model", "", "empty"),
    (["train"], "--layout", "pp=0", "positive"),
    (["train"], "--layout", "pp2", "expected pp=P"),
    (["train"], "--steps", "0", "positive"),
    (["train"], "--seed", "-1", ">= 0"),
    (["train"], "--lr", "0", "> 0"),
    (["train"], "--lr", "nan", "finite"),
    (["train"], "--min-lr", "-1e-4", ">= 0"),
    (["train"], "--warmup-steps", "-2", ">= 0"),
    (["train"], "--weight-decay", "-0.1", ">= 0"),
    (["train"], "--clip-grad", "-1", ">= 0"),
    (["train"], "--dropout", "1", "[0, 1)"),
    (["train"], "--precision", "fp8", "invalid choice"),
    (["train"], "--corpus-max-bytes", "0", "positive"),
    (["train"], "--save-every", "-1", ">= 0"),
    (["train"], "--stop-at", "-1", ">= 0"),
    (["train"], "--threads", "0", "positive"),
    (["train"], "--pg-timeout", "0", "> 0"),
    (["train"], "--model-option", "=3", "KEY=VALUE"),
    (["train"], "--data", "", "empty"),
    (["demo"], "--nodes", "0", "positive"),
    (["demo"], "--slots", "0", "positive"),
    (["demo"], "--steps", "-1", "positive"),
    (["demo"], "--kill-at", "-1", ">= 0"),
    (["demo"], "--timeout", "0", "> 0"),
    (["demo"], "--out", "", "empty"),
    (PREPARE, "--eod-id", "-1", ">= 0"),
    (PREPARE, "--eos-token", "", "empty"),
    (PREPARE, "--dtype", "int8", "invalid choice"),
    (["export", "step"], "--hf", "", "empty"),
    (["export", "step", "--hf", "out"], "--model", "", "empty"),
]


@pytest.mark.parametrize(
    "argv, flag, value, why", BAD, ids=[f"{a[0]}{f}={v!r}" for a, f, v, _ in BAD]
)
def test_a_bad_value_is_refused_with_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str, value: str, why: str
) -> None:
    parser, _ = cli_main.build_parser({})
    bad = [f"{flag}={value}"] if flag.startswith("--") else [flag, value]
    at = argv.index("@") if "@" in argv else len(argv)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*argv[:at], *bad, *argv[at + 1 :]])
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert flag in line and why in line, line


def test_the_good_values_next_to_the_bad_ones_are_taken() -> None:
    parser, _ = cli_main.build_parser({})
    args = parser.parse_args([*AGENT, "--listen", "[::]:7430", "--health-listen", "",
                              "--metrics-port", "0", "--slots", "8"])  # fmt: skip
    assert (args.listen, args.health_listen, args.metrics_port, args.slots) == (
        "[::]:7430", "", 0, 8,
    )  # fmt: skip
    args = parser.parse_args(["ctl", "--agent", "unix:/run/elasticpp/ctl.sock", "drain",
                              "--wait", "0"])  # fmt: skip
    assert args.agent == "unix:/run/elasticpp/ctl.sock" and args.wait == 0.0
    args = parser.parse_args(["job", "status", "--name", "llm", "--etcd",
                              "https://etcd-0:2379,https://etcd-1:2379"])  # fmt: skip
    assert args.etcd == "https://etcd-0:2379,https://etcd-1:2379"


def test_a_bad_flag_exits_2_with_one_line_from_a_real_process() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "elasticpp.cli.main", *PLAN, "--nodes", "-3"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [
        "elasticpp: error: argument --nodes: must be a positive whole number, got '-3'"
    ]
