"""Mutual TLS on the agents' port, the control token and socket, and the state service's
node identities, against live agents (the security review's F1, F2 and F13; each test
failed before its fix, where no agent took a certificate at all). The job with every door
closed runs first, alone; then one long job serves the tests of the doors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from elasticpp.agent.localcluster import LocalCluster
from tests.findings import FINDINGS_SPEC as SPEC
from tests.findings import close_leaving_nothing, tcp_listeners
from tests.findings import etcdctl as _etcdctl
from tests.findings import state_keys as _state
from tests.findings import status_code as _code
from tests.findings import trains_on as _trains_on


class Doors:
    """A job whose agents take mutual TLS only, with a token for control calls and a
    control socket each; and the certificates the tests call with."""

    def __init__(self, root: Path, spec: dict[str, Any], nodes: int) -> None:
        import tempfile

        from tests.certs import issue, make_ca

        self.certs = root / "certs"
        make_ca(self.certs)
        make_ca(self.certs, "other-ca")
        for name in [f"node-{i}" for i in range(nodes)] + ["operator", "intruder"]:
            issue(self.certs, name)
        issue(self.certs, "stranger", ca="other-ca")
        self.token = root / "token"
        self.token.write_text("t0ken-" + os.urandom(16).hex() + "\n")
        self.token.chmod(0o600)
        # Unix socket paths are short (108 bytes): not under pytest's long tmp_path.
        self.sockets = Path(tempfile.mkdtemp(prefix="ep-"))
        c = self.certs
        flags = [
            "--tls-cert", f"{c}/{{node}}.pem", "--tls-key", f"{c}/{{node}}.key",
            "--tls-ca", f"{c}/ca.pem", "--token-file", str(self.token),
            "--control-socket", f"{self.sockets}/{{node}}.sock",
        ]  # fmt: skip
        self.lc = LocalCluster(root / "job", spec, nodes=nodes, slots=1, agent_args=flags)

    def dialer(self, name: str | None, *, token: bool = False, ca: str = "ca") -> Any:
        from elasticpp.transport import Dialer, TLSFiles, TokenFile

        if name is None:
            return Dialer()
        c = self.certs
        tls = TLSFiles(c / f"{name}.pem", c / f"{name}.key", c / f"{ca}.pem")
        return Dialer(tls, TokenFile(self.token) if token else None)

    def socket(self, node: str) -> str:
        return f"unix:{self.sockets}/{node}.sock"

    def close(self) -> None:
        import shutil

        try:
            close_leaving_nothing(self.lc)
        finally:
            shutil.rmtree(self.sockets, ignore_errors=True)


@pytest.mark.timeout(360)
def test_a_node_loss_and_rejoin_with_every_door_closed_trains_the_reference_curve(
    tmp_path: Path,
) -> None:
    """Mutual TLS between the agents (state transfer, probes, the leader's holdings pull),
    the control token, and an etcd that takes TLS only, client certificates and a user
    confined to the job: a node is killed and comes back, and the job's loss curve is the
    uninterrupted run's."""
    import subprocess
    import sys

    from elasticpp.cluster.etcd.server import ServerTLS
    from tests.etcdtls import make_certs

    steps = 300  # long enough that the killed node's return is planned in before the end
    spec = {
        **SPEC, "name": "closed", "global_batch": 8, "steps": steps, "seed": 3,
        "snapshot_every": 1, "replication_copies": 1,
    }  # fmt: skip
    reference = tmp_path / "ref.jsonl"
    subprocess.run(
        [
            sys.executable, "-m", "elasticpp.cli.main", "train", "--model", "tiny",
            "--global-batch", "8", "--micro-batch", "2", "--steps", str(steps), "--seed", "3",
            "--metrics", str(reference),
        ],
        check=True,
        timeout=240,
    )  # fmt: skip
    expected = {int(r["step"]): float(r["loss"]) for r in map(json.loads, reference.open())}
    doors = Doors(tmp_path, spec, nodes=2)  # dp=2: both nodes train
    etcd_certs = make_certs(tmp_path / "etcd-certs")
    (tmp_path / "etcd-pw").write_text("closed-s3cret\n")
    doors.lc.etcd.tls = ServerTLS(
        etcd_certs["ca.pem"], etcd_certs["server.pem"], etcd_certs["server.key"]
    )
    doors.lc.agent_args += (
        "--etcd-ca", str(etcd_certs["ca.pem"]), "--etcd-cert", str(etcd_certs["client.pem"]),
        "--etcd-key", str(etcd_certs["client.key"]), "--etcd-user", "agent-closed",
        "--etcd-password-file", str(tmp_path / "etcd-pw"),
    )  # fmt: skip
    lc = doors.lc
    try:
        lc.etcd.start()
        lc.etcd.enable_auth("root-pw")
        root = "root:root-pw"
        _etcdctl(lc.etcd, "role", "add", "closed", user=root)
        _etcdctl(
            lc.etcd, "role", "grant-permission", "closed", "readwrite", "/elasticpp/closed/",
            "--prefix=true", user=root,
        )  # fmt: skip
        _etcdctl(lc.etcd, "user", "add", "agent-closed", "--new-user-password=closed-s3cret",
                 user=root)  # fmt: skip
        _etcdctl(lc.etcd, "user", "grant-role", "agent-closed", "closed", user=root)
        # The workers (user code) must not learn where systemd keeps the agent's own
        # credentials, nor the agent's configuration; the user's own variables are theirs
        # and pass.
        leaky = {
            "CREDENTIALS_DIRECTORY": str(tmp_path),
            "ELASTICPP_LOG_LEVEL": "info",  # a flag's fallback: the agent's alone
            "HF_TOKEN": "users-own-token",
        }
        for n in lc.nodes:
            lc.start_node(n.node_id, env=leaky)
        lc.wait_for(lambda: lc.max_step() >= 4, 180, "step 4")
        workers = lc.worker_pids("node-0")
        assert workers
        for pid in workers:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert b"CREDENTIALS_DIRECTORY" not in environ
            assert b"ELASTICPP_LOG_LEVEL" not in environ
            assert b"ELASTICPP_NODE_ID=node-0" in environ  # what the agent tells it
            assert b"HF_TOKEN=users-own-token" in environ
        lc.kill_node("node-1")
        lost_at = lc.max_step()
        lc.wait_for(lambda: lc.max_step() >= lost_at + 4, 180, "steps without node-1")
        victim = lc.node("node-1")
        (victim.state_dir / "metrics.jsonl").unlink()  # what it trains from now on
        lc.start_node("node-1")

        def rejoined() -> bool:
            rows = victim.state_dir / "metrics.jsonl"
            return rows.is_file() and bool(rows.read_text().strip())

        lc.wait_for(rejoined, 120, "node-1 training again, planned back in over mutual TLS")
        lc.wait_finished(240)
        curve = lc.curve()
        assert sorted(curve) == list(range(steps)), sorted(curve)[:10]
        for step, (loss, _generation) in curve.items():
            assert loss == pytest.approx(expected[step], rel=1e-4), step
        logs = "".join(n.log_path.read_text() for n in lc.nodes if n.log_path)
        assert "PERMISSION_DENIED" not in logs and "UNAUTHENTICATED" not in logs
    finally:
        doors.close()


@pytest.fixture(scope="module")
def doors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Doors]:
    d = Doors(tmp_path_factory.mktemp("mtls"), {**SPEC, "name": "mtlsjob"}, nodes=2)
    try:
        d.lc.start()
        d.lc.wait_for(lambda: d.lc.max_step() >= 2, 120, "step 2 under mutual TLS")
        yield d
    finally:
        d.close()


