"""The security review's findings, each replayed against a live agent (a real etcd, a real
agent process with its workers, real gRPC on loopback) as the review reproduced it: every
test here failed before its fix (F1, F2 and F13: test_security_mtls.py; F14:
test_etcd_client_security.py).

The etcd test runs first, alone; then one long job serves the others (stopped when the
module ends): they act on it one after the other and each leaves it training.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from elasticpp.agent.localcluster import LocalCluster
from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.records import GenerationRecord
from tests.findings import FINDINGS_SPEC as SPEC
from tests.findings import close_leaving_nothing, tcp_listeners
from tests.findings import etcdctl as _etcdctl
from tests.findings import state_keys as _state
from tests.findings import status_code as _code
from tests.findings import trains_on as _trains_on
from tests.recovery import scrape

PREFIX = "/elasticpp/team-a"  # the job's keys: PREFIX/<job>/ (--etcd-prefix)


def _secured_job(tmp_path: Path, name: str, nodes: int) -> tuple[LocalCluster, dict[str, Path]]:
    """A job whose etcd takes TLS only, client certificates of its CA and authentication,
    the agents' user confined to the job's keys under PREFIX (the role docs/deploy.md
    gives); etcd started and set up, no agent yet."""
    from elasticpp.cluster.etcd.server import ServerTLS
    from tests.etcdtls import make_certs

    certs = make_certs(tmp_path / "certs")
    tls = ServerTLS(certs["ca.pem"], certs["server.pem"], certs["server.key"])
    (tmp_path / "pw").write_text("agent-s3cret\n")
    (tmp_path / "pw").chmod(0o600)
    flags = [
        "--etcd-ca", str(certs["ca.pem"]), "--etcd-cert", str(certs["client.pem"]),
        "--etcd-key", str(certs["client.key"]), "--etcd-user", f"agent-{name}",
        "--etcd-password-file", str(tmp_path / "pw"), "--etcd-prefix", PREFIX,
    ]  # fmt: skip
    spec = {**SPEC, "name": name, "steps": 8}
    lc = LocalCluster(tmp_path / "job", spec, nodes=nodes, slots=1, etcd_tls=tls, agent_args=flags)
    lc.etcd.start()
    lc.etcd.enable_auth("root-s3cret")
    root = "root:root-s3cret"
    _etcdctl(lc.etcd, "role", "add", f"elasticpp-{name}", user=root)
    _etcdctl(
        lc.etcd, "role", "grant-permission", f"elasticpp-{name}", "readwrite",
        f"{PREFIX}/{name}/", "--prefix=true", user=root,
    )  # fmt: skip
    _etcdctl(lc.etcd, "user", "add", f"agent-{name}", "--new-user-password=agent-s3cret",
             user=root)  # fmt: skip
    _etcdctl(lc.etcd, "user", "grant-role", f"agent-{name}", f"elasticpp-{name}", user=root)
    return lc, certs


@pytest.mark.timeout(240)
def test_F3_agents_train_against_an_etcd_with_tls_client_certificates_and_a_confined_user(
    tmp_path: Path,
) -> None:
    """The review's F3: no flag could turn on the etcd client's TLS, client certificates or
    password, so every shipped deployment spoke plain, anonymous gRPC to etcd. Here etcd
    takes TLS only, with client certificates of its CA and authentication on; the agent's
    user may read and write its job's prefix and nothing else (the role docs/deploy.md
    gives). A wrong password is a clear error, exit 2."""
    lc, _ = _secured_job(tmp_path, "tlsjob", nodes=2)
    (tmp_path / "wrong").write_text("nope\n")
    try:
        lc.start_node("node-0")
        wrong = lc.start_node("node-1", args=["--etcd-password-file", str(tmp_path / "wrong")])
        assert wrong.proc is not None
        assert wrong.proc.wait(timeout=120) == 2
        assert "authenticate as agent-tlsjob" in wrong.log_path.read_text()
        lc.start_node("node-1")  # the right password: it joins and trains
        lc.wait_finished(180)
        curve = lc.curve()
        assert sorted(curve) == list(range(8)), sorted(curve)
    finally:
        lc.close()


@pytest.mark.timeout(240)
def test_F5_a_forged_end_of_the_job_cannot_be_written_to_an_authenticated_etcd(
    tmp_path: Path,
) -> None:
    """The review's F5: an anonymous `etcdctl put` of an `ended` record made every agent
    exit 3 for good. With etcd's authentication on (F3), a client of the job's etcd CA that
    is no user of the job's role cannot write it, nor anything else of the job: the job
    trains on and finishes."""
    from elasticpp.cluster.errors import ClusterError
    from elasticpp.cluster.etcd.kv import EtcdKV, EtcdSecurity

    lc, certs = _secured_job(tmp_path, "endjob", nodes=1)
    try:
        lc.start_node("node-0")
        lc.wait_for(lambda: lc.max_step() >= 2, 120, "step 2")
        stranger = EtcdKV(
            [f"https://{lc.etcd.endpoint}"],
            security=EtcdSecurity(certs["ca.pem"], certs["client.pem"], certs["client.key"]),
            request_timeout_s=2.0,
        )
        forged = {"format_version": 1, "status": "failed", "reason": "forged", "by": "node-0"}
        try:
            for key in (f"{PREFIX}/endjob/ended", f"{PREFIX}/endjob/generation"):
                with pytest.raises(ClusterError):
                    stranger.put(key, json.dumps({**forged, "at": 0, "step": -1}))
        finally:
            stranger.close()
        lc.wait_finished(180)  # exit 0: the job finished, nothing ended it
        assert sorted(lc.curve()) == list(range(8))
    finally:
        lc.close()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    lc = LocalCluster(tmp_path_factory.mktemp("sec") / "job", SPEC, nodes=1, slots=1)
    try:
        lc.start()
        lc.wait_for(lambda: lc.max_step() >= 2, 120, "step 2")
        yield lc
    finally:
        close_leaving_nothing(lc)


def _generation(lc: LocalCluster) -> tuple[GenerationRecord, str]:
    with ClusterClient([lc.etcd.endpoint], SPEC["name"]) as c:
        record, _ = c.read_generation()
        assert record is not None
        return record, c.keys.generation


def _skipped(lc: LocalCluster) -> float:
    return scrape(lc.nodes[0].metrics_port).get("elasticpp_etcd_values_skipped_total", 0.0)


@pytest.mark.timeout(240)
def test_F4_a_forged_plan_naming_code_is_refused_and_nothing_it_names_runs(
    job: LocalCluster, tmp_path: Path
) -> None:
    """The review's F4: one anonymous etcd write of a plan whose model family is
    `subprocess:getoutput` ran a shell command in a worker. Now every node builds the model
    of its own job spec: the forged record is skipped and counted, the leader writes over it
    (blaming nobody), and training goes on; the command never runs."""
    marker = tmp_path / "PWNED.txt"
    current, key = _generation(job)
    skipped_before = _skipped(job)
    # An earlier release's form, the model spelled out (the review's reproduction) ...
    spelled = copy.deepcopy(current.plan)
    spelled.pop("model_fingerprint", None)
    spelled["format_version"] = 2
    spelled["model"] = {
        **json.loads(json.dumps(_tiny_model())),
        "family": "subprocess:getoutput",
        "options": {f"echo FORGED > {marker}": 1},
    }
    # ... and the record form with a model section added and another fingerprint.
    other = {**copy.deepcopy(current.plan), "model_fingerprint": "0" * 64}
    other["model"] = spelled["model"]
    raw = EtcdKV([job.etcd.endpoint])
    try:
        generation = current.generation
        for plan in (spelled, other):
            generation += 1
            forged = json.loads(current.to_json())
            forged["generation"] = generation
            forged["plan"] = {**plan, "generation": generation}
            forged["extra"]["reason"] = "forged by an etcd writer"
            raw.put(key, json.dumps(forged))

            def superseded(g: int = generation) -> bool:
                return _generation(job)[0].generation > g

            job.wait_for(superseded, 60, f"the leader to write over forged generation {generation}")
            record, _ = _generation(job)
            assert "refused" in record.extra["reason"], record.extra
            generation = record.generation
    finally:
        raw.close()
    _trains_on(job, job.max_step())
    assert not marker.exists(), marker.read_text()
    assert _skipped(job) > skipped_before
    log = job.nodes[0].log_path.read_text()
    assert "ContractError" not in log  # no worker was handed the forged model
    assert f"etcd value of {key} skipped" in log
    with ClusterClient([job.etcd.endpoint], SPEC["name"]) as c:
        assert not c.health.quarantined(), "a healthy node was blamed for a forged record"


def _tiny_model() -> dict[str, Any]:
    from elasticpp.plan.specs import MODEL_PRESETS

    return MODEL_PRESETS["tiny"].to_dict()


def _held_piece(job: LocalCluster) -> tuple[int, Any]:
    """The node's generation and the newest step it holds, with its pieces (ListSteps),
    once it holds one."""
    from elasticpp.rpc.state.v1 import state_pb2

    found: list[Any] = []

    def holds() -> bool:
        generation = _generation(job)[0].generation
        with grpc.insecure_channel(job.nodes[0].address) as ch:
            request = state_pb2.ListStepsRequest(generation=generation)
            reply = _state(ch).ListSteps(request, timeout=10)
        found[:] = [reply.generation, *reply.steps[-1:]]
        return len(found) == 2

    job.wait_for(holds, 120, "a committed step on the node")
    return found[0], found[1]


def _tracebacks(job: LocalCluster) -> int:
    return job.nodes[0].log_path.read_text().count("Traceback")


@pytest.mark.timeout(120)
def test_F11_names_are_matched_whole_and_in_ascii_digits(job: LocalCluster) -> None:
    """The review's F11: a piece name with a trailing newline, or with Arabic-Indic digits,
    was served; `origin_node="n0\\n"` and `LiftQuarantine("n0\\n")` passed the name check."""
    from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc
    from elasticpp.rpc.state.v1 import state_pb2

    generation, held = _held_piece(job)
    name = held.pieces[0].name
    arabic = name.replace("tp0-1", "tp\u0660-\u0661")
    assert arabic != name
    node = job.nodes[0].node_id
    with grpc.insecure_channel(job.nodes[0].address) as ch:

        def fetch(piece: str, origin: str = held.origin_node) -> Any:
            request = state_pb2.FetchPieceRequest(
                generation=generation, step=held.step, name=piece, origin_node=origin
            )
            return lambda: _state(ch).FetchPiece(request, timeout=10)

        assert _code(fetch(name)) == (grpc.StatusCode.OK, "")  # the real name is served
        for bad in (fetch(name + "\n"), fetch(arabic), fetch(name, origin=node + "\n")):
            code, details = _code(bad)
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        lift = agent_pb2_grpc.AgentServiceStub(ch).LiftQuarantine
        code, _ = _code(lambda: [lift(agent_pb2.LiftQuarantineRequest(node_id=node + "\n"))])
        assert code is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.timeout(120)
def test_F10_oversized_numbers_and_names_get_invalid_argument_without_a_traceback(
    job: LocalCluster,
) -> None:
    """The review's F10: a tp size of 5,000 digits and a page token of 5,000 digits gave
    UNKNOWN and an ERROR traceback in the agent's log per request; a 15 MiB name was echoed
    into a reply trailer over the client's metadata limit."""
    from elasticpp.rpc.state.v1 import state_pb2

    generation, held = _held_piece(job)
    before = _tracebacks(job)
    digits = "9" * 5000
    options = [("grpc.max_send_message_length", 32 << 20)]
    with grpc.insecure_channel(job.nodes[0].address, options=options) as ch:
        for name in (f"embed.tp0-{digits}.safetensors", "x" * (15 << 20)):
            request = state_pb2.FetchPieceRequest(
                generation=generation, step=held.step, name=name, origin_node=held.origin_node
            )
            code, details = _code(lambda r=request: _state(ch).FetchPiece(r, timeout=20))
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details[:200])
            assert len(details) < 200
        request = state_pb2.ListHoldingsRequest(
            generation=generation, steps=[held.step], page_token=f"{digits}/n0/x"
        )
        code, details = _code(lambda: [_state(ch).ListHoldings(request, timeout=10)])
        assert code is grpc.StatusCode.INVALID_ARGUMENT and len(details) < 200, code
    assert _tracebacks(job) == before


