"""Ports chosen for processes started later (elasticpp.agent.localcluster.free_ports) lie
below the kernel's ephemeral range: a port the kernel hands out to a connection or a bind
to port 0 is never one of them, so nothing takes one between the choice and the bind."""

from __future__ import annotations

import socket

import pytest

from elasticpp.agent import localcluster
from elasticpp.agent.localcluster import free_ports


def test_chosen_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    low, _ = localcluster._ephemeral_range()
    for _ in range(20):
        ports = free_ports(3)
        assert len(set(ports)) == 3
        assert all(localcluster.FIXED_PORTS_LOW <= p < low for p in ports)
        socks = [socket.socket() for _ in ports]
        try:
            for s, p in zip(socks, ports, strict=True):
                s.bind(("127.0.0.1", p))  # free: each binds
        finally:
            for s in socks:
                s.close()


def test_a_port_in_use_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    try:
        # Only the held port and one other below the (pretended) ephemeral range.
        monkeypatch.setattr(localcluster, "FIXED_PORTS_LOW", taken)
        monkeypatch.setattr(localcluster, "_ephemeral_range", lambda: (taken + 12, 65535))
        for _ in range(10):
            assert taken not in free_ports(1)
    finally:
        held.close()


def test_without_room_below_the_ephemeral_range_the_kernel_chooses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(localcluster, "_ephemeral_range", lambda: (1024, 65535))
    ports = free_ports(2)
    assert len(set(ports)) == 2 and all(p > 0 for p in ports)


def test_a_port_chosen_before_is_not_chosen_again_while_others_are_left() -> None:
    # The first node's agent may not have bound its ports when the next node's are chosen:
    # 600 choices among ~22,000 ports repeated one with near certainty before.
    seen: set[int] = set()
    for _ in range(300):
        ports = free_ports(2)
        assert not seen & set(ports)
        seen.update(ports)