def _agent_call(channel: grpc.Channel, method: str, request: Any, **kw: Any) -> Any:
    from elasticpp.rpc.agent.v1 import agent_pb2_grpc

    return getattr(agent_pb2_grpc.AgentServiceStub(channel), method)(request, timeout=10, **kw)


@pytest.mark.timeout(120)
def test_F1_control_calls_need_the_token_or_the_control_socket_and_strangers_get_nowhere(
    doors: Doors,
) -> None:
    """The review's F1: one anonymous plaintext Drain made a node leave within ~1 s, and
    LiftQuarantine and GetStatus answered anyone. Now the port takes mutual TLS only: a
    plaintext client and one with a certificate of another CA do not get a connection; an
    operator's certificate reads status but needs the token to drain or lift; the control
    socket needs none."""
    from elasticpp.rpc.agent.v1 import agent_pb2

    address = doors.lc.nodes[0].address
    drain = agent_pb2.DrainRequest(timeout_s=1e-9)
    for dialer in (doors.dialer(None), doors.dialer("stranger", ca="other-ca")):
        with dialer.channel(address) as ch:
            code, _ = _code(lambda ch=ch: [_agent_call(ch, "Drain", drain)])
            assert code is grpc.StatusCode.UNAVAILABLE, code  # no TLS session at all
    # The stranger's certificate against our CA: the handshake fails on the server's side.
    with doors.dialer("stranger").channel(address) as ch:
        code, _ = _code(lambda: [_agent_call(ch, "GetStatus", agent_pb2.GetStatusRequest())])
        assert code is grpc.StatusCode.UNAVAILABLE, code
    with doors.dialer("operator").channel(address) as ch:
        status = _agent_call(ch, "GetStatus", agent_pb2.GetStatusRequest())
        assert status.node_id == "node-0"
        for method, request in (
            ("Drain", drain),
            ("LiftQuarantine", agent_pb2.LiftQuarantineRequest(node_id="node-1")),
        ):
            code, _ = _code(lambda m=method, r=request: [_agent_call(ch, m, r)])
            assert code is grpc.StatusCode.UNAUTHENTICATED, (method, code)
    with doors.dialer("operator", token=True).channel(address) as ch:
        lift = agent_pb2.LiftQuarantineRequest(node_id="nobody")
        code, _ = _code(lambda: [_agent_call(ch, "LiftQuarantine", lift)])
        assert code is grpc.StatusCode.NOT_FOUND  # past the door: nobody is quarantined
    with doors.dialer(None).channel(doors.socket("node-0")) as ch:
        lift = agent_pb2.LiftQuarantineRequest(node_id="nobody")
        code, _ = _code(lambda: [_agent_call(ch, "LiftQuarantine", lift)])
        assert code is grpc.StatusCode.NOT_FOUND
    assert (doors.sockets / "node-0.sock").stat().st_mode & 0o777 == 0o600
    _trains_on(doors.lc, doors.lc.max_step())  # nothing of this moved the job
    log = doors.lc.nodes[0].log_path.read_text()
    assert "audit: LiftQuarantine by operator" in log and "audit: Drain" not in log
    assert doors.token.read_text().strip() not in log


