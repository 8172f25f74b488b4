"""The agent's layers hold when the code runs, not only in the import graph: each module of
the "pure steps" contract (pyproject.toml, checked statically by `lint-imports` in `make
lint`) is imported in a fresh interpreter, and none of the contract's forbidden modules
(gRPC, torch, a part's shell, a client) may be loaded by it. A package `__init__` that
imports a client, which the static graph does not count against its submodules, is caught
here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import importlib, json, sys
modules, forbidden = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}
for name in modules:
    before = set(sys.modules)
    importlib.import_module(name)
    loaded = set(sys.modules) - before
    out[name] = sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden))
print(json.dumps(out))
"""


def _contract(name: str) -> dict[str, list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["name"] == name:
            return dict(contract)
    raise AssertionError(f"no contract {name!r} in pyproject.toml")


def _loaded(modules: list[str], forbidden: list[str]) -> dict[str, list[str]]:
    """Module -> the forbidden modules importing it loaded, each in one fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(modules), json.dumps(forbidden)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, list[str]] = json.loads(done.stdout)
    return result


PURE = _contract("pure steps import no gRPC, torch, shell or etcd client")


def test_every_pure_step_loads_no_grpc_torch_shell_or_client_when_imported() -> None:
    modules = list(PURE["source_modules"])
    assert "elasticpp.agent.leader.step" in modules and len(modules) >= 15
    # One interpreter per module: what one loads must not hide what another would.
    leaks = {}
    for name in modules:
        found = _loaded([name], list(PURE["forbidden_modules"]))[name]
        if found:
            leaks[name] = found[:5]
    assert leaks == {}


def test_the_check_sees_a_module_that_loads_grpc() -> None:
    """The same check on a module that does import a client names what it loaded."""
    found = _loaded(["elasticpp.cluster.client"], list(PURE["forbidden_modules"]))
    assert "grpc" in found["elasticpp.cluster.client"]


_PRIVATE_OF_AN_AGENT = re.compile(r"\bagent\.(?:\w+\.)?_[a-z]\w*")


def _private_reads(text: str) -> list[str]:
    """`agent._x` or `agent.<part>._x` in `text` (module paths `elasticpp.agent._...` aside)."""
    return [m.group(0) for m in _PRIVATE_OF_AN_AGENT.finditer(text)
            if not text[: m.start()].endswith("elasticpp.")]  # fmt: skip


def test_no_test_or_bench_reaches_into_an_agents_or_its_parts_private_fields() -> None:
    """Tests drive the agent and its parts through their ports and public state: the count
    of private reads is zero, and stays so (the agent once had 80 `agent._vs` in tests)."""
    root = Path(__file__).resolve().parents[2]
    found = {
        str(path.relative_to(root)): hits
        for folder in ("tests", "bench")
        for path in sorted((root / folder).rglob("*.py"))
        if path != Path(__file__).resolve()
        and (hits := _private_reads(path.read_text(encoding="utf-8")))
    }
    assert found == {}


def test_the_private_read_check_sees_one() -> None:
    assert _private_reads("x = agent._vs.members\ny = agent.leader._ports") == [
        "agent._vs", "agent.leader._ports"
    ]  # fmt: skip
    assert _private_reads("import elasticpp.agent._x\nagent.store.reported_steps()") == []
