"""How the etcd client reaches a secured etcd: TLS and username/password, checked when made
(a missing file or half a pair is refused, naming it), and the endpoint forms that go with
them (`https://` only with TLS, `http://` only without)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from elasticpp.errors import ConfigError


@dataclass(frozen=True)
class EtcdSecurity:
    """How to reach a secured etcd: TLS (`ca_file` to verify the server; `cert_file` and
    `key_file` for a client certificate) and username/password authentication. A password
    is sent only over TLS (it would travel in clear text otherwise) and never printed."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def from_files(
        cls,
        *,
        ca_file: Path | None = None,
        cert_file: Path | None = None,
        key_file: Path | None = None,
        user: str | None = None,
        password_file: Path | None = None,
    ) -> EtcdSecurity | None:
        """The settings of the `--etcd-*` flags, the password read from its file (a
        systemd credential or a mounted Secret: never a flag or an environment variable);
        None when none is given (plain etcd)."""
        password = None
        if password_file is not None:
            path = Path(password_file)
            try:
                password = path.read_text(encoding="utf-8").rstrip("\r\n")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"etcd password file {path}: cannot read it ({exc})") from None
            if not password:
                raise ConfigError(f"etcd password file {path}: empty")
        if (ca_file, cert_file, key_file, user, password) == (None,) * 5:
            return None
        return cls(ca_file, cert_file, key_file, user, password)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("etcd client certificate: give both the certificate and its key")
        if self.cert_file is not None and self.ca_file is None:
            raise ConfigError("etcd client certificate: TLS needs the CA file as well")
        if (self.user is None) != (self.password is None):
            raise ConfigError("etcd authentication: give both the user and the password")
        if self.user is not None and not self.user:
            raise ConfigError("etcd authentication: the user name is empty")
        if self.user is not None and self.ca_file is None:
            # etcd's own guidance: secure the transport first; over plain gRPC the
            # password (and the token it buys) can be read off the wire.
            raise ConfigError(
                "etcd authentication: a password is sent only over TLS; give the etcd CA "
                "file (--etcd-ca) and an https:// endpoint"
            )
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"etcd {name.replace('_', ' ')} {path}: no such file")

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    def channel_credentials(self) -> Any:
        assert self.ca_file is not None
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca_file).read_bytes(),
            private_key=Path(self.key_file).read_bytes() if self.key_file else None,
            certificate_chain=Path(self.cert_file).read_bytes() if self.cert_file else None,
        )


def parse_endpoint(text: str, *, tls: bool = False) -> tuple[str, int]:
    """`host:port`, `http://host:port` or (with TLS) `https://host:port` -> (host, port)."""
    raw = text.strip()
    if raw.startswith("https://") and not tls:
        raise ConfigError(f"etcd endpoint {text!r}: an https endpoint needs the etcd CA file (TLS)")
    if raw.startswith("http://") and tls:
        raise ConfigError(f"etcd endpoint {text!r}: TLS is configured but the endpoint is http")
    raw = raw.removeprefix("https://").removeprefix("http://").rstrip("/")
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"etcd endpoint {text!r}: expected host:port, e.g. 127.0.0.1:2379")
    return host.strip("[]"), int(port)
