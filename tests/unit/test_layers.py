"""The layer rules of the design, checked on the source: dependencies point down only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "elasticpp"

# package -> module prefixes it must never import
FORBIDDEN = {
    "plan": ("torch", "etcd3", "grpc", "google.protobuf", "elasticpp."),
    "checkpoint": (
        "etcd3",
        "grpc",
        "elasticpp.train",
        "elasticpp.store",
        "elasticpp.cluster",
        "elasticpp.agent",
    ),
    "train": (
        "etcd3",
        "grpc",
        "elasticpp.store",
        "elasticpp.cluster",
        "elasticpp.agent",
        "elasticpp.rpc",
    ),
    "store": ("etcd3", "elasticpp.cluster", "elasticpp.agent"),
    "cluster": ("elasticpp.store", "elasticpp.train", "elasticpp.agent", "elasticpp.rpc"),
}
ALLOWED = {
    "plan": ("elasticpp.errors", "elasticpp.interned", "elasticpp.names", "elasticpp.plan"),
    "cluster": ("elasticpp.rpc.etcd",),  # etcd's wire messages, for the etcd client only
}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_its_layer_may(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in imports_of(path):
            if name.startswith(ALLOWED.get(package, ())):
                continue
            if any(
                name == f or name.startswith(f if f.endswith(".") else f + ".")
                for f in FORBIDDEN[package]
            ):
                bad.append(f"{path.relative_to(ROOT.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_only_the_etcd_client_talks_to_etcd() -> None:
    users = sorted(
        str(p.relative_to(ROOT.parent))
        for p in ROOT.rglob("*.py")
        if any(n.startswith(("etcd3", "elasticpp.rpc.etcd")) for n in imports_of(p))
    )
    # The client's modules: its calls, its endpoints, its streams, and the encoding of its
    # messages.
    assert users == [
        "elasticpp/cluster/etcd/endpoint.py",
        "elasticpp/cluster/etcd/keepalive.py",
        "elasticpp/cluster/etcd/kv.py",
        "elasticpp/cluster/etcd/ops.py",
        "elasticpp/cluster/etcd/watch_stream.py",
        "elasticpp/cluster/etcd/watches.py",
    ]
