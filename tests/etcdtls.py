"""The etcd TLS tests share: the certificates of an etcd server and its clients, and a client's
security settings made from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticpp.cluster.etcd.kv import (
    EtcdSecurity,
)
from tests.certs import issue, make_ca


def make_certs(root: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1, a client certificate of that CA, and a
    client certificate of another CA (which the server must refuse)."""
    make_ca(root)
    make_ca(root, "other-ca")
    for name in ("server", "client"):
        issue(root, name)
    issue(root, "stranger", ca="other-ca")
    return {p.name: p for p in root.iterdir()}


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, Path]:
    return make_certs(tmp_path / "certs")


def client_tls(certs: dict[str, Path], **kw: object) -> EtcdSecurity:
    return EtcdSecurity(
        ca_file=certs["ca.pem"], cert_file=certs["client.pem"], key_file=certs["client.key"], **kw
    )  # type: ignore[arg-type]
