"""How one agent runs on its node (the command line's flags; the job spec is separate)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from elasticpp.cluster.etcd_security import EtcdSecurity
from elasticpp.errors import ConfigError


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
    backend: str = "gloo"
    device: str = "cpu"
    worker_threads: int | None = 1  # torch threads per CPU worker (None: torch's default)
    metrics_port: int = 0  # Prometheus /metrics on this port; 0 = not served
    # The address /metrics binds; "" = the listen host (all interfaces only when --listen
    # says so: before, metrics bound 0.0.0.0 whatever --listen said).
    metrics_host: str = ""
    # How to reach a secured etcd (TLS, client certificate, user and password), or None.
    etcd_security: EtcdSecurity | None = None

    def __post_init__(self) -> None:
        if self.on_job_end not in ("exit", "idle"):
            raise ConfigError(f"agent: --on-job-end must be exit or idle, got {self.on_job_end!r}")
        if self.slots < 1:
            raise ConfigError(f"agent: slots must be >= 1, got {self.slots}")
        if not self.etcd:
            raise ConfigError("agent: --etcd needs at least one HOST:PORT")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"agent: --listen must be HOST:PORT, got {self.listen!r}")
        if not self.metrics_host:
            object.__setattr__(self, "metrics_host", host.strip("[]") or "0.0.0.0")
        if not self.advertise_host:
            object.__setattr__(
                self, "advertise_host", "127.0.0.1" if host in ("", "0.0.0.0", "[::]") else host
            )
