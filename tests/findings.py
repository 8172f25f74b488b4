"""What the security findings' tests share: their job, etcd's command line, the job's keys,
training checks and the sockets a process listens on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from elasticpp.agent.localcluster import LocalCluster
from elasticpp.proctree import descendants
from elasticpp.waiting import wait_until

FINDINGS_SPEC: dict[str, Any] = {
    "name": "secjob",
    "model": "tiny",
    "global_batch": 4,
    "micro_batch": 2,
    "steps": 100_000,
    "seed": 0,
    "min_nodes": 1,
    "max_nodes": 2,
    "lease_ttl_s": 3,
    "snapshot_every": 10,
    "replication_copies": 0,
}


def etcdctl(server: Any, *args: str, user: str | None = None) -> None:
    import subprocess

    etcdctl = Path(server._binary).with_name("etcdctl")
    tls = server.tls
    base = [str(etcdctl), f"--endpoints=https://{server.endpoint}", f"--cacert={tls.ca_file}"]
    base += [f"--cert={tls.cert_file}", f"--key={tls.key_file}"]
    if user is not None:
        base.append(f"--user={user}")
    subprocess.run([*base, *args], check=True, capture_output=True, timeout=30)


def close_leaving_nothing(lc: LocalCluster) -> None:
    """Stop `lc`, and check that no process of its agents' trees outlived it (the module's
    two jobs run side by side: a check of every descendant would see the other's)."""
    ours = set()
    for n in lc.nodes:
        if n.proc is not None:
            ours |= {n.proc.pid, *descendants(n.proc.pid)}
    lc.close()
    # SIGKILLed processes take a moment to die: wait for it (a deadline, not a sleep).
    wait_until(lambda: not any(_alive(p) for p in ours), 15)
    left = [p for p in ours if _alive(p)]
    assert not left, f"processes left behind: {left}"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def trains_on(lc: LocalCluster, past_step: int, timeout_s: float = 120) -> None:
    lc.wait_for(lambda: lc.max_step() > past_step, timeout_s, f"a step after {past_step}")


def state_keys(ch: grpc.Channel) -> Any:
    from elasticpp.rpc.state.v1 import state_pb2_grpc

    return state_pb2_grpc.StateServiceStub(ch)


def status_code(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        list(call()) if callable(call) else call
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def tcp_listeners() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket of this machine
    (/proc/net/tcp{,6}; an IPv4-mapped address is given as IPv4)."""
    import ipaddress

    out = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":
                continue
            addr, _, port = fields[1].partition(":")
            raw = bytes.fromhex(addr)
            # The kernel prints each 32-bit word in host (little-endian) order.
            ip = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4)))
            mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
            out[int(fields[9])] = (str(mapped or ip), int(port, 16))
    return out
