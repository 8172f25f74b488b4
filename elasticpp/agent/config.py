"""How one agent runs on its node (the command line's flags; the job spec is separate)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from elasticpp.agent.health.step import EXIT_FAILED, EXIT_HALTED
from elasticpp.agent.lifetime import STOP_OVERDUE_EXIT
from elasticpp.agent.view.step import EPOCH_ENDED_EXIT
from elasticpp.cluster.etcd.security import EtcdSecurity, parse_endpoint
from elasticpp.cluster.keys import check_prefix
from elasticpp.errors import ConfigError
from elasticpp.transport import TLSFiles, is_loopback

# Exit statuses of the agent that mean something else than "left a job that goes on".
TAKEN_EXIT_CODES = {
    STOP_OVERDUE_EXIT: "an error, or a stop cut short",
    2: "bad configuration",
    EXIT_FAILED: "the job failed",
    EXIT_HALTED: "the job halted",
    EPOCH_ENDED_EXIT: "the job's epoch ended",
}


@dataclass(frozen=True)
class AgentConfig:
    node_id: str
    etcd: tuple[str, ...]
    listen: str  # host:port of the agent's gRPC server; port 0 picks a free one
    slots: int
    state_dir: Path
    advertise_host: str = ""  # what peers dial; default: the listen host (127.0.0.1 for 0.0.0.0)
    # When the job ends (finished, failed, halted): "exit" (code 0, 3 or 4; systemd) or
    # "idle" (stay up, healthy and idle until removed; a Kubernetes StatefulSet).
    on_job_end: str = "exit"
    # The exit status when this agent stops before the job ended (drained, or a stop signal):
    # 0 for systemd and a StatefulSet; not 0 under a Kubernetes Job, where a pod that exits 0
    # counts its index complete (a Job whose every pod was drained would say "Complete").
    unfinished_exit_code: int = 0
    backend: str = "gloo"
    device: str = "cpu"
    worker_threads: int | None = 1  # torch threads per CPU worker (None: torch's default)
    metrics_port: int = 0  # Prometheus /metrics on this port; 0 = not served
    # The address /metrics binds; "" = the listen host (all interfaces only when --listen
    # says so: before, metrics bound 0.0.0.0 whatever --listen said).
    metrics_host: str = ""
    # How to reach a secured etcd (TLS, client certificate, user and password), or None.
    etcd_security: EtcdSecurity | None = None
    etcd_prefix: str = "/elasticpp"  # the job's keys: <etcd_prefix>/<job>/ (cluster.keys)
    # The agent's own doors (docs/deploy.md, "Securing a job"): mutual TLS on `listen` with
    # this node's certificate (its common name the node id), the bearer token control calls
    # need, the local control socket (mode 0600: its permissions are its guard), a plaintext
    # port serving grpc.health.v1 alone (kubelet probes cannot present a certificate), and
    # the name of a certificate shared by every node (weaker: trusted as any node).
    tls: TLSFiles | None = None
    token_file: Path | None = None
    control_socket: Path | None = None
    health_listen: str = ""
    tls_shared_identity: str | None = None
    # Knowingly on a network one trusts: plaintext on a non-loopback --listen, and an etcd
    # elsewhere than loopback reached without a client certificate or a user.
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.on_job_end not in ("exit", "idle"):
            raise ConfigError(f"agent: --on-job-end must be exit or idle, got {self.on_job_end!r}")
        if self.slots < 1:
            raise ConfigError(f"agent: slots must be >= 1, got {self.slots}")
        code = self.unfinished_exit_code
        if not 0 <= code <= 255 or code in TAKEN_EXIT_CODES:
            taken = ", ".join(f"{c} ({why})" for c, why in TAKEN_EXIT_CODES.items())
            raise ConfigError(
                f"agent: --unfinished-exit-code must be in [0, 255] and not one that says "
                f"something else: {taken}; got {code}"
            )
        if not self.etcd:
            raise ConfigError("agent: --etcd needs at least one HOST:PORT")
        check_prefix(self.etcd_prefix)
        host, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"agent: --listen must be HOST:PORT, got {self.listen!r}")
        if self.tls is None and not self.insecure and not is_loopback(host.strip("[]")):
            raise ConfigError(
                f"agent: --listen {self.listen} is not a loopback address and no TLS is given: "
                "anyone who reaches it could drain this node or download its state; give "
                "--tls-cert, --tls-key and --tls-ca (docs/deploy.md, 'Securing a job'), or "
                "--insecure to serve plaintext on a network you trust"
            )
        anonymous = self.anonymous_etcd()
        if anonymous and not self.insecure:
            raise ConfigError(
                f"agent: etcd at {anonymous[0]} is not on loopback and this agent would reach it "
                "anonymously: whoever can write to that etcd can stop or misdirect the job (a "
                "forged end record, forged addresses); give --etcd-cert and --etcd-key or "
                "--etcd-user and --etcd-password-file (with an etcd that requires them: "
                "docs/deploy.md, 'Securing a job'), or --insecure for an etcd on a network you "
                "trust"
            )
        if self.health_listen:
            _, h_sep, h_port = self.health_listen.rpartition(":")
            if not h_sep or not h_port.isdigit():
                raise ConfigError(
                    f"agent: --health-listen must be HOST:PORT, got {self.health_listen!r}"
                )
        if not self.metrics_host:
            object.__setattr__(self, "metrics_host", host.strip("[]") or "0.0.0.0")
        if not self.advertise_host:
            object.__setattr__(
                self, "advertise_host", "127.0.0.1" if host in ("", "0.0.0.0", "[::]") else host
            )

    def anonymous_etcd(self) -> list[str]:
        """The etcd endpoints off loopback that this agent reaches without authenticating
        (neither a client certificate nor a user): empty when there are none."""
        sec = self.etcd_security
        if sec is not None and (sec.cert_file is not None or sec.user is not None):
            return []
        tls = sec is not None and sec.tls
        return [e for e in self.etcd if not is_loopback(parse_endpoint(e, tls=tls)[0])]
