"""The deployment files, checked by the tools that consume them.

- Helm chart: `helm lint --strict`, `helm template` with several value sets, every rendered
  object validated (strict) against the Kubernetes schemas of the oldest and newest supported
  versions by kubernetes-validate, and the agent's rendered command line parsed by elasticpp's
  own CLI parser; impossible values make helm fail with a message naming them.
- systemd unit: `systemd-analyze verify` (any warning fails), its security rating, and its
  ExecStart expanded the way systemd does and parsed by elasticpp's CLI parser.
- Prometheus rules: `promtool check rules` and `promtool test rules`.

helm and promtool come from `tools/fetch_helm.sh` (into .venv/tools); systemd-analyze from
Debian's `systemd` package.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from elasticpp.agent.jobspec import load_job_spec
from tests.charts import (
    CHART,
    KUBE_VERSIONS,
    MINIMAL_VALUES,
    ROOT,
    VALUE_SETS,
)
from tests.charts import elasticpp_calls as _elasticpp_calls
from tests.charts import hooks as _hooks
from tests.charts import k8s_expand as _k8s_expand
from tests.charts import one as _one
from tests.charts import parse_cli as _parse_cli
from tests.charts import render as _render
from tests.charts import run as _run
from tests.charts import template as _template
from tests.charts import tool as _tool
from tests.charts import validate_builtin as _validate_builtin

UNIT = ROOT / "deploy" / "systemd" / "elasticpp-agent.service"
UNIT_DEFAULTS = ROOT / "deploy" / "systemd" / "elasticpp-agent.default"
RULES_DIR = ROOT / "deploy" / "prometheus"
INSTALLED_BIN = "/usr/local/bin/elasticpp"


# ----------------------------------------------------------------------------- helm


def _agent_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    sts = _one(docs, "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return container


# The downward-API values a pod's $(VAR) args are expanded with, where a test needs no others.
POD_ENV = {"POD_NAME": "rel-elasticpp-0", "POD_NAMESPACE": "train", "POD_IP": "10.1.2.3"}


@pytest.mark.timeout(60)
def test_chart_passes_strict_lint_with_defaults_and_with_minimal_values():
    helm = _tool("helm")
    for extra in ([], ["-f", str(MINIMAL_VALUES)]):
        proc = _run([helm, "lint", "--strict", str(CHART), *extra])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "0 chart(s) failed" in proc.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_objects_are_valid_kubernetes(name: str):
    docs = _render(*VALUE_SETS[name])
    _validate_builtin(docs)
    kinds = sorted(d["kind"] for d in docs)
    expected = {"ConfigMap", "Service", "StatefulSet"}
    assert expected <= set(kinds)
    assert len(kinds) == len(set(kinds)), f"one object per kind: {kinds}"
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "elasticpp"
        assert labels["app.kubernetes.io/instance"] == "rel"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert doc["metadata"]["namespace"] == "train"


@pytest.mark.timeout(60)
def test_statefulset_runs_the_agent_with_a_command_line_elasticpp_accepts():
    docs = _render(*VALUE_SETS["everything-on"])
    sts = _one(docs, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    container = _agent_container(docs)
    env = {"POD_NAME": "rel-elasticpp-3", "POD_NAMESPACE": "train", "POD_IP": "10.1.2.3"}
    argv = [_k8s_expand(a, env) for a in container["command"][1:] + container["args"]]
    args = _parse_cli(argv)
    assert args.command == "agent"
    assert args.node_id == "rel-elasticpp-3"  # node id = pod name
    assert args.etcd == "https://etcd:2379"
    assert args.slots == 8 and args.device == "cuda"
    assert args.listen == "0.0.0.0:7430" and args.metrics_port == 9430
    assert args.advertise_host == "rel-elasticpp-3.rel-elasticpp.train.svc.cluster.local"
    assert args.log_level == "DEBUG"  # extraArgs come last and win
    assert str(args.state_dir) == "/var/lib/elasticpp"
    assert pod["automountServiceAccountToken"] is False  # agents never call the API server
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["state"] == "/var/lib/elasticpp"
    assert str(args.job_spec).startswith(mounts["jobspec"] + "/")
    # GPUs: one per slot, from the chart, beside the user's own resources.
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "memory": "64Gi"}
    assert container["resources"]["requests"] == {"cpu": 8}
    # A stable state dir per pod, and the pod's own DNS name through the headless Service.
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "state"
    # ... which goes with the release, and stays for a scaled-down pod's return.
    retention = sts["spec"]["persistentVolumeClaimRetentionPolicy"]
    assert retention == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    service = _one(docs, "Service")
    assert service["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    # gRPC health probes on the plaintext health port (the kubelet presents no certificate);
    # the gRPC port takes mutual TLS with the pod's own certificate (cert-manager's CSI).
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["health"] == 7431
    assert args.health_listen == "0.0.0.0:7431" and ports["grpc"] == 7430
    tls_dir = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["tls"]
    for flag in (args.tls_cert, args.tls_key, args.tls_ca):
        assert str(flag).startswith(tls_dir + "/")
    assert not args.insecure and args.tls_shared_identity is None
    csi = {v["name"]: v for v in pod["volumes"]}["tls"]["csi"]
    assert csi["driver"] == "csi.cert-manager.io"
    assert csi["volumeAttributes"]["csi.cert-manager.io/common-name"] == "${POD_NAME}"
    dns = csi["volumeAttributes"]["csi.cert-manager.io/dns-names"]
    assert _k8s_expand(dns.replace("${", "$(").replace("}", ")"), env) == args.advertise_host


@pytest.mark.timeout(60)
def test_F7_the_network_policy_admits_the_jobs_agents_the_probes_and_prometheus_alone():
    """F7: every pod in the cluster could reach the agents' gRPC and metrics ports."""
    docs = _render()
    policy = _one(docs, "NetworkPolicy")
    container = _agent_container(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    selector = _one(docs, "StatefulSet")["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["podSelector"]["matchLabels"] == selector
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    agents, probes, metrics = policy["spec"]["ingress"]
    assert agents == {"from": [{"podSelector": {"matchLabels": selector}}]}  # every port
    assert probes == {"ports": [{"port": ports["health"], "protocol": "TCP"}]}
    assert metrics["ports"] == [{"port": ports["metrics"], "protocol": "TCP"}]
    assert "namespaceSelector" in metrics["from"][0]
    # Nothing else reaches the gRPC port: it is in no rule but the agents' own.
    assert all(
        "ports" not in rule or ports["grpc"] not in [p["port"] for p in rule["ports"]]
        for rule in (probes, metrics)
    )
    assert "NetworkPolicy" not in {
        d["kind"] for d in _render("--set", "networkPolicy.enabled=false")
    }


@pytest.mark.timeout(60)
def test_a_shared_certificate_and_the_token_come_from_secrets_elasticpp_accepts():
    docs = _render(*VALUE_SETS["shared-certificate"])
    container = _agent_container(docs)
    env = {"POD_NAME": "rel-elasticpp-0", "POD_NAMESPACE": "train", "POD_IP": "10.1.2.3"}
    args = _parse_cli([_k8s_expand(a, env) for a in container["command"][1:] + container["args"]])
    assert args.tls_shared_identity == "elasticpp-job" and not args.insecure
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert str(args.token_file).startswith(mounts["token"] + "/")
    assert str(args.tls_cert).startswith(mounts["tls"] + "/")
    volumes = {
        v["name"]: v for v in _one(docs, "StatefulSet")["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["tls"]["secret"]["secretName"] == "job-tls"
    assert volumes["token"]["secret"]["secretName"] == "job-token"
    plain_container = _agent_container(_render(*VALUE_SETS["plaintext"]))
    plain_argv = plain_container["command"][1:] + plain_container["args"]
    plain = _parse_cli([_k8s_expand(a, env) for a in plain_argv])
    assert plain.insecure and plain.tls_cert is None


@pytest.mark.timeout(60)
def test_etcd_tls_and_password_come_from_secrets_as_files_elasticpp_accepts():
    """F3: the chart can turn on the etcd client's TLS, client certificate and password;
    the secrets are read-only files (never environment variables, which workers inherit)."""
    docs = _render(*VALUE_SETS["etcd-secured"])
    container = _agent_container(docs)
    env = {"POD_NAME": "rel-elasticpp-0", "POD_NAMESPACE": "train", "POD_IP": "10.1.2.3"}
    argv = [_k8s_expand(a, env) for a in container["command"][1:] + container["args"]]
    args = _parse_cli(argv)
    assert args.etcd == "https://etcd-0.etcd:2379,https://etcd-1.etcd:2379"
    assert args.etcd_user == "elasticpp-demo"
    # The job's keys under its namespace: two releases of one job name never share them.
    assert args.etcd_prefix == "/elasticpp/train"
    other = _agent_container(_render(*VALUE_SETS["etcd-secured"], "--set", "etcd.prefix=/x/y"))
    assert "--etcd-prefix=/x/y" in other["args"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {
        v["name"]: v for v in _one(docs, "StatefulSet")["spec"]["template"]["spec"]["volumes"]
    }
    for flag, volume in (
        (args.etcd_ca, "etcd-tls"),
        (args.etcd_cert, "etcd-tls"),
        (args.etcd_key, "etcd-tls"),
        (args.etcd_password_file, "etcd-auth"),
    ):
        assert str(flag).startswith(mounts[volume]["mountPath"] + "/"), (flag, volume)
        assert mounts[volume]["readOnly"] is True
    assert volumes["etcd-tls"]["secret"]["secretName"] == "etcd-client-tls"
    assert volumes["etcd-auth"]["secret"]["secretName"] == "etcd-password"
    assert not any("password" in str(e).lower() for e in container["env"])


@pytest.mark.timeout(60)
def test_prestop_drains_through_elasticpp_ctl_within_the_grace_period():
    docs = _render("--set", "drain.waitSeconds=600", "--set", "agent.grpcPort=7000")
    container = _agent_container(docs)
    pod = _one(docs, "StatefulSet")["spec"]["template"]["spec"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    script = command[2]
    syntax = _run(["/bin/sh", "-n", "-c", script])
    assert syntax.returncode == 0, syntax.stderr
    calls = [_parse_cli(argv) for argv in _elasticpp_calls(script)]
    assert [(c.command, c.action) for c in calls] == [("ctl", "drain"), ("ctl", "status")]
    drain = calls[0]
    # Through the control socket: token-free, and only inside the pod.
    assert drain.agent == "unix:/run/elasticpp/ctl.sock" and drain.wait == 600
    assert calls[1].agent == "unix:/run/elasticpp/ctl.sock"
    env = {"POD_NAME": "rel-elasticpp-0", "POD_NAMESPACE": "train", "POD_IP": "10.1.2.3"}
    args = _parse_cli([_k8s_expand(a, env) for a in container["command"][1:] + container["args"]])
    assert str(args.control_socket) == "/run/elasticpp/ctl.sock"
    # Kubernetes must not kill the pod while the drain may still be running.
    assert pod["terminationGracePeriodSeconds"] > drain.wait + drain.timeout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workload", ["statefulset", "indexedJob"])
def test_uninstall_stops_the_job_first_with_the_agents_own_etcd_access(workload: str):
    """`helm uninstall` of a running job: a pre-delete hook runs `elasticpp job stop` (every
    agent commits and persists one step, the job ends as stopped) before any pod goes, with
    the agents' etcd endpoints, prefix and credentials, as files from the same secrets; its
    pod is none of the release's (no selector of the release takes it)."""
    values = [*VALUE_SETS["etcd-secured"], "--set", f"workload={workload}",
              "--set", "teardown.waitSeconds=200"]  # fmt: skip
    (hook,) = _hooks(*values)
    _validate_builtin([hook])
    assert hook["kind"] == "Job" and hook["metadata"]["namespace"] == "train"
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    pod = hook["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    stop = _parse_cli(container["command"][1:] + container["args"])
    assert (stop.command, stop.job_command, stop.if_running) == ("job", "stop", True)
    assert stop.name == "demo" and stop.wait == 200  # the job spec's name; teardown's wait
    assert hook["spec"]["activeDeadlineSeconds"] > stop.wait
    assert hook["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    docs = _render(*values)
    kind = "Job" if workload == "indexedJob" else "StatefulSet"
    agent_pod = _one(docs, kind)["spec"]["template"]["spec"]
    (agent,) = agent_pod["containers"]
    agent_args = _parse_cli(
        [
            _k8s_expand(a, {**POD_ENV, "POD_INDEX": "0"})
            for a in agent["command"][1:] + agent["args"]
        ]
    )
    files = ("etcd_ca", "etcd_cert", "etcd_key", "etcd_password_file")
    for name in ("etcd", "etcd_prefix", "etcd_user", *files):
        assert getattr(stop, name) == getattr(agent_args, name), name
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    agent_volumes = {v["name"]: v for v in agent_pod["volumes"]}
    for name in files:
        path = str(getattr(stop, name))
        (volume,) = [v for m, v in mounts.items() if path.startswith(m + "/")]
        assert volumes[volume]["secret"] == agent_volumes[volume]["secret"], name
    labels = hook["spec"]["template"]["metadata"]["labels"]
    for doc in docs:
        selector = doc.get("spec", {}).get("selector")
        selector = selector.get("matchLabels", selector) if isinstance(selector, dict) else None
        if selector:
            assert not selector.items() <= labels.items(), f"{doc['kind']} selects the hook"
    assert _hooks(*values, "--set", "teardown.stopJob=false") == []


@pytest.mark.timeout(60)
def test_jobspec_configmap_is_what_the_agent_loads(tmp_path: Path):
    # A values file, as users write one (`--set` would turn 7.5 into a string).
    values = tmp_path / "job-values.yaml"
    values.write_text(
        "jobSpec:\n  name: llm-run-3\n  model: tiny\n  global_batch: 1048576\n"
        "  micro_batch: 4\n  steps: 100000\n  seed: 123456789\n  min_nodes: 1\n"
        "  max_nodes: 4\n  hang_timeout_s: 7.5\n",
        encoding="utf-8",
    )
    docs = _render("-f", str(values))
    cm = _one(docs, "ConfigMap")
    container = _agent_container(docs)
    args = _parse_cli([_k8s_expand(a, POD_ENV) for a in container["args"]])
    (filename,) = cm["data"]
    assert filename == args.job_spec.name
    path = tmp_path / filename
    path.write_text(cm["data"][filename], encoding="utf-8")
    spec = load_job_spec(path)
    # Large integers must survive the template (no 1.23456789e+08).
    assert spec.seed == 123456789 and spec.global_batch == 1048576
    assert spec.name == "llm-run-3" and spec.hang_timeout_s == 7.5
    assert (spec.min_nodes, spec.max_nodes) == (1, 4)


@pytest.mark.timeout(60)
def test_optional_objects_follow_their_flags():
    assert {d["kind"] for d in _render()} == {"ConfigMap", "NetworkPolicy", "Service",
                                              "ServiceAccount", "StatefulSet"}  # fmt: skip
    docs = _render(*VALUE_SETS["everything-on"])
    pdb = _one(docs, "PodDisruptionBudget")
    # By default an eviction may not take the job below min_nodes.
    assert pdb["spec"]["minAvailable"] == 2 and "maxUnavailable" not in pdb["spec"]
    sts = _one(docs, "StatefulSet")
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    monitor = _one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    service = _one(docs, "Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"

    pdb = _one(_render(*VALUE_SETS["cpu-ephemeral"]), "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    # A job as small as it may be: one pod may still go, so `kubectl drain` never blocks.
    small = ["--set", "podDisruptionBudget.enabled=true", "--set", "jobSpec.min_nodes=2",
             "--set", "replicas=2"]  # fmt: skip
    pdb = _one(_render(*small), "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


@pytest.mark.timeout(60)
def test_cpu_agents_request_no_gpus_and_keep_state_in_an_emptydir():
    docs = _render(*VALUE_SETS["cpu-ephemeral"])
    container = _agent_container(docs)
    assert "resources" not in container
    assert _parse_cli([_k8s_expand(a, POD_ENV) for a in container["args"]]).device == "cpu"
    pod = _one(docs, "StatefulSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["state"] == {"name": "state", "emptyDir": {}}
    assert "affinity" not in pod
    assert "volumeClaimTemplates" not in _one(docs, "StatefulSet")["spec"]


@pytest.mark.timeout(60)
def test_one_agent_per_node_is_added_to_the_users_own_anti_affinity(tmp_path: Path):
    values = tmp_path / "affinity.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "affinity": {
                    "podAntiAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "topologyKey": "topology.kubernetes.io/zone",
                                "labelSelector": {"matchLabels": {"app": "other"}},
                            }
                        ]
                    },
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}
                            ]
                        }
                    },
                }
            }
        ),
        encoding="utf-8",
    )
    docs = _render("-f", str(values))
    _validate_builtin(docs)
    affinity = _one(docs, "StatefulSet")["spec"]["template"]["spec"]["affinity"]
    terms = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [t["topologyKey"] for t in terms] == [
        "topology.kubernetes.io/zone",
        "kubernetes.io/hostname",
    ]
    assert terms[1]["labelSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "elasticpp",
        "app.kubernetes.io/instance": "rel",
    }
    assert "nodeAffinity" in affinity


PLAIN_ETCD = ["--set", "etcd.tls.existingSecret=", "--set", "etcd.endpoints={etcd:2379}"]
IMPOSSIBLE = {
    "no-etcd": ([], False, "etcd.endpoints is required"),
    "bad-endpoint": (["--set", "etcd.endpoints={http://etcd:2379}"], True,
                     'etcd.endpoints: "http://etcd:2379" is not HOST:PORT or https://HOST:PORT'),
    "https-without-ca": (["--set", "etcd.tls.existingSecret="], True,
                         "is https but etcd.tls.existingSecret (the CA) is not set"),
    "plain-endpoint-with-tls": (["--set", "etcd.endpoints={etcd:2379}"], True,
                                'etcd.endpoints: "etcd:2379" must be https://HOST:PORT'),
    "user-without-password": (["--set", "etcd.auth.user=u"], True,
                              "etcd.auth: give both user and existingSecret"),
    "password-without-tls": (["--set", "etcd.auth.user=u", "--set", "etcd.auth.existingSecret=p",
                              *PLAIN_ETCD], True, "etcd.auth needs etcd.tls"),
    "anonymous-etcd": (PLAIN_ETCD, True, "the agents would reach etcd anonymously"),
    "ca-only-etcd": (["--set", "etcd.tls.clientCertificate=false"], True,
                     "set agent.insecure for an etcd on a network you trust"),
    "no-issuer": (["--set", "tls.certManager.issuerName="], True,
                  "tls.certManager.issuerName is required with tls.mode certManager"),
    "secret-without-name": (["--set", "tls.mode=secret", "--set", "tls.existingSecret=s"],
                            True, "tls.mode secret needs tls.existingSecret"),
    "plaintext-unsaid": (["--set", "tls.mode=none"], True, "set agent.insecure to say so"),
    "tls-by-ip": (["--set", "agent.advertise=podIP"], True, "agent.advertise must be dns"),
    "min-above-max": (["--set", "jobSpec.min_nodes=5"], True,
                      "jobSpec.min_nodes (5) exceeds jobSpec.max_nodes (4)"),
    "too-many-replicas": (["--set", "replicas=5"], True,
                          "replicas (5) must lie within [jobSpec.min_nodes, jobSpec.max_nodes]"
                          " = [1, 4]"),
    "too-few-replicas": (["--set", "jobSpec.min_nodes=3"], True,
                         "replicas (2) must lie within [jobSpec.min_nodes, jobSpec.max_nodes]"
                         " = [3, 4]"),
    "uneven-batch": (["--set", "jobSpec.micro_batch=3"], True,
                     "jobSpec.global_batch (16) is not a multiple of jobSpec.micro_batch (3)"),
    "missing-spec-key": (["--set", "jobSpec.model=null"], True, "jobSpec.model is required"),
    "same-ports": (["--set", "agent.metricsPort=7430"], True,
                   "agent.grpcPort and agent.metricsPort are both 7430"),
    "unknown-device": (["--set", "agent.device=tpu"], True, "/agent/device"),
    "cpu-model-on-gpus": (["--set", "jobSpec.device=cpu"], True,
                          "jobSpec.device is cpu (the default: the planner's model of a CPU slot)"
                          " but agent.device is cuda"),
    "no-model-on-gpus": (["--set", "jobSpec.device=null"], True,
                         "jobSpec.device is cpu (the default"),
    "zero-slots": (["--set", "agent.slots=0"], True, "/agent/slots"),
    "unknown-key": (["--set", "agent.gpus=8"], True, "gpus"),
}  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_impossible_values_fail_with_a_message_naming_them(case: str):
    args, minimal, message = IMPOSSIBLE[case]
    proc = _template(*args, minimal=minimal)
    assert proc.returncode != 0, proc.stdout
    assert message in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_the_schema_check_catches_a_misspelled_field():
    # The validation above can fail: an unknown field in a pod spec is refused.
    import kubernetes_validate

    sts = _one(_render(), "StatefulSet")
    sts["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBE_VERSIONS[-1], strict=True)


# ----------------------------------------------------------------------------- systemd


def _unit_entries(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of a unit file, continuation lines joined, in order."""
    entries: list[tuple[str, str, str]] = []
    section, pending = "", ""
    for raw in text.splitlines():
        line = pending + raw.strip() if pending else raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.append((section, key.strip(), value.strip()))
    return entries


def _unit_value(entries: list[tuple[str, str, str]], key: str) -> str:
    values = [v for _s, k, v in entries if k == key]
    assert len(values) == 1, f"{key}: {values}"
    return values[0]


def _unit_environment(entries: list[tuple[str, str, str]], env_file: str) -> dict[str, str]:
    # Environment= first, then the EnvironmentFile overrides it (systemd's order).
    env = {}
    for _s, k, v in entries:
        if k == "Environment":
            name, _, value = v.partition("=")
            env[name] = _systemd_specifiers(value)
    for line in env_file.splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            env[name.strip()] = value.strip()
    return env


CREDENTIALS = "/run/credentials/elasticpp-agent.service"


def _systemd_specifiers(value: str) -> str:
    for spec, text in (
        ("%S", "/var/lib"), ("%C", "/var/cache"), ("%H", "gpu-07"), ("%d", CREDENTIALS),
        ("%t", "/run"),
    ):  # fmt: skip
        value = value.replace(spec, text)
    return value


def _systemd_exec_argv(value: str, env: dict[str, str]) -> list[str]:
    # systemd: ${VAR} is substituted inside a word, a bare $VAR word splits into several.
    argv: list[str] = []
    for word in shlex.split(_systemd_specifiers(value)):
        bare = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if bare:
            argv.extend(env.get(bare.group(1), "").split())
        else:
            argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env[m.group(1)], word))
    return argv


@pytest.mark.timeout(60)
def test_systemd_unit_verifies_without_any_warning(tmp_path: Path):
    analyze = _tool("systemd-analyze")
    elasticpp = Path(sys.executable).parent / "elasticpp"
    assert elasticpp.is_file(), f"{elasticpp}: the venv has no elasticpp script (pip install -e .)"
    text = UNIT.read_text(encoding="utf-8")
    assert INSTALLED_BIN in text
    # verify requires the programs to exist: point the copy at this venv's real elasticpp.
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace(INSTALLED_BIN, str(elasticpp)), encoding="utf-8")
    proc = _run([analyze, "verify", unit.name], cwd=tmp_path)
    assert proc.returncode == 0 and not proc.stdout and not proc.stderr, proc.stdout + proc.stderr

    # With the shipped drop-ins (etcd's credentials, the IP allow list) beside it.
    drop_ins = tmp_path / f"{UNIT.name}.d"
    drop_ins.mkdir()
    for conf in (UNIT.parent / f"{UNIT.name}.d").glob("*.conf"):
        (drop_ins / conf.name).write_text(conf.read_text(encoding="utf-8"), encoding="utf-8")
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:"}
    proc = subprocess.run(
        [analyze, "verify", unit.name], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert sorted(p.name for p in drop_ins.iterdir()) == ["etcd-security.conf", "ip-allow.conf"]
    assert proc.returncode == 0 and not proc.stdout and not proc.stderr, proc.stdout + proc.stderr

    # The check can fail: systemd only warns about an unknown key, and that counts.
    typo = tmp_path / "typo" / UNIT.name
    typo.parent.mkdir()
    typo.write_text(unit.read_text().replace("Type=notify", "Tpye=notify"), encoding="utf-8")
    proc = _run([analyze, "verify", typo.name], cwd=typo.parent)
    assert "Unknown key 'Tpye'" in proc.stderr

    # Hardening: systemd's own exposure rating stays at "OK" or better (3.0 of 10).
    proc = _run([analyze, "security", "--offline=yes", "--threshold=30", unit.name], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr


@pytest.mark.timeout(60)
def test_systemd_unit_is_a_notify_service_that_drains_on_stop():
    entries = _unit_entries(UNIT.read_text(encoding="utf-8"))
    assert _unit_value(entries, "Type") == "notify"
    assert _unit_value(entries, "After") == "network-online.target"
    assert _unit_value(entries, "Wants") == "network-online.target"
    assert _unit_value(entries, "Restart") == "on-failure"
    assert _unit_value(entries, "EnvironmentFile") == "-/etc/default/elasticpp-agent"
    assert _unit_value(entries, "KillMode") == "mixed"
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert _unit_value(entries, key) == "yes"
    assert _unit_value(entries, "ProtectSystem") == "strict"
    assert _unit_value(entries, "StateDirectory") == "elasticpp"

    env = _unit_environment(entries, "")
    exec_stop = _systemd_specifiers(_unit_value(entries, "ExecStop").replace("$$", "$"))
    sh, flag, script = shlex.split(exec_stop)
    assert (sh, flag) == ("/bin/sh", "-c")
    syntax = _run(["/bin/sh", "-n", "-c", script])
    assert syntax.returncode == 0, syntax.stderr
    assert 'kill -0 "$MAINPID"' in script  # waits for the agent to exit by itself
    shell_env = {k: v for k, v in env.items()}
    calls = []
    for argv in _elasticpp_calls(script):
        expanded = [re.sub(r"\$([A-Z_]+)", lambda m: shell_env[m.group(1)], a) for a in argv]
        calls.append(_parse_cli(expanded))
    assert [(c.command, c.action) for c in calls] == [("ctl", "drain")]
    drain = calls[0]
    # Through the agent's control socket (ExecStart's --control-socket): no token needed.
    assert drain.agent == "unix:/run/elasticpp/ctl.sock"
    start = _parse_cli(_systemd_exec_argv(_unit_value(entries, "ExecStart"), env)[1:])
    assert str(start.control_socket) == "/run/elasticpp/ctl.sock"
    assert _unit_value(entries, "RuntimeDirectory") == "elasticpp"
    # Mutual TLS on the gRPC port, the files handed over as systemd credentials.
    loaded = {v.partition(":")[0] for _s, k, v in entries if k == "LoadCredential"}
    for flag in (start.tls_cert, start.tls_key, start.tls_ca):
        directory, _, name = str(flag).rpartition("/")
        assert directory == CREDENTIALS and name in loaded, flag
    timeout_stop = int(_unit_value(entries, "TimeoutStopSec"))
    assert timeout_stop > drain.wait + drain.timeout


@pytest.mark.timeout(60)
def test_systemd_execstart_gives_elasticpp_a_valid_command_line():
    entries = _unit_entries(UNIT.read_text(encoding="utf-8"))
    defaults_text = UNIT_DEFAULTS.read_text(encoding="utf-8")
    exec_start = _unit_value(entries, "ExecStart")

    # The unit's own defaults, with an empty (all commented) EnvironmentFile.
    args = _parse_cli(_systemd_exec_argv(exec_start, _unit_environment(entries, ""))[1:])
    assert args.command == "agent" and args.node_id == "gpu-07"
    assert str(args.state_dir) == "/var/lib/elasticpp"
    assert args.metrics_port == 9430 and args.slots is None

    # Every example in the EnvironmentFile uncommented.
    uncommented = "\n".join(
        line[1:] for line in defaults_text.splitlines() if re.match(r"#[A-Z_]+=", line)
    )
    env = _unit_environment(entries, uncommented)
    args = _parse_cli(_systemd_exec_argv(exec_start, env)[1:])
    assert args.node_id == "gpu-node-01" and args.advertise_host == "10.0.0.11"
    assert args.slots == 8 and args.device == "cuda"

    # The EnvironmentFile documents only variables the unit reads (or the workers' libraries).
    unit_text = UNIT.read_text(encoding="utf-8")
    for name in re.findall(r"^#?([A-Z_]+)=", defaults_text, flags=re.MULTILINE):
        assert name in unit_text or name.endswith("_SOCKET_IFNAME"), name
    # ... and every variable the unit reads has a documented default there.
    for name in set(re.findall(r"\$\{?(ELASTICPP_[A-Z_]+)", unit_text)):
        assert f"#{name}=" in defaults_text, name


def test_systemd_etcd_security_drop_in_passes_credentials_as_files():
    """F3: the unit can turn on the etcd client's TLS, client certificate and password, all
    loaded as systemd credentials (files only this service reads; never argv or env)."""
    entries = _unit_entries(UNIT.read_text(encoding="utf-8"))
    drop_in = (UNIT.parent / "elasticpp-agent.service.d" / "etcd-security.conf").read_text()
    env = _unit_environment(entries, "")
    credentials = {}
    for _section, key, value in _unit_entries(drop_in):
        if key == "Environment":
            for assignment in shlex.split(value):
                name, _, text = assignment.partition("=")
                env[name] = text.replace("%d", "/run/credentials/elasticpp-agent.service")
        elif key == "LoadCredential":
            name, _, source = value.partition(":")
            credentials[name] = source
    args = _parse_cli(_systemd_exec_argv(_unit_value(entries, "ExecStart"), env)[1:])
    assert all(e.startswith("https://") for e in args.etcd.split(","))
    for flag in (args.etcd_ca, args.etcd_cert, args.etcd_key, args.etcd_password_file):
        directory, _, name = str(flag).rpartition("/")
        assert directory == "/run/credentials/elasticpp-agent.service" and name in credentials
    assert args.etcd_user
    assert not hasattr(args, "etcd_password")  # the password itself is never a flag


# ----------------------------------------------------------------------------- prometheus


@pytest.mark.timeout(60)
def test_prometheus_rules_check_and_pass_their_unit_tests():
    promtool = _tool("promtool")
    proc = _run([promtool, "check", "rules", "elasticpp-rules.yml"], cwd=RULES_DIR)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout
    proc = _run([promtool, "test", "rules", "elasticpp-rules.test.yml"], cwd=RULES_DIR)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(60)
def test_prometheus_rules_use_only_metrics_the_agent_exports():
    from elasticpp.agent.kernel.metrics import AgentMetrics

    # The series names each metric family appears under when scraped.
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    exported = {
        family.name + suffix
        for family in AgentMetrics.create("n1", "job").registry.collect()
        for suffix in suffixes[family.type]
    }
    rules = yaml.safe_load((RULES_DIR / "elasticpp-rules.yml").read_text(encoding="utf-8"))
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    for group in rules["groups"]:
        for rule in group["rules"]:
            for name in re.findall(r"\belasticpp_[a-z0-9_:]+", rule["expr"]):
                assert name in exported or name in recorded, f"{name} in {rule['expr']!r}"


# ----------------------------------------------------------------------------- systemd, live

STOP_SPEC = {
    "name": "deploy-stop",
    "model": "tiny",
    "global_batch": 8,
    "micro_batch": 2,
    "steps": 100000,  # never finishes during the test
    "seed": 0,
    "min_nodes": 1,
    "max_nodes": 2,
    "lease_ttl_s": 3,
    "join_settle_s": 0.5,
}


def _steps_logged(state_dir: Path) -> list[dict[str, Any]]:
    import json

    path = state_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return rows


def _wait(cond: Any, timeout_s: float, what: str, procs: Sequence[Any] = ()) -> None:
    from elasticpp.waiting import wait_until

    def alive() -> None:
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"{what}: agent {p.args[0]} exited early with {p.returncode}")

    if not wait_until(cond, timeout_s, interval_s=0.1, each=alive):
        pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.mark.timeout(180)
def test_systemd_stop_and_the_charts_prestop_drain_live_agents(tmp_path: Path, etcd: Any):
    """ExecStart and ExecStop expanded from the unit and an EnvironmentFile and run without
    systemd: READY=1 arrives on NOTIFY_SOCKET, and the stop drains the node (the job goes on
    on the other node) while ExecStop waits for the agent to exit 0 by itself. Then the Helm
    chart's preStop hook stops the last agent and returns once it has exited."""
    import json
    import socket
    import tempfile
    import threading
    import uuid

    from elasticpp.agent.localcluster import descendants, free_ports, kill_tree
    from tests.certs import issue, make_ca

    elasticpp = str(Path(sys.executable).parent / "elasticpp")
    certs = tmp_path / "certs"
    make_ca(certs)
    run_root = Path(tempfile.mkdtemp(prefix="ep-run-"))  # unix socket paths are short
    entries = _unit_entries(UNIT.read_text(encoding="utf-8").replace(INSTALLED_BIN, elasticpp))
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(STOP_SPEC), encoding="utf-8")  # JSON is YAML

    def node_env(node_id: str) -> tuple[dict[str, str], Path]:
        grpc_port, metrics_port = free_ports(2)
        env_file = "\n".join(
            [
                f"ELASTICPP_ETCD={etcd.endpoint}",
                f"ELASTICPP_JOB_SPEC={spec}",
                f"ELASTICPP_NODE_ID={node_id}",
                f"ELASTICPP_LISTEN=127.0.0.1:{grpc_port}",
                f"ELASTICPP_METRICS_PORT={metrics_port}",
                "ELASTICPP_DRAIN_WAIT_S=90",
                "ELASTICPP_AGENT_OPTS=--slots 1 --device cpu",
            ]
        )
        root = tmp_path / node_id
        unit_env = {
            k: v.replace("/var/lib", str(root / "lib")).replace("/var/cache", str(root / "cache"))
            for k, v in _unit_environment(entries, env_file).items()
        }
        (root / "lib" / "elasticpp").mkdir(parents=True)  # systemd's StateDirectory=
        (root / "cache" / "elasticpp").mkdir(parents=True)  # CacheDirectory=
        (run_root / node_id / "elasticpp").mkdir(parents=True)  # RuntimeDirectory=
        credentials = root / "credentials"  # what LoadCredential= hands the service
        credentials.mkdir()
        cert, key = issue(certs, node_id)
        for name, source in (("tls.crt", cert), ("tls.key", key), ("ca.crt", certs / "ca.pem")):
            shutil.copy(source, credentials / name)
        return unit_env, root / "lib" / "elasticpp"

    def systemd_paths(text: str, state: Path) -> str:
        node = state.parent.parent
        text = text.replace(CREDENTIALS, str(node / "credentials"))
        return text.replace("/run/", f"{run_root / node.name}/").replace(
            "/var/lib", str(node / "lib")
        )

    def exec_start(unit_env: dict[str, str], state: Path) -> list[str]:
        argv = _systemd_exec_argv(_unit_value(entries, "ExecStart"), unit_env)
        return [systemd_paths(a, state) for a in argv]

    notify_name = f"elasticpp-test-{uuid.uuid4().hex}"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind("\0" + notify_name)  # abstract: no path length limit, nothing to clean up
    notify.settimeout(120)
    env_a, state_a = node_env("node-a")
    env_b, state_b = node_env("node-b")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for env, state, extra in (
            (env_a, state_a, {"NOTIFY_SOCKET": "@" + notify_name}),
            (env_b, state_b, {}),
        ):
            with (state.parent.parent / "agent.log").open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        exec_start(env, state),
                        env={**os.environ, **env, **extra},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        agent_a, agent_b = procs
        # systemd is the main process's parent and reaps it at once; so must we, or ExecStop's
        # `kill -0 $MAINPID` would see a zombie and wait forever.
        reaper = threading.Thread(target=agent_a.wait, daemon=True)
        reaper.start()
        # Type=notify: systemd considers the unit started on READY=1 from the main process.
        assert notify.recv(256) == b"READY=1"

        # Both nodes train in one layout before the stop.
        def both_train() -> bool:
            rows_a, rows_b = _steps_logged(state_a), _steps_logged(state_b)
            gens_a = {r["generation"] for r in rows_a}
            return any(r["generation"] in gens_a for r in rows_b)

        _wait(both_train, 120, "both nodes training", procs)
        workers_a = descendants(agent_a.pid)
        gen_before_stop = max(r["generation"] for r in _steps_logged(state_b))
        assert workers_a, "node-a has no worker processes"

        # systemctl stop: ExecStop with MAINPID, in the unit's environment.
        stop_line = systemd_paths(
            _systemd_specifiers(_unit_value(entries, "ExecStop").replace("$$", "$")), state_a
        )
        stop = subprocess.run(
            shlex.split(stop_line),
            env={**os.environ, **env_a, "MAINPID": str(agent_a.pid)},
            capture_output=True,
            text=True,
            timeout=150,
            check=False,
        )
        assert stop.returncode == 0, stop.stdout + stop.stderr
        # ExecStop returned only once the agent had drained and left etcd: nothing is left for
        # systemd's SIGTERM to cut short.
        log_a = (tmp_path / "node-a" / "agent.log").read_text(encoding="utf-8")
        assert "drained" in log_a and "drain timed out" not in log_a, log_a[-3000:]
        assert "node node-a deregistered" in log_a, log_a[-3000:]
        reaper.join(timeout=10)
        assert agent_a.returncode == 0, agent_a.returncode
        _wait(
            lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers_a),
            30,
            "node-a's workers to stop",
        )

        # The job goes on without node-a, in a newer generation.
        last_gen_a = max(r["generation"] for r in _steps_logged(state_a))
        _wait(
            lambda: any(r["generation"] > last_gen_a for r in _steps_logged(state_b)),
            120,
            "node-b training in a generation without node-a",
            [agent_b],
        )

        # A drain switches at a step boundary: the generations after it recompute nothing.
        def timelines_after(generation: int) -> list[dict[str, Any]]:
            from elasticpp.cluster.client import ClusterClient

            with ClusterClient([etcd.endpoint], STOP_SPEC["name"]) as client:
                timelines, _rev = client.arrivals.barrier_state("timelines")
            return [t for t in timelines.values() if int(t["generation"]) > generation]

        _wait(lambda: timelines_after(gen_before_stop), 60, "a recovery timeline", [agent_b])
        for timeline in timelines_after(gen_before_stop):
            assert int(timeline["steps_recomputed"]) == 0, timeline

        # The chart's preStop hook on the last node: the drain cannot hand off below
        # min_nodes, so the agent exits when its drain wait runs out, and the hook's status
        # loop ends when the agent no longer answers.
        reaper_b = threading.Thread(target=agent_b.wait, daemon=True)
        reaper_b.start()
        port_b = env_b["ELASTICPP_LISTEN"].rsplit(":", 1)[1]
        socket_b = run_root / "node-b" / "elasticpp" / "ctl.sock"
        docs = _render(
            "--set", f"agent.grpcPort={port_b}", "--set", "drain.waitSeconds=2",
            "--set", f"agent.controlSocket={socket_b}",
        )  # fmt: skip
        hook = _agent_container(docs)["lifecycle"]["preStop"]["exec"]["command"]
        path = f"{Path(elasticpp).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        pre_stop = subprocess.run(
            hook,
            env={**os.environ, "PATH": path},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert pre_stop.returncode == 0, pre_stop.stdout + pre_stop.stderr
        # The hook returned only once the agent had stopped serving (it logs this first).
        log_b = (tmp_path / "node-b" / "agent.log").read_text(encoding="utf-8")
        assert "drain timed out" in log_b, log_b[-3000:]
        reaper_b.join(timeout=10)
        assert agent_b.returncode == 0, agent_b.returncode
    finally:
        notify.close()
        shutil.rmtree(run_root, ignore_errors=True)
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
            p.wait(timeout=30)


@pytest.mark.timeout(60)
def test_the_readmes_secured_values_render_an_agent_with_every_door_closed(tmp_path: Path):
    """The README's Helm values for a secured job are values the chart takes: mutual TLS,
    the token, etcd over TLS with a client certificate and a user."""
    readme = (CHART.parents[1] / "README.md").read_text()
    block = readme.split("# secure-values.yaml", 1)[1].split("\n", 1)[1].split("```", 1)[0]
    values = tmp_path / "secure-values.yaml"
    values.write_text(block)
    proc = _template("-f", str(values), minimal=False)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    args = _agent_container(docs)["args"]
    for flag in ("--tls-cert=", "--token-file=", "--etcd-cert=", "--etcd-user=elasticpp-llm"):
        assert any(a.startswith(flag) for a in args), flag
    assert "--insecure" not in args
    assert _one(docs, "NetworkPolicy")


@pytest.mark.timeout(60)
def test_a_real_jobs_pod_values_render_valid_objects(tmp_path: Path):
    """What a real job needs of its pods: the model, the data and a shared persist_dir
    mounted, an init container, the host's network for NCCL/RDMA, a RuntimeClass, a gang
    scheduler, spread over zones; the objects stay valid for every Kubernetes version."""
    values = tmp_path / "pod-values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "extraVolumes": [
                    {"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}},
                    {"name": "ckpt", "nfs": {"server": "nfs.example", "path": "/ckpt"}},
                ],
                "extraVolumeMounts": [
                    {"name": "data", "mountPath": "/data", "readOnly": True},
                    {"name": "ckpt", "mountPath": "/ckpt"},
                ],
                "initContainers": [{"name": "fetch", "image": "busybox:1.37", "args": ["true"]}],
                "hostNetwork": True,
                "runtimeClassName": "nvidia",
                "schedulerName": "volcano",
                "podAnnotations": {"scheduling.k8s.io/group-name": "llm"},
                "topologySpreadConstraints": [
                    {
                        "maxSkew": 1,
                        "topologyKey": "topology.kubernetes.io/zone",
                        "whenUnsatisfiable": "ScheduleAnyway",
                        "labelSelector": {
                            "matchLabels": {"app.kubernetes.io/instance": "{{ .Release.Name }}"}
                        },
                    }
                ],
            }
        )
    )
    docs = _render("-f", str(values))
    _validate_builtin(docs)
    pod = _one(docs, "StatefulSet")["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["runtimeClassName"] == "nvidia" and pod["schedulerName"] == "volcano"
    assert [c["name"] for c in pod["initContainers"]] == ["fetch"]
    volumes = {v["name"] for v in pod["volumes"]}
    assert {"data", "ckpt", "jobspec"} <= volumes
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["data"] == "/data" and mounts["ckpt"] == "/ckpt" and "state" in mounts
    spread = pod["topologySpreadConstraints"][0]
    assert spread["labelSelector"]["matchLabels"] == {"app.kubernetes.io/instance": "rel"}
    # Off by default: the defaults render none of it.
    default = _one(_render(), "StatefulSet")["spec"]["template"]["spec"]
    for key in ("hostNetwork", "dnsPolicy", "runtimeClassName", "schedulerName",
                "initContainers", "topologySpreadConstraints"):  # fmt: skip
        assert key not in default, key


@pytest.mark.timeout(60)
def test_the_chart_installs_the_rules_and_the_dashboard_as_shipped():
    """PrometheusRule and the dashboard's ConfigMap carry deploy/prometheus's rules and
    deploy/grafana's dashboard unchanged (one file each: deploy/ links to the chart's)."""
    deploy = CHART.parents[1] / "deploy"
    docs = _render(
        "--set", "monitoring.prometheusRule.enabled=true",
        "--set", "monitoring.prometheusRule.labels.release=prom",
        "--set", "monitoring.dashboard.enabled=true",
    )  # fmt: skip
    _validate_builtin(docs)
    rule = _one(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prom"
    rules = yaml.safe_load((deploy / "prometheus" / "elasticpp-rules.yml").read_text())
    assert rule["spec"] == rules
    [board] = [d for d in docs if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((deploy / "grafana" / "elasticpp-job.json").read_text())
    assert json.loads(board["data"]["elasticpp-job.json"]) == shipped
    assert {d["kind"] for d in _render()} >= {"StatefulSet"}
    assert "PrometheusRule" not in {d["kind"] for d in _render()}  # off by default


def test_every_alert_has_a_runbook_that_docs_runbooks_has():
    rules = yaml.safe_load((CHART / "files" / "elasticpp-rules.yml").read_text())
    headings = {
        line[3:].strip().lower()
        for line in (CHART.parents[1] / "docs" / "runbooks.md").read_text().splitlines()
        if line.startswith("## ")
    }
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) >= 13
    for rule in alerts:
        url = rule["annotations"].get("runbook_url", "")
        assert url == f"docs/runbooks.md#{rule['alert'].lower()}", rule["alert"]
        assert rule["alert"].lower() in headings, rule["alert"]


def test_docs_deploy_lists_every_alert_with_its_severity():
    rules = yaml.safe_load((CHART / "files" / "elasticpp-rules.yml").read_text())
    alerts = {r["alert"]: r["labels"]["severity"] for g in rules["groups"] for r in g["rules"]
              if "alert" in r}  # fmt: skip
    rows = re.findall(
        r"^\| `(Elasticpp\w+)` \|.*\| (\w+) \|$",
        (CHART.parents[1] / "docs" / "deploy.md").read_text(),
        re.M,
    )
    assert dict(rows) == alerts


def test_the_slurm_example_runs_one_secured_agent_a_node_with_a_command_line_it_accepts():
    script = (CHART.parents[1] / "deploy" / "slurm" / "elasticpp.sbatch").read_text()
    assert _run(["bash", "-n", "-c", script]).returncode == 0
    assert "#SBATCH --ntasks-per-node=1" in script and "#SBATCH --signal=TERM@300" in script
    inner = script.split("bash -c '", 1)[1].split("'", 1)[0]
    agent = inner.split("exec ", 1)[1].replace("\\\n", " ")
    values = {"$0": "https://etcd-0:2379", "$1": "/shared/job.yaml", "$2": "/secrets",
              "$3": "/var/tmp/ep", "$node": "gpu-017",
              "$(hostname -f)": "gpu-017.cluster"}  # fmt: skip
    for name, value in values.items():
        agent = agent.replace(f'"{name}', f'"{value}').replace(name, value)
    argv = shlex.split(agent)
    assert argv[0] == "elasticpp"
    args = _parse_cli(argv[1:])
    assert args.node_id == "gpu-017" and args.tls_cert == Path("/secrets/gpu-017.crt")
    assert args.etcd_cert is not None and args.token_file == Path("/secrets/token")
    assert args.on_job_end == "exit" and not args.insecure
