"""The Helm chart's `workload: indexedJob`, checked by the tools that consume it: helm renders
it, kubernetes-validate checks every object against the Kubernetes schemas (the chart's
oldest and the newest), elasticpp's own parser reads the agent's command line, and the Job's
podFailurePolicy is evaluated the way the Job controller does (first matching rule) against
the exit codes the agent's code defines. The StatefulSet workload's own checks are in
test_deploy.py; the grace period's relation to the agent's stop is checked for both."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from elasticpp.agent.config import TAKEN_EXIT_CODES
from elasticpp.agent.health.step import EXIT_FAILED, EXIT_HALTED
from elasticpp.agent.jobspec import JobSpec
from elasticpp.agent.kernel.limits import AGENT_STOP_KILL_WAIT_S
from elasticpp.agent.view.step import EPOCH_ENDED_EXIT
from tests.charts import CHART, MINIMAL_VALUES, VALUE_SETS
from tests.charts import elasticpp_calls as _elasticpp_calls
from tests.charts import k8s_expand as _k8s_expand
from tests.charts import one as _one
from tests.charts import parse_cli as _parse_cli
from tests.charts import render as _render
from tests.charts import run as _run
from tests.charts import template as _template
from tests.charts import tool as _tool
from tests.charts import validate_builtin as _validate_builtin

JOB = ["--set", "workload=indexedJob"]
# An indexed Job's pod: named <job>-<index>-<suffix>, its hostname <job>-<index> (the Job
# controller sets both), its index in an annotation.
POD = {"POD_NAME": "rel-elasticpp-2-x7k2q", "POD_NAMESPACE": "train", "POD_IP": "10.1.2.3"}
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


def _pod_spec(docs: list[dict[str, Any]], kind: str = "Job") -> dict[str, Any]:
    return _one(docs, kind)["spec"]["template"]["spec"]


def _container(docs: list[dict[str, Any]], kind: str = "Job") -> dict[str, Any]:
    (container,) = _pod_spec(docs, kind)["containers"]
    return container


def _pod_env(container: dict[str, Any], index: int) -> dict[str, str]:
    """The container's environment as the kubelet gives it to the pod of `index`."""
    env = dict(POD)
    for var in container["env"]:
        path = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        if path == f"metadata.annotations['{INDEX_ANNOTATION}']":
            env[var["name"]] = str(index)
    return env


def _agent_args(docs: list[dict[str, Any]], kind: str = "Job", index: int = 2) -> Any:
    container = _container(docs, kind)
    env = _pod_env(container, index)
    return _parse_cli([_k8s_expand(a, env) for a in container["command"][1:] + container["args"]])


def _job_action(
    rules: list[dict[str, Any]], container: str, code: int, conditions: set[str]
) -> str:
    """What the Job controller does with a failed pod: the first rule that matches, else
    Count (the pod counts against backoffLimit)."""
    for rule in rules:
        on_codes = rule.get("onExitCodes")
        if on_codes is not None:
            if on_codes.get("containerName", container) != container:
                continue
            inside = code in on_codes["values"]
            if inside == (on_codes["operator"] == "In"):
                return str(rule["action"])
        for pattern in rule.get("onPodConditions", ()):
            if pattern["type"] in conditions:
                return str(rule["action"])
    return "Count"


@pytest.mark.timeout(60)
def test_the_chart_passes_strict_lint_as_an_indexed_job():
    proc = _run([_tool("helm"), "lint", "--strict", str(CHART), "-f", str(MINIMAL_VALUES), *JOB])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.timeout(60)