@pytest.mark.timeout(120)
def test_F2_only_the_jobs_nodes_may_list_or_fetch_state(doors: Doors) -> None:
    """The review's F2: anyone could list and download every weight and Adam moment. Now the
    state service serves a certificate whose name is a node of the job, and no other: not
    an operator's, not another name the same CA signed; and a node only the pieces the plan
    of the source's generation assigns it (elasticpp.store.grants; the stage rule itself is
    unit-tested on a pp=2 plan: this job's two nodes are data-parallel twins)."""
    from elasticpp.rpc.state.v1 import state_pb2

    address = doors.lc.nodes[0].address
    generation = 2**64 - 1  # the caller's claim no longer opens anything by itself
    for name in ("intruder", "operator"):
        with doors.dialer(name, token=True).channel(address) as ch:
            request = state_pb2.ListStepsRequest(generation=generation)
            code, details = _code(lambda ch=ch, r=request: [_state(ch).ListSteps(r, timeout=10)])
            assert code is grpc.StatusCode.PERMISSION_DENIED, (name, code)
            assert "is not a node of this job" in details
            fetch = state_pb2.FetchPieceRequest(
                generation=generation, step=10, name="embed.tp0-1.safetensors", origin_node="node-0"
            )
            code, _ = _code(lambda ch=ch, r=fetch: _state(ch).FetchPiece(r, timeout=10))
            assert code is grpc.StatusCode.PERMISSION_DENIED, (name, code)
    with doors.dialer("node-1").channel(address) as ch:
        reply = _state(ch).ListSteps(state_pb2.ListStepsRequest(generation=generation), timeout=10)
        assert reply.node_id == "node-0"

        # A node of the job fetches what the plan of the node's generation assigns it, and
        # nothing else; a generation of its own making opens nothing.
        record, _ = _generation_of(doors)

        def own_steps() -> list[Any]:
            asked = state_pb2.ListStepsRequest(generation=record.generation)
            listed = _state(ch).ListSteps(asked, timeout=10)
            return [s for s in listed.steps if s.origin_node == "node-0"]

        doors.lc.wait_for(lambda: bool(own_steps()), 120, "a step node-0 committed")
        held = own_steps()[0]
        piece = next(p for p in held.pieces if p.name.startswith("embed."))

        def fetch(name: str, gen: int) -> tuple[Any, str]:
            request = state_pb2.FetchPieceRequest(
                generation=gen, step=held.step, name=name, origin_node="node-0"
            )
            return _code(lambda: list(_state(ch).FetchPiece(request, timeout=20)))

        served = list(
            _state(ch).FetchPiece(
                state_pb2.FetchPieceRequest(
                    generation=record.generation, step=held.step, name=piece.name,
                    origin_node="node-0",
                ),
                timeout=20,
            )
        )  # fmt: skip
        assert sum(len(c.data) for c in served) == piece.size
        code, details = fetch("ghost.tp0-1.safetensors", record.generation)
        assert code is grpc.StatusCode.PERMISSION_DENIED, details
        assert f"generation {record.generation} assigns node node-1 no rank" in details
        code, details = fetch(piece.name, generation)
        assert code is grpc.StatusCode.UNAVAILABLE, details
        assert f"it has not reached generation {generation}" in details
    assert "refused a state transfer to node-1" in doors.lc.nodes[0].log_path.read_text()


