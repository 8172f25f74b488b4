"""How every gRPC connection between elasticpp processes is made: the one place that builds
credentials, so that the agent's server, its peers' channels (state transfers, health
probes) and `elasticpp ctl` speak the same way.

With `TLSFiles` (a certificate, its key, and the job's CA) the server takes only TLS with a
client certificate of that CA (mutual TLS), and channels present this node's certificate. The
files are read again when they change (a renewed certificate needs no restart). Without it,
plaintext: the agent allows that only on loopback or with `--insecure` (`AgentConfig`).

A leaf module (grpc and the standard library only): the store, the agent and the CLI use it.
"""

from __future__ import annotations

import hmac
import math
import os
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from elasticpp.errors import ConfigError

# What a control call carries in its metadata: `authorization: Bearer <token>`.
AUTHORIZATION = "authorization"
BEARER = "Bearer "
MAX_TOKEN_BYTES = 4096


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror})") from None


@dataclass(frozen=True)
class TLSFiles:
    """This process's certificate and key, and the CA every peer's certificate must be
    signed by (the job's CA). The certificate's common name is its identity: a node id for an
    agent (the state service serves a node only its job's pieces), any name for an operator."""

    cert_file: Path
    key_file: Path
    ca_file: Path

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if not Path(path).is_file():
                flag = {"cert_file": "--tls-cert", "key_file": "--tls-key", "ca_file": "--tls-ca"}
                raise ConfigError(f"{flag[name]} {path}: no such file")

    @classmethod
    def from_flags(cls, cert: Path | None, key: Path | None, ca: Path | None) -> TLSFiles | None:
        """The three `--tls-*` flags: all or none."""
        given = [f for f, v in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)) if v]
        if not given:
            return None
        if len(given) != 3:
            missing = sorted({"--tls-cert", "--tls-key", "--tls-ca"} - set(given))
            raise ConfigError(f"TLS: {', '.join(given)} given without {', '.join(missing)}")
        assert cert is not None and key is not None and ca is not None
        return cls(Path(cert), Path(key), Path(ca))

    def _stamp(self) -> tuple[float, ...]:
        out = []
        for path in (self.cert_file, self.key_file, self.ca_file):
            try:
                out.append(os.stat(path).st_mtime)
            except OSError:
                out.append(-1.0)
        return tuple(out)

    def _config(self) -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(_read(self.key_file, "--tls-key"), _read(self.cert_file, "--tls-cert"))],
            root_certificates=_read(self.ca_file, "--tls-ca"),
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS, the files read again for a new connection once they changed."""
        lock = threading.Lock()
        seen = [self._stamp()]

        def fetch() -> Any:
            stamp = self._stamp()
            with lock:
                if stamp == seen[0]:
                    return None  # unchanged: the configuration in use stays
                seen[0] = stamp
            try:
                return self._config()
            except ConfigError:
                return None  # half-written files: the old configuration until they are whole

        return grpc.dynamic_ssl_server_credentials(
            self._config(), fetch, require_client_authentication=True
        )

    def not_after(self) -> float:
        """When the certificate in `cert_file` expires (Unix time); NaN if it cannot be read
        now (a metric shows the gap; the server keeps the configuration it has)."""
        try:
            decoded = ssl._ssl._test_decode_cert(str(self.cert_file))  # type: ignore[attr-defined]
            return float(ssl.cert_time_to_seconds(decoded["notAfter"]))
        except (OSError, ValueError, KeyError, AttributeError, ssl.SSLError):
            return math.nan

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "--tls-ca"),
            private_key=_read(self.key_file, "--tls-key"),
            certificate_chain=_read(self.cert_file, "--tls-cert"),
        )


class TokenFile:
    """A bearer token kept in a file (a Secret, a systemd credential), read again when the
    file changes; compared in constant time. Never printed."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: float | None = None
        self._token = b""
        self.token()  # a missing or empty file is refused now, naming it

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r})"

    def token(self) -> bytes:
        try:
            stamp = os.stat(self.path).st_mtime
        except OSError as exc:
            raise ConfigError(
                f"--token-file {self.path}: cannot read it ({exc.strerror})"
            ) from None
        with self._lock:
            if stamp != self._stamp:
                value = _read(self.path, "--token-file").strip()
                if not value or len(value) > MAX_TOKEN_BYTES:
                    raise ConfigError(
                        f"--token-file {self.path}: empty or over {MAX_TOKEN_BYTES} bytes"
                    )
                self._token, self._stamp = value, stamp
            return self._token

    def matches(self, presented: str | bytes | None) -> bool:
        if presented is None:
            return False
        given = presented.encode() if isinstance(presented, str) else presented
        try:
            return hmac.compare_digest(given, self.token())
        except ConfigError:
            return False  # the file went away: nobody is let in on it


class Dialer:
    """Opens the channels of this process to agents: with TLS when this process has its
    certificate, else plaintext; with the bearer token on every call when one is given
    (TLS only: a token is not sent in clear text; the control socket needs none)."""

    def __init__(self, tls: TLSFiles | None = None, token: TokenFile | None = None) -> None:
        self.tls = tls
        self.token = token

    def __repr__(self) -> str:
        return f"Dialer(tls={self.tls is not None}, token={self.token is not None})"

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        if address.startswith("unix:"):
            return grpc.insecure_channel(address, options=list(options))
        if self.tls is None:
            return grpc.insecure_channel(address, options=list(options))
        creds = self.tls.channel_credentials()
        if self.token is not None:
            call = grpc.metadata_call_credentials(_TokenPlugin(self.token))
            creds = grpc.composite_channel_credentials(creds, call)
        return grpc.secure_channel(address, creds, options=list(options))

    def metadata(self, address: str) -> list[tuple[str, str]]:
        """The token as call metadata for a call on a channel that carries none (the
        control socket, a loopback agent without TLS)."""
        if self.token is None or (self.tls is not None and not address.startswith("unix:")):
            return []
        return [(AUTHORIZATION, BEARER + self.token.token().decode())]


class _TokenPlugin(grpc.AuthMetadataPlugin):  # type: ignore[misc]
    def __init__(self, token: TokenFile) -> None:
        self._token = token

    def __call__(self, context: Any, callback: Any) -> None:
        try:
            callback(((AUTHORIZATION, BEARER + self._token.token().decode()),), None)
        except ConfigError as exc:
            callback((), exc)


def peer_identity(context: Any) -> str | None:
    """The common name of a call's TLS client certificate (a `grpc.ServicerContext`), or
    None on a plaintext connection: the one reading of who is calling."""
    names = (context.auth_context() or {}).get("x509_common_name") or []
    return names[0].decode("utf-8", "replace") if names else None


PLAINTEXT_HOSTS = ("127.0.0.1", "::1", "localhost", "[::1]")


def is_loopback(host: str) -> bool:
    """Whether `host` (of a HOST:PORT) is a loopback address, where plaintext is allowed."""
    return host in PLAINTEXT_HOSTS or host.startswith("127.")
