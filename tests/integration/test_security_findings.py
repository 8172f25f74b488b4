"""The security review's findings, each replayed against a live agent (a real etcd, a real
agent process with its workers, real gRPC on loopback) as the review reproduced it: every
test here failed before its fix.

One job runs for the whole module (a long one: it is stopped when the module ends); the
tests act on it one after the other and each leaves it training.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from elasticpp.agent.localcluster import LocalCluster
from elasticpp.cluster import ClusterClient
from elasticpp.cluster.etcd_client import EtcdKV
from elasticpp.cluster.records import GenerationRecord
from elasticpp.proctree import descendants
from tests.integration.test_agent_recovery import scrape

SPEC: dict[str, Any] = {
    "name": "secjob",
    "model": "tiny",
    "global_batch": 4,
    "micro_batch": 2,
    "steps": 100_000,
    "seed": 0,
    "min_nodes": 1,
    "max_nodes": 2,
    "lease_ttl_s": 3,
    "snapshot_every": 10,
    "replication_copies": 0,
}


def close_leaving_nothing(lc: LocalCluster) -> None:
    """Stop `lc`, and check that no process of its agents' trees outlived it (the module's
    two jobs run side by side: a check of every descendant would see the other's)."""
    ours = set()
    for n in lc.nodes:
        if n.proc is not None:
            ours |= {n.proc.pid, *descendants(n.proc.pid)}
    lc.close()
    left = [p for p in ours if _alive(p)]
    assert not left, f"processes left behind: {left}"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


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


def _trains_on(lc: LocalCluster, past_step: int, timeout_s: float = 120) -> None:
    lc.wait_for(lambda: lc.max_step() > past_step, timeout_s, f"a step after {past_step}")


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
        assert not c.quarantined(), "a healthy node was blamed for a forged record"


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


def _state(ch: grpc.Channel) -> Any:
    from elasticpp.rpc.state.v1 import state_pb2_grpc

    return state_pb2_grpc.StateServiceStub(ch)


def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        list(call()) if callable(call) else call
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


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


def _etcdctl(server: Any, *args: str, user: str | None = None) -> None:
    import subprocess

    etcdctl = Path(server._binary).with_name("etcdctl")
    tls = server.tls
    base = [str(etcdctl), f"--endpoints=https://{server.endpoint}", f"--cacert={tls.ca_file}"]
    base += [f"--cert={tls.cert_file}", f"--key={tls.key_file}"]
    if user is not None:
        base.append(f"--user={user}")
    subprocess.run([*base, *args], check=True, capture_output=True, timeout=30)


@pytest.mark.timeout(240)
def test_F3_agents_train_against_an_etcd_with_tls_client_certificates_and_a_confined_user(
    tmp_path: Path,
) -> None:
    """The review's F3: no flag could turn on the etcd client's TLS, client certificates or
    password, so every shipped deployment spoke plain, anonymous gRPC to etcd. Here etcd
    takes TLS only, with client certificates of its CA and authentication on; the agent's
    user may read and write its job's prefix and nothing else (the role docs/deploy.md
    gives). A wrong password is a clear error, exit 2."""
    from elasticpp.cluster.etcd_server import ServerTLS
    from tests.integration.test_etcd_client_security import make_certs

    certs = make_certs(tmp_path / "certs")
    tls = ServerTLS(certs["ca.pem"], certs["server.pem"], certs["server.key"])
    (tmp_path / "pw").write_text("agent-s3cret\n")
    (tmp_path / "wrong").write_text("nope\n")
    for f in ("pw", "wrong"):
        (tmp_path / f).chmod(0o600)
    flags = [
        "--etcd-ca", str(certs["ca.pem"]), "--etcd-cert", str(certs["client.pem"]),
        "--etcd-key", str(certs["client.key"]), "--etcd-user", "agent-tls",
        "--etcd-password-file", str(tmp_path / "pw"),
    ]  # fmt: skip
    spec = {**SPEC, "name": "tlsjob", "steps": 8}
    lc = LocalCluster(tmp_path / "job", spec, nodes=2, slots=1, etcd_tls=tls, agent_args=flags)
    try:
        lc.etcd.start()
        lc.etcd.enable_auth("root-s3cret")
        root = "root:root-s3cret"
        _etcdctl(lc.etcd, "role", "add", "elasticpp-tlsjob", user=root)
        _etcdctl(
            lc.etcd, "role", "grant-permission", "elasticpp-tlsjob", "readwrite",
            "/elasticpp/tlsjob/", "--prefix=true", user=root,
        )  # fmt: skip
        _etcdctl(lc.etcd, "user", "add", "agent-tls", "--new-user-password=agent-s3cret", user=root)
        _etcdctl(lc.etcd, "user", "grant-role", "agent-tls", "elasticpp-tlsjob", user=root)
        lc.start_node("node-0")
        wrong = lc.start_node("node-1", args=["--etcd-password-file", str(tmp_path / "wrong")])
        assert wrong.proc is not None
        assert wrong.proc.wait(timeout=120) == 2
        assert "authenticate as agent-tls" in wrong.log_path.read_text()
        lc.start_node("node-1")  # the right password: it joins and trains
        lc.wait_finished(180)
        curve = lc.curve()
        assert sorted(curve) == list(range(8)), sorted(curve)
    finally:
        lc.close()


def _listeners(port: int) -> set[str]:
    """The addresses a TCP socket of this machine listens on at `port` (/proc/net/tcp{,6})."""
    import ipaddress

    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, hexport = local.partition(":")
            if state != "0A" or int(hexport, 16) != port:
                continue
            raw = bytes.fromhex(addr)
            # The kernel prints each 32-bit word in host (little-endian) order.
            words = [raw[i : i + 4][::-1] for i in range(0, width, 4)]
            ip = ipaddress.ip_address(b"".join(words))
            mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
            found.add(str(mapped or ip))
    return found


@pytest.mark.timeout(60)
def test_F9_metrics_bind_the_listen_host_not_every_interface(job: LocalCluster) -> None:
    """The review's F9: with `--listen 127.0.0.1:...`, `/metrics` listened on 0.0.0.0."""
    node = job.nodes[0]
    assert _listeners(node.port) == {"127.0.0.1"}  # gRPC, as --listen says
    assert _listeners(node.metrics_port) == {"127.0.0.1"}


# --------------------------------------------------------------------------- mutual TLS


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
    an operator's, not another name the same CA signed."""
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

    from elasticpp.cluster.etcd_server import ServerTLS
    from tests.integration.test_etcd_client_security import make_certs

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
        for n in lc.nodes:
            lc.start_node(n.node_id)
        lc.wait_for(lambda: lc.max_step() >= 4, 180, "step 4")
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