@pytest.mark.timeout(120)
def test_F13_event_streams_are_for_authorised_callers_only(doors: Doors) -> None:
    """The review's F13: four anonymous WatchEvents streams took every slot, and the
    operator's `ctl events` was refused. Now a stream needs the token: strangers hold none."""
    import subprocess
    import sys

    from elasticpp.rpc.agent.v1 import agent_pb2

    address = doors.lc.nodes[0].address
    with doors.dialer("intruder").channel(address) as ch:
        for _ in range(6):
            stream = _agent_call(ch, "WatchEvents", agent_pb2.WatchEventsRequest())
            code, _ = _code(lambda s=stream: next(s))
            assert code is grpc.StatusCode.UNAUTHENTICATED, code
    c = doors.certs
    ctl = [
        sys.executable, "-m", "elasticpp.cli.main", "ctl", "--agent", address,
        "--tls-cert", str(c / "operator.pem"), "--tls-key", str(c / "operator.key"),
        "--tls-ca", str(c / "ca.pem"), "--token-file", str(doors.token), "--timeout", "10",
    ]  # fmt: skip
    with subprocess.Popen([*ctl, "events"], stdout=subprocess.PIPE, text=True) as events:
        try:
            assert events.stdout is not None
            assert "gen=" in events.stdout.readline()  # the agent's decisions, streamed
        finally:
            events.kill()
    status = subprocess.run([*ctl, "status", "--json"], capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["node_id"] == "node-0"


def _not_after(cert: Path) -> float:
    import ssl
    import subprocess

    out = subprocess.run(
        ["openssl", "x509", "-enddate", "-noout", "-in", str(cert)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return float(ssl.cert_time_to_seconds(out.strip().removeprefix("notAfter=")))


def _served_not_after(doors: Doors, port: int) -> float:
    """The expiry of the certificate the agent presents to a new TLS session."""
    import socket
    import ssl

    context = ssl.create_default_context(cafile=str(doors.certs / "ca.pem"))
    context.load_cert_chain(doors.certs / "operator.pem", doors.certs / "operator.key")
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        return float(ssl.cert_time_to_seconds(tls.getpeercert()["notAfter"]))


@pytest.mark.timeout(120)
def test_a_renewed_certificate_is_used_without_a_restart_and_its_expiry_is_exported(
    doors: Doors,
) -> None:
    """The agent's certificate is read again when its files change: a renewal (here from 2
    to 30 days) shows in `elasticpp_tls_certificate_expiry_timestamp_seconds` and new
    connections get the new certificate; the alert watches the metric."""
    from elasticpp.rpc.agent.v1 import agent_pb2
    from elasticpp.waiting import wait_until
    from tests.certs import issue
    from tests.recovery import scrape

    node = doors.lc.nodes[0]
    metric = "elasticpp_tls_certificate_expiry_timestamp_seconds"
    cert = doors.certs / "node-0.pem"
    assert scrape(node.metrics_port)[metric] == pytest.approx(_not_after(cert))
    issue(doors.certs, "node-0", days=30)  # the same name, a new key and certificate
    renewed = _not_after(cert)
    assert wait_until(lambda: scrape(node.metrics_port)[metric] == pytest.approx(renewed), 10)
    with doors.dialer("operator").channel(node.address) as ch:  # a new TLS session
        assert _agent_call(ch, "GetStatus", agent_pb2.GetStatusRequest()).node_id == "node-0"
    assert _served_not_after(doors, node.port) == pytest.approx(renewed)  # the new one
    _trains_on(doors.lc, doors.lc.max_step())  # peers dial it with the new certificate


def _socket_inodes(pid: int) -> set[int]:
    import contextlib

    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                found.add(int(target[8:-1]))
    return found


def _unix_listeners() -> dict[int, str]:
    out = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON: listening
            out[int(fields[6])] = fields[7]
    return out


@pytest.mark.timeout(120)
def test_every_listening_socket_of_a_node_is_one_docs_deploy_lists(doors: Doors) -> None:
    """docs/deploy.md's table of a node's listening sockets, against the live agents' (from
    /proc/net): the agent listens on its gRPC port, its metrics port, its control socket
    and, on the leader, the rendezvous store, each on the listen (advertised) address; its
    workers' gloo sockets listen there too; nothing listens on every interface."""
    from elasticpp.proctree import descendants

    table = (Path(__file__).parents[2] / "docs" / "deploy.md").read_text()
    rows = table.split("**Every listening socket of a node:**", 1)[1].split("\n\n", 2)[1]
    for kind in ("agent gRPC", "health", "control socket", "metrics", "rendezvous store",
                 "gloo / NCCL"):  # fmt: skip
        assert f"\n| {kind}" in rows, kind
    record, _ = _generation_of(doors)
    store_port = int(str(record.store_address).rpartition(":")[2])
    tcp, unix = tcp_listeners(), _unix_listeners()
    for n in doors.lc.nodes:
        assert n.proc is not None
        agent = _socket_inodes(n.proc.pid)
        ports = {tcp[i][1] for i in agent if i in tcp}
        expected = {n.port, n.metrics_port} | (
            {store_port} if n.node_id == record.leader else set()
        )
        assert ports == expected, (n.node_id, ports, expected)
        assert {unix[i] for i in agent if i in unix} == {f"{doors.sockets}/{n.node_id}.sock"}
        for pid in [n.proc.pid, *descendants(n.proc.pid)]:
            for inode in _socket_inodes(pid):
                if inode in tcp:
                    assert tcp[inode][0] == "127.0.0.1", (n.node_id, pid, tcp[inode])


def _generation_of(doors: Doors) -> Any:
    """The generation record, read as the job's etcd user (plaintext etcd here)."""
    from elasticpp.cluster.client import ClusterClient

    with ClusterClient([doors.lc.etcd.endpoint], str(doors.lc.spec["name"])) as c:
        return c.read_generation()