def test_an_indexed_job_runs_one_pod_a_node_that_completes_when_the_job_finished():
    docs = _render(*JOB, "--set", "replicas=3", "--set", "job.ttlSecondsAfterFinished=600")
    _validate_builtin(docs)
    kinds = {d["kind"] for d in docs}
    assert "Job" in kinds and "StatefulSet" not in kinds
    job = _one(docs, "Job")
    assert job["apiVersion"] == "batch/v1"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == 3  # the node count
    assert spec["ttlSecondsAfterFinished"] == 600
    assert spec["backoffLimit"] == 6
    assert "selector" not in spec  # the Job controller's own (manualSelector is not used)
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy needs it
    # Stable DNS per pod: <hostname>.<subdomain>.<namespace>.svc through the headless Service.
    service = _one(docs, "Service")
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    labels = spec["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    # The agent: on-job-end exit, whatever agent.onJobEnd says (a StatefulSet's choice).
    args = _agent_args(_render(*JOB, "--set", "agent.onJobEnd=idle"))
    assert args.command == "agent" and args.on_job_end == "exit"
    # ttlSecondsAfterFinished: null keeps a finished Job until it is deleted.
    kept = _one(_render(*JOB, "--set", "job.ttlSecondsAfterFinished=null"), "Job")
    assert "ttlSecondsAfterFinished" not in kept["spec"]


@pytest.mark.timeout(60)
def test_the_pod_failure_policy_reads_the_exit_codes_the_agent_gives():
    docs = _render(*JOB)
    rules = _one(docs, "Job")["spec"]["podFailurePolicy"]["rules"]
    container = _container(docs)
    name = container["name"]
    args = _agent_args(docs)
    left = args.unfinished_exit_code
    # An agent leaving a job that goes on must not exit 0 (its index would count complete),
    # nor with a code that says something else.
    assert left != 0 and left not in TAKEN_EXIT_CODES
    expected = {
        (EXIT_FAILED, frozenset()): "FailJob",  # the failure budget spent
        (EXIT_HALTED, frozenset()): "FailJob",  # a loss that is not finite
        (EPOCH_ENDED_EXIT, frozenset()): "Ignore",  # the job's epoch ended: start again
        (left, frozenset()): "Ignore",  # drained or stopped: a replacement pod
        (137, frozenset({"DisruptionTarget"})): "Ignore",  # evicted, preempted, node gone
        (left, frozenset({"DisruptionTarget"})): "Ignore",
        (1, frozenset()): "Count",  # an agent's error, or a stop cut short
        (2, frozenset()): "Count",  # bad configuration
        (137, frozenset()): "Count",  # OOM-killed
        # A job's end is the job's end, even when the pod was being evicted.
        (EXIT_FAILED, frozenset({"DisruptionTarget"})): "FailJob",
    }
    for (code, conditions), action in expected.items():
        assert _job_action(rules, name, code, set(conditions)) == action, (code, conditions)
    for rule in rules:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["containerName"] == name
            assert 0 not in rule["onExitCodes"]["values"]  # Kubernetes refuses 0 with In


@pytest.mark.timeout(60)
def test_an_indexed_jobs_node_is_its_pod_and_its_certificate_covers_the_name_peers_dial():
    docs = _render(*JOB)
    args = _agent_args(docs, index=2)
    assert args.node_id == POD["POD_NAME"]  # a replaced pod is a new node joining
    # Peers dial the pod's hostname, <job>-<index>, under the Job's subdomain.
    job_name = _one(docs, "Job")["metadata"]["name"]
    subdomain = _pod_spec(docs)["subdomain"]
    assert args.advertise_host == f"{job_name}-2.{subdomain}.train.svc.cluster.local"
    # cert-manager's CSI driver: the common name is the node id (the state service admits a
    # certificate whose common name is a node of the job); the DNS name covers the dialled
    # name, one label under the job's own subdomain.
    csi = {v["name"]: v for v in _pod_spec(docs)["volumes"]}["tls"]["csi"]
    attrs = csi["volumeAttributes"]
    csi_vars = {"${POD_NAME}": POD["POD_NAME"], "${POD_NAMESPACE}": POD["POD_NAMESPACE"]}

    def expand(value: str) -> str:
        for var, got in csi_vars.items():
            value = value.replace(var, got)
        assert "${" not in value, f"a variable the CSI driver does not have: {value}"
        return value

    assert expand(attrs["csi.cert-manager.io/common-name"]) == args.node_id
    (dns,) = [expand(n.strip()) for n in attrs["csi.cert-manager.io/dns-names"].split(",")]
    _host, rest = args.advertise_host.split(".", 1)
    assert dns == f"*.{rest}" and rest.startswith(f"{subdomain}.")
    mounts = {m["name"]: m["mountPath"] for m in _container(docs)["volumeMounts"]}
    for flag in (args.tls_cert, args.tls_key, args.tls_ca):
        assert str(flag).startswith(mounts["tls"] + "/")
    # The StatefulSet's certificate names its pod alone, as before.
    sts_csi = {v["name"]: v for v in _pod_spec(_render(), "StatefulSet")["volumes"]}["tls"]
    assert "*" not in sts_csi["csi"]["volumeAttributes"]["csi.cert-manager.io/dns-names"]


@pytest.mark.timeout(60)
def test_an_indexed_jobs_state_dir_is_a_claim_of_the_pod_or_an_emptydir():
    docs = _render(*JOB, "--set", "persistence.storageClassName=fast")
    volumes = {v["name"]: v for v in _pod_spec(docs)["volumes"]}
    claim = volumes["state"]["ephemeral"]["volumeClaimTemplate"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    mounts = {m["name"]: m["mountPath"] for m in _container(docs)["volumeMounts"]}
    assert str(_agent_args(docs).state_dir) == mounts["state"]
    plain = _render(*JOB, "--set", "persistence.enabled=false")
    assert {v["name"]: v for v in _pod_spec(plain)["volumes"]}["state"] == {
        "name": "state",
        "emptyDir": {},
    }


def _job_mode_values(name: str) -> list[str]:
    args = list(VALUE_SETS[name])
    if "podDisruptionBudget.maxUnavailable=1" in args:  # refused in Job mode (tested below)
        i = args.index("podDisruptionBudget.maxUnavailable=1")
        del args[i - 1 : i + 1]
    return [*args, *JOB]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_value_set_renders_a_valid_indexed_job_whose_pods_the_other_objects_select(
    name: str,
):
    docs = _render(*_job_mode_values(name))
    _validate_builtin(docs)
    kinds = sorted(d["kind"] for d in docs)
    assert len(kinds) == len(set(kinds)) and "StatefulSet" not in kinds
    job = _one(docs, "Job")
    labels = job["spec"]["template"]["metadata"]["labels"]
    for doc in docs:
        assert doc["metadata"]["namespace"] == "train"
        selector: dict[str, str] | None = None
        if doc["kind"] == "Service":
            selector = doc["spec"]["selector"]
        elif doc["kind"] in ("NetworkPolicy",):
            selector = doc["spec"]["podSelector"]["matchLabels"]
            peers = doc["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
            assert peers.items() <= labels.items()  # the job's agents reach each other
        elif doc["kind"] == "PodDisruptionBudget":
            selector = doc["spec"]["selector"]["matchLabels"]
            assert isinstance(doc["spec"]["minAvailable"], int)  # no scale subresource
        if selector is not None:
            assert selector and selector.items() <= labels.items(), doc["kind"]
    args = _agent_args(docs)
    assert args.on_job_end == "exit" and args.node_id == POD["POD_NAME"]


@pytest.mark.timeout(60)
def test_the_statefulset_is_still_the_default_workload():
    docs = _render()
    assert "Job" not in {d["kind"] for d in docs}
    args = _agent_args(docs, "StatefulSet")
    assert args.on_job_end == "idle" and args.unfinished_exit_code == 0
    assert _pod_spec(docs, "StatefulSet").get("restartPolicy", "Always") == "Always"
    assert "subdomain" not in _pod_spec(docs, "StatefulSet")


def _stop_s(stop_timeout_s: float) -> int:
    """Seconds from SIGTERM to the agent's exit at most (elasticpp.agent.lifetime): the
    stop's deadline, then the SIGKILL of its tree and the wait for it."""
    return math.ceil(stop_timeout_s) + math.ceil(AGENT_STOP_KILL_WAIT_S)


DEFAULT_STOP_TIMEOUT_S = next(
    f.default for f in dataclasses.fields(JobSpec) if f.name == "stop_timeout_s"
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workload", ["statefulset", "indexedJob"])
def test_the_grace_period_covers_the_drain_then_the_agents_stop_after_sigterm(workload: str):
    """Kubernetes sends SIGTERM once preStop returned (its drain request, then the drain
    itself), and SIGKILL at terminationGracePeriodSeconds: the agent's stop must fit in
    between. N, the agent's SIGTERM-to-exit bound, comes from the code's own defaults."""
    mode = ["--set", f"workload={workload}"]
    kind = "Job" if workload == "indexedJob" else "StatefulSet"

    def grace_and_drain(*extra: str) -> tuple[int, Any]:
        docs = _render(*mode, *extra)
        script = _container(docs, kind)["lifecycle"]["preStop"]["exec"]["command"][2]
        drain = _parse_cli(_elasticpp_calls(script)[0])
        return int(_pod_spec(docs, kind)["terminationGracePeriodSeconds"]), drain

    grace, drain = grace_and_drain()
    assert grace >= drain.wait + drain.timeout + _stop_s(DEFAULT_STOP_TIMEOUT_S)
    # The chart refuses a margin that does not cover them, naming it; the boundary is exact,
    # so the chart's copies of the code's figures cannot drift unnoticed.
    for stop_timeout in (None, 45.5):
        spec = [] if stop_timeout is None else ["--set", f"jobSpec.stop_timeout_s={stop_timeout}"]
        need = math.ceil(drain.timeout) + _stop_s(stop_timeout or DEFAULT_STOP_TIMEOUT_S)
        grace, drain = grace_and_drain(*spec, "--set", f"drain.graceMarginSeconds={need}")
        assert grace == drain.wait + need
        short = _template(*mode, *spec, "--set", f"drain.graceMarginSeconds={need - 1}")
        assert short.returncode != 0, short.stdout
        assert f"drain.graceMarginSeconds ({need - 1}) must be at least {need}" in short.stderr


IMPOSSIBLE_IN_JOB_MODE = {
    "pdb-max-unavailable": (["--set", "podDisruptionBudget.enabled=true",
                             "--set", "podDisruptionBudget.maxUnavailable=1"],
                            "give minAvailable as a number"),
    "pdb-percentage": (["--set", "podDisruptionBudget.enabled=true",
                        "--set", "podDisruptionBudget.minAvailable=50%"],
                       "a Job has no scale subresource"),
    "idle-by-hand": (["--set", "agent.extraArgs[0]=--on-job-end=idle"],
                     'agent.extraArgs: "--on-job-end=idle": with workload indexedJob'),
    "exit-code-by-hand": (["--set", "agent.extraArgs[0]=--unfinished-exit-code=0"],
                          "the chart sets --on-job-end exit and --unfinished-exit-code itself"),
    "negative-ttl": (["--set", "job.ttlSecondsAfterFinished=-1"], "/job/ttlSecondsAfterFinished"),
    "negative-backoff": (["--set", "job.backoffLimit=-1"], "/job/backoffLimit"),
}  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(IMPOSSIBLE_IN_JOB_MODE))
def test_impossible_job_mode_values_fail_with_a_message_naming_them(case: str):
    args, message = IMPOSSIBLE_IN_JOB_MODE[case]
    proc = _template(*JOB, *args)
    assert proc.returncode != 0, proc.stdout
    assert message in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_an_unknown_workload_is_refused_naming_the_ones_there_are():
    proc = _template("--set", "workload=job")
    assert proc.returncode != 0
    assert "/workload" in proc.stderr and "indexedJob" in proc.stderr, proc.stderr