def _listeners(port: int) -> set[str]:
    """The addresses a TCP socket of this machine listens on at `port`."""
    return {addr for addr, p in tcp_listeners().values() if p == port}


@pytest.mark.timeout(60)
def test_F9_metrics_bind_the_listen_host_not_every_interface(job: LocalCluster) -> None:
    """The review's F9: with `--listen 127.0.0.1:...`, `/metrics` listened on 0.0.0.0."""
    node = job.nodes[0]
    assert _listeners(node.port) == {"127.0.0.1"}  # gRPC, as --listen says
    assert _listeners(node.metrics_port) == {"127.0.0.1"}


@pytest.mark.timeout(60)
def test_F6_the_rendezvous_store_listens_on_the_advertised_address_under_a_secret_prefix(
    job: LocalCluster,
) -> None:
    """The review's F6: the workers' TCPStore listened on every interface whatever host it
    was given, under the predictable prefix `gen<G>`, so a stranger could pre-seed the next
    generation's keys. Now it listens on the advertised address alone, and each generation's
    workers meet under a prefix with the leader's fresh secret, written with the record."""
    import re

    record, _ = _generation(job)
    assert record.store_address is not None
    host, _, port = record.store_address.rpartition(":")
    assert _listeners(int(port)) == {host} == {"127.0.0.1"}
    assert re.fullmatch(rf"gen{record.generation}-[0-9a-f]{{32}}", record.rendezvous_prefix)


