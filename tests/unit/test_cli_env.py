"""`ELASTICPP_*` variables (elasticpp.cli.envflags): one rule for every flag of every command,
the flag beats the variable, a variable is parsed and refused like its flag, and no variable
carries a secret."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elasticpp.cli import envflags
from elasticpp.cli import main as cli_main

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
JOB = ["job", "status", "--name", "llm"]
AGENT = ["agent", "--etcd", "127.0.0.1:1", "--job-spec", "j", "--node-id", "n", "--state-dir", "s"]


def _parse(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    parser, _ = cli_main.build_parser(env)
    return parser.parse_args(argv)


def _refused(argv: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        _parse(argv, env)
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.splitlines()  # one line, no usage dump
    return line


def _all_flags() -> list[tuple[str, argparse.Action]]:
    parser, _ = cli_main.build_parser({})
    out = []

    def walk(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
            elif action.option_strings:
                out.append((p.prog, action))

    walk(parser)
    return out


def test_every_flag_has_the_variable_of_its_long_name() -> None:
    for prog, action in _all_flags():
        variable = envflags.variable_of(action)
        if set(action.option_strings) & envflags.NOT_FROM_ENVIRONMENT:
            assert variable is None, (prog, action.option_strings)
            continue
        long = max(action.option_strings, key=len)
        assert variable == "ELASTICPP_" + long[2:].upper().replace("-", "_"), (prog, long)


def test_the_variables_of_one_flag_name_are_one_variable_with_one_meaning() -> None:
    # A name shared by commands must take the same values in each (ELASTICPP_ETCD for agent
    # and job), or a variable set for one command would be nonsense to the other. The one
    # exception, documented in the README: --device is the worker device (cpu, cuda) of
    # agent and train, and the planner's device preset of plan.
    shared = {}
    for variable, users in envflags.variables(cli_main.build_parser({})[0]).items():
        kinds = {(a.type, tuple(a.choices or ()), a.nargs, type(a)) for _, a in users}
        if len(kinds) > 1:
            shared[variable] = sorted(p for p, _ in users)
    assert shared == {"ELASTICPP_DEVICE": ["elasticpp agent", "elasticpp plan", "elasticpp train"]}


def test_a_variable_gives_a_flag_the_command_line_leaves_out() -> None:
    env = {"ELASTICPP_ETCD": "10.0.0.1:2379", "ELASTICPP_OUTPUT": "yaml"}
    args = _parse(JOB, env)
    assert args.etcd == "10.0.0.1:2379" and args.output == "yaml"
    assert args.etcd_prefix == "/elasticpp"  # no variable: the default


def test_the_flag_beats_the_variable() -> None:
    env = {"ELASTICPP_ETCD": "10.0.0.1:2379", "ELASTICPP_OUTPUT": "yaml"}
    args = _parse([*JOB, "--etcd", "10.0.0.2:2379", "-o", "json"], env)
    assert args.etcd == "10.0.0.2:2379" and args.output == "json"


def test_an_empty_variable_is_unset() -> None:
    env = {"ELASTICPP_ETCD": "10.0.0.1:2379", "ELASTICPP_ETCD_PREFIX": ""}
    assert _parse(JOB, env).etcd_prefix == "/elasticpp"


def test_a_required_flag_is_given_by_its_variable(capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(JOB, {}, capsys)
    assert line.endswith("the following arguments are required: --etcd (or ELASTICPP_ETCD)")
    assert _parse(JOB, {"ELASTICPP_ETCD": "127.0.0.1:2379"}).etcd == "127.0.0.1:2379"


@pytest.mark.parametrize(
    "argv, variable, value, why",
    [
        (["ctl", "status"], "ELASTICPP_TIMEOUT", "0", "must be a number > 0"),
        (["ctl", "status"], "ELASTICPP_AGENT", "nohost", "expected HOST:PORT"),
        (["ctl", "status"], "ELASTICPP_OUTPUT", "xml", "invalid choice 'xml'"),
        (JOB, "ELASTICPP_ETCD", "etcd-0", "expected host:port"),
        (JOB, "ELASTICPP_ETCD_PREFIX", "no-slash", "etcd prefix"),
        (["plan", "--model", "tiny", "--global-batch", "8"], "ELASTICPP_NODES", "-1", "positive"),
        (AGENT, "ELASTICPP_LOG_LEVEL", "bogus", "invalid choice 'BOGUS'"),
        (AGENT, "ELASTICPP_INSECURE", "maybe", "expected 1, true, yes or on"),
        (AGENT, "ELASTICPP_METRICS_PORT", "70000", "port in [0, 65535]"),
    ],
)  # fmt: skip
def test_a_bad_variable_is_refused_with_exit_2_naming_it_and_its_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], variable: str, value: str, why: str
) -> None:
    line = _refused(argv, {"ELASTICPP_ETCD": "127.0.0.1:2379", variable: value}, capsys)
    flag = "--" + variable.removeprefix("ELASTICPP_").lower().replace("_", "-")
    assert f"{variable}={value!r} (the variable of {flag}): " in line and why in line


def test_a_switch_reads_yes_and_no() -> None:
    agent = AGENT
    for word, want in (("1", True), ("yes", True), ("ON", True), ("0", False), ("off", False)):
        assert _parse(agent, {"ELASTICPP_INSECURE": word}).insecure is want
    assert _parse([*agent, "--insecure"], {"ELASTICPP_INSECURE": "no"}).insecure is True


def test_a_repeated_flag_takes_shell_words_and_the_command_line_replaces_them() -> None:
    env = {"ELASTICPP_MODEL_OPTION": "a=1 'b=two words'", "ELASTICPP_DATA": "x.bin y.bin"}
    args = _parse(["train"], env)
    assert args.model_option == ["a=1", "b=two words"] and args.data == ["x.bin", "y.bin"]
    args = _parse(["train", "--model-option", "c=3", "--data", "z.bin"], env)
    assert args.model_option == ["c=3"] and args.data == ["z.bin"]


def test_flags_that_exclude_one_another_do_so_as_variables_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    prepare = ["data", "prepare", "--tokenizer", "t.json", "--out", "o.bin", "f.txt"]
    args = _parse([*prepare, "--no-eod"], {"ELASTICPP_EOD_ID": "5"})
    assert args.no_eod is True and args.eod_id is None  # the flag sets the group's variable aside
    assert _parse(prepare, {"ELASTICPP_EOD_ID": "5"}).eod_id == 5
    line = _refused(prepare, {"ELASTICPP_EOD_ID": "5", "ELASTICPP_NO_EOD": "1"}, capsys)
    assert "ELASTICPP_EOD_ID" in line and "ELASTICPP_NO_EOD" in line


def test_force_is_never_read_from_the_environment() -> None:
    env = {"ELASTICPP_FORCE": "1", "ELASTICPP_ETCD": "127.0.0.1:2379"}
    assert _parse(["job", "delete", "--name", "llm"], env).force is False


def test_no_flag_takes_a_secret_so_no_variable_carries_one() -> None:
    # A token or a password reaches elasticpp as a file path (a systemd credential, a mounted
    # Secret), never as a value in argv or the environment.
    secretive = re.compile(
        r"(?:^|[-_])(?:password|passwd|secret|token|credentials?|key)(?:[-_]|$)", re.I
    )
    not_secrets = {"--eos-token"}  # a vocabulary entry of `data prepare`, not a credential
    for prog, action in _all_flags():
        long = max(action.option_strings, key=len)
        if not secretive.search(long[2:]) or long in not_secrets:
            continue
        assert long.endswith("-file") or long in ("--tls-key", "--etcd-key"), (prog, long)
        assert action.type is not None and action.type("f") == Path("f"), (prog, long)
    names = set(envflags.variables(cli_main.build_parser({})[0]))
    assert not {"ELASTICPP_TOKEN", "ELASTICPP_PASSWORD", "ELASTICPP_ETCD_PASSWORD"} & names
    assert all(n.endswith("_FILE") or n.endswith("_KEY") or n == "ELASTICPP_EOS_TOKEN"
               for n in names if secretive.search(n))  # fmt: skip


def test_no_flag_variable_is_a_variable_elasticpp_uses_otherwise() -> None:
    # Names the workers, the profiler, the systemd unit and the Slurm script use for their own
    # ends must not be read as a flag's too.
    # (Prose comments of the deploy files, which may state the rule itself, are left out;
    # their commented-out examples, `#ELASTICPP_ETCD=...`, are kept.)
    used = set()
    for path in [*ROOT.joinpath("elasticpp").rglob("*.py"), *ROOT.joinpath("deploy").rglob("*")]:
        if path.is_file() and "cli" not in path.parts:
            lines = path.read_text(errors="ignore").splitlines()
            text = "\n".join(line for line in lines if not re.match(r"\s*# ", line))
            used |= set(re.findall(r"\bELASTICPP_[A-Z_]+[A-Z]\b", text))
    flags = set(envflags.variables(cli_main.build_parser({})[0]))
    # The systemd unit's defaults that are also its agent's flags, passed as those flags.
    unit = (ROOT / "deploy/systemd/elasticpp-agent.service").read_text()
    passed = set(re.findall(r"--([a-z-]+) \$\{(ELASTICPP_[A-Z_]+)\}", unit))
    assert {("etcd", "ELASTICPP_ETCD"), ("log-level", "ELASTICPP_LOG_LEVEL")} <= passed
    for flag, variable in passed:
        assert variable == "ELASTICPP_" + flag.upper().replace("-", "_")
    assert (used - {v for _, v in passed}) & flags == set()


def test_help_names_each_flags_variable() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "elasticpp.cli.main", "ctl", "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    for variable in ("ELASTICPP_AGENT", "ELASTICPP_TIMEOUT", "ELASTICPP_TOKEN_FILE"):
        assert f"[{variable}]" in out


def test_a_bad_variable_exits_2_from_a_real_process() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "elasticpp.cli.main", "ctl", "status"],
        env={"PATH": "/usr/bin:/bin", "ELASTICPP_TIMEOUT": "-3"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [
        "elasticpp: error: ELASTICPP_TIMEOUT='-3' (the variable of --timeout): "
        "must be a number > 0, got '-3'"
    ]
