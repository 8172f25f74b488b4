"""Who may call what on an agent (`elasticpp.agent.auth.decide`, pure), and the refusal of
a plaintext agent on a non-loopback address (the security review's F1, its pure parts)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from elasticpp.agent.auth import METHODS, Caller, Door, Policy, decide
from elasticpp.agent.config import AgentConfig
from elasticpp.cli.main import main as cli_main
from elasticpp.errors import ConfigError
from elasticpp.transport import TokenFile

MEMBERS = {"n0", "n1"}
TLS_AND_TOKEN = Policy(tls=True, token=True)
DRAIN = "/elasticpp.agent.v1.AgentService/Drain"
FETCH = "/elasticpp.state.v1.StateService/FetchPiece"
STATUS = "/elasticpp.agent.v1.AgentService/GetStatus"


def _decide(method: str, caller: Caller, policy: Policy = TLS_AND_TOKEN) -> object:
    refused = decide(method, caller, policy, MEMBERS.__contains__)
    return None if refused is None else refused[0]


def test_every_state_changing_call_needs_the_token_or_the_control_socket() -> None:
    control = [m for m, d in METHODS.items() if d is Door.CONTROL]
    assert {m.rsplit("/", 1)[1] for m in control} == {"Drain", "LiftQuarantine", "WatchEvents"}
    for method in control:
        operator = Caller(local=False, identity="operator", token_ok=False)
        assert _decide(method, operator) is grpc.StatusCode.UNAUTHENTICATED
        assert _decide(method, Caller(False, "operator", token_ok=True)) is None
        assert _decide(method, Caller(True, None, token_ok=False)) is None  # the socket


def test_state_is_served_to_the_jobs_nodes_alone() -> None:
    for method in [m for m, d in METHODS.items() if d is Door.PEER]:
        assert _decide(method, Caller(False, "n1", False)) is None
        for stranger in ("operator", "n9", "n0\n"):
            refused = _decide(method, Caller(False, stranger, token_ok=True))
            assert refused is grpc.StatusCode.PERMISSION_DENIED, stranger
        assert _decide(method, Caller(False, None, True)) is grpc.StatusCode.UNAUTHENTICATED
    shared = Policy(tls=True, token=True, shared_identity="job")
    assert _decide(FETCH, Caller(False, "job", False), shared) is None


def test_status_and_health_need_only_a_certificate_and_unknown_methods_are_closed() -> None:
    caller = Caller(False, "operator", False)
    assert _decide(STATUS, caller) is None
    assert _decide("/grpc.health.v1.Health/Check", caller) is None
    for method in ("/elasticpp.agent.v1.AgentService/Reset", "/grpc.reflection.v1/Info"):
        assert _decide(method, caller) is grpc.StatusCode.PERMISSION_DENIED
        assert _decide(method, Caller(True, None, True)) is grpc.StatusCode.PERMISSION_DENIED


def test_under_tls_without_a_token_file_control_comes_through_the_socket_alone() -> None:
    tls_only = Policy(tls=True, token=False)
    for method in [m for m, d in METHODS.items() if d is Door.CONTROL]:
        node = Caller(local=False, identity="n1", token_ok=False)  # any certificate of the CA
        assert _decide(method, node, tls_only) is grpc.StatusCode.UNAUTHENTICATED
        assert _decide(method, Caller(True, None, False), tls_only) is None
    assert _decide(STATUS, Caller(False, "n1", False), tls_only) is None


def test_a_loopback_agent_without_tls_or_token_is_open_as_before() -> None:
    anyone = Caller(False, None, False)
    for method in METHODS:
        assert _decide(method, anyone, Policy(tls=False, token=False)) is None


def test_a_plaintext_agent_on_a_non_loopback_address_is_refused(tmp_path: Path) -> None:
    common = {"node_id": "n0", "etcd": ("127.0.0.1:1",), "slots": 1, "state_dir": tmp_path}
    for listen in ("0.0.0.0:7430", "10.0.0.5:7430", "[::]:7430"):
        with pytest.raises(ConfigError, match="not a loopback address and no TLS"):
            AgentConfig(listen=listen, **common)  # type: ignore[arg-type]
        AgentConfig(listen=listen, insecure=True, **common)  # type: ignore[arg-type]
    for listen in ("127.0.0.1:0", "[::1]:7430", "localhost:7430"):
        AgentConfig(listen=listen, **common)  # type: ignore[arg-type]


def test_an_etcd_off_loopback_reached_anonymously_is_refused_unless_insecure(
    tmp_path: Path,
) -> None:
    """Whoever can write to an etcd the agents reach anonymously can stop or misdirect the
    job (the review's F5: a forged end record): such an etcd needs the agent to log in (a
    client certificate or a user) or --insecure, said knowingly."""
    from elasticpp.cluster.etcd.security import EtcdSecurity

    pem = tmp_path / "x.pem"
    pem.write_text("x")
    common = {"node_id": "n0", "listen": "127.0.0.1:0", "slots": 1, "state_dir": tmp_path}
    ca_only = EtcdSecurity(ca_file=pem)  # TLS alone proves the server, not this agent
    for etcd, security in [
        (("10.0.0.9:2379",), None),
        (("127.0.0.1:2379", "etcd-1:2379"), None),
        (("https://etcd-0:2379",), ca_only),
    ]:
        with pytest.raises(ConfigError, match=r"reach it anonymously.*--insecure") as info:
            AgentConfig(etcd=etcd, etcd_security=security, **common)  # type: ignore[arg-type]
        assert "is not on loopback" in str(info.value)
        cfg = AgentConfig(etcd=etcd, etcd_security=security, insecure=True, **common)  # type: ignore[arg-type]
        assert cfg.anonymous_etcd()
    logged_in = [
        EtcdSecurity(ca_file=pem, cert_file=pem, key_file=pem),
        EtcdSecurity(ca_file=pem, user="agent", password="pw"),
    ]
    for security in logged_in:
        cfg = AgentConfig(etcd=("https://etcd-0:2379",), etcd_security=security, **common)  # type: ignore[arg-type]
        assert cfg.anonymous_etcd() == []
    for etcd in (("127.0.0.1:2379",), ("localhost:2379", "[::1]:2379")):
        AgentConfig(etcd=etcd, **common)  # type: ignore[arg-type]


def test_the_cli_refuses_a_plain_start_on_every_interface_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: j\nmodel: tiny\nglobal_batch: 4\nmicro_batch: 2\nsteps: 2\nseed: 0\n"
        "min_nodes: 1\nmax_nodes: 1\n"
    )
    argv = ["agent", "--etcd", "127.0.0.1:1", "--job-spec", str(spec), "--node-id", "n0"]
    argv += ["--state-dir", str(tmp_path / "s"), "--device", "cpu", "--slots", "1"]
    assert cli_main(argv) == 2  # --listen's default, 0.0.0.0:7430
    assert "--insecure" in capsys.readouterr().err
    assert cli_main([*argv, "--tls-cert", str(spec)]) == 2
    assert "--tls-cert given without --tls-ca, --tls-key" in capsys.readouterr().err
    remote = ["--etcd", "10.1.2.3:2379", "--listen", "127.0.0.1:0"]
    assert cli_main([*argv, *remote]) == 2
    assert "etcd at 10.1.2.3:2379 is not on loopback" in capsys.readouterr().err


def test_a_token_file_is_compared_whole_and_never_printed(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    token = TokenFile(path)
    assert token.matches("s3cret-token") and not token.matches("s3cret-toke")
    assert not token.matches(None) and not token.matches("")
    assert "s3cret" not in repr(token)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        TokenFile(tmp_path / "empty")
    path.unlink()
    assert not token.matches("s3cret-token")  # the file went away: nobody is let in on it