@pytest.mark.timeout(240)
def test_fuzzed_requests_of_every_rpc_get_a_status_and_the_agent_trains_on(
    job: LocalCluster,
) -> None:
    """Every field of every RPC, fuzzed against the live agent (fixed examples, the same on
    every run): each call is answered within its deadline with a status of its own (never
    UNKNOWN or INTERNAL: a crash in a handler), no traceback is logged, and the agent is
    still serving and training, its commits kept. (Drain is sent only refusable values: a
    valid one would drain the node.)"""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc
    from elasticpp.rpc.state.v1 import state_pb2

    # Half of the generations pass the fence (a newer one than the node's), so the other
    # fields are reached.
    u64 = st.integers(min_value=0, max_value=2**64 - 1) | st.just(2**64 - 1)
    digits = "9" * 5000
    text = st.sampled_from(
        [
            "embed.tp0-1.safetensors", "node-0", "../x", "n0\n", digits, "",
            f"{digits}/node-0/embed.tp0-1.safetensors", f"embed.tp0-{digits}.safetensors",
            "embed.tp0-1.safetensors\n", "embed.tp\u0660-\u0661.safetensors", "x" * 70_000,
        ]
    ) | st.text(max_size=300)  # fmt: skip
    requests = st.one_of(
        st.builds(lambda g, e: ("ListSteps", state_pb2.ListStepsRequest(generation=g, epoch=e)),
                  u64, u64),
        st.builds(
            lambda g, e, s, t, p: (
                "ListHoldings",
                state_pb2.ListHoldingsRequest(
                    generation=g, epoch=e, steps=s, page_token=t, page_pieces=p
                ),
            ),
            u64, u64, st.lists(u64, max_size=1100), text,
            st.integers(min_value=0, max_value=2**32 - 1),
        ),
        st.builds(
            lambda g, s, n, o, off, e, v: (
                "FetchPiece",
                state_pb2.FetchPieceRequest(
                    generation=g, step=s, name=n, origin_node=o, offset=off, epoch=e, verify=v
                ),
            ),
            u64, u64, text, text, u64, u64, st.booleans(),
        ),
        st.builds(lambda n: ("LiftQuarantine", agent_pb2.LiftQuarantineRequest(node_id=n)), text),
        st.builds(
            lambda t: ("Drain", agent_pb2.DrainRequest(timeout_s=t)),
            st.sampled_from([float("nan"), float("inf"), -1.0, -1e300]),
        ),
        st.just(("GetStatus", agent_pb2.GetStatusRequest())),
    )  # fmt: skip
    before = _tracebacks(job)
    seen: dict[str, set[str]] = {}
    options = [("grpc.max_receive_message_length", 32 << 20)]
    with grpc.insecure_channel(job.nodes[0].address, options=options) as ch:
        agent, state = agent_pb2_grpc.AgentServiceStub(ch), _state(ch)

        @settings(max_examples=120, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(requests)
        @example(
            (
                "FetchPiece",
                state_pb2.FetchPieceRequest(
                    name=f"embed.tp0-{digits}.safetensors", origin_node="node-0"
                ),
            )
        )
        @example(
            (
                "FetchPiece",
                state_pb2.FetchPieceRequest(
                    name="embed.tp0-1.safetensors\n", origin_node="node-0\n"
                ),
            )
        )
        @example(
            (
                "ListHoldings",
                state_pb2.ListHoldingsRequest(
                    steps=[1], page_token=f"{digits}/node-0/embed.tp0-1.safetensors"
                ),
            )
        )
        @example(("FetchPiece", state_pb2.FetchPieceRequest(name="x" * (1 << 20))))
        def call(item: tuple[str, Any]) -> None:
            method, request = item
            stub = agent if hasattr(agent, method) else state
            try:
                reply = getattr(stub, method)(request, timeout=10)
                if method == "FetchPiece":
                    list(reply)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (method, code)
            assert code is not grpc.StatusCode.DEADLINE_EXCEEDED, method  # no hang
            seen.setdefault(method, set()).add(code.name)

        call()
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert set(seen) == {"ListSteps", "ListHoldings", "FetchPiece", "LiftQuarantine", "Drain",
                         "GetStatus"}, seen  # fmt: skip
    assert seen["Drain"] == {"INVALID_ARGUMENT"}
    _trains_on(job, job.max_step())
    assert _tracebacks(job) == before
    assert "commit is dropped" not in job.nodes[0].log_path.read_text()
