"""What the store's tests share: steps written and committed into a node's store, and nodes
serving their stores over gRPC."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from elasticpp.checkpoint.manifest import (
    PieceEntry,
    PieceKey,
    step_dirname,
)
from elasticpp.plan.specs import ModelSpec, default_units
from elasticpp.store.local import LocalStore
from elasticpp.store.service import GRPC_OPTIONS, StateServicer, add_to_server

UNITS = default_units(1)  # embed, block.0000, head


NAMES = ["embed.tp0-1.safetensors", "block.0000.tp0-1.safetensors"]


def write_step(
    store: LocalStore, step: int, names=NAMES, size: int = 1000, generation: int = 0
) -> list[dict]:
    """What a worker does: write pieces into snapshot_dir(generation)/step-k/, report them."""
    d = store.snapshot_dir(generation) / step_dirname(step)
    d.mkdir(parents=True, exist_ok=True)
    report = []
    for name in names:
        seed = f"{name}{step}" + (f"g{generation}" if generation else "")
        data = hashlib.sha256(seed.encode()).digest() * (size // 32 + 1)
        data = data[:size]
        (d / name).write_bytes(data)
        report.append({"name": name, "size": size, "sha256": hashlib.sha256(data).hexdigest()})
    return report


def commit_step(store: LocalStore, step: int, names=NAMES, generation: int = 0) -> None:
    store.record_pieces(step, write_step(store, step, names, generation=generation), generation)
    store.commit(step, units=UNITS, generation=generation)


def commit_replica_step(store: LocalStore, origin: str, step: int, generation: int = 0) -> None:
    entry = PieceEntry(PieceKey.parse(NAMES[0]), 3, hashlib.sha256(b"abc").hexdigest())
    (store.replica_step_dir(origin, step, generation) / NAMES[0]).write_bytes(b"abc")
    store.commit_replica(origin, step, UNITS, [entry], generation)


GRPC_MODEL = ModelSpec("t", num_layers=2, hidden_size=16, num_heads=4, vocab_size=32, seq_len=8)


def piece_bytes(name: str, step: int, origin: str, size: int) -> bytes:
    seed = hashlib.sha256(f"{origin}/{step}/{name}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def commit_sized_step(store: LocalStore, step: int, names: list[str], size: int = 5000) -> None:
    d = store.own_dir / step_dirname(step)
    d.mkdir(parents=True, exist_ok=True)
    report = []
    for name in names:
        data = piece_bytes(name, step, store.node_id, size)
        (d / name).write_bytes(data)
        report.append({"name": name, "size": size, "sha256": hashlib.sha256(data).hexdigest()})
    store.record_pieces(step, report)
    store.commit(step, units=GRPC_MODEL.units)


class Node:
    """A store and its state service on a free loopback port."""

    def __init__(
        self, root: Path, node_id: str, servicer_cls=StateServicer, store_kw=None, threads=4, **kw
    ) -> None:
        self.store = LocalStore(root / node_id, node_id, **(store_kw or {}))
        self.generation = 0
        self.servicer = servicer_cls(self.store, lambda: self.generation, **kw)
        self.server = grpc.server(ThreadPoolExecutor(threads), options=GRPC_OPTIONS)
        add_to_server(self.server, self.servicer)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(None)


ALL_TP2 = [PieceKey(u, r, 2).filename for u in GRPC_MODEL.units for r in (0, 1)]
