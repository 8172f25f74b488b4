"""Certificates for tests, made with openssl: a CA, certificates it signs (each usable as a
server's and a client's, for 127.0.0.1 and localhost), and a stranger CA's."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(root: Path, name: str = "ca") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", f"/CN=elasticpp test {name}", "-keyout", f"{name}.key", "-out", f"{name}.pem",
        cwd=root,
    )  # fmt: skip
    return root / f"{name}.pem"


def issue(root: Path, common_name: str, ca: str = "ca", days: int = 2) -> tuple[Path, Path]:
    """A certificate of `ca` for `common_name` (its identity), valid `days`, and its key
    (written over any earlier pair of that name: a renewal)."""
    ext = root / "node.cnf"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={common_name}",
        "-keyout", f"{common_name}.key", "-out", f"{common_name}.csr", cwd=root,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{common_name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-days", str(days), "-extfile", ext.name,
        "-out", f"{common_name}.pem",
        cwd=root,
    )  # fmt: skip
    return root / f"{common_name}.pem", root / f"{common_name}.key"
