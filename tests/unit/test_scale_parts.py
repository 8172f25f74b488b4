"""Parts of the control-plane simulation (bench/) that need no etcd: the per-thread CPU
profile of a simulated process, and how agents are put on shared etcd connections."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from bench.scaleproc import thread_class, thread_cpu_s
from bench.scalesim import SimCluster, sim_spec
from elasticpp.waiting import wait_until


def test_thread_classes_leave_out_node_ids_lease_ids_and_numbers() -> None:
    assert thread_class("lease-node node-00017") == "lease-node #"
    assert thread_class("lease-leader 7613a21dae3ed4be") == "lease-leader #"
    assert thread_class("loops-3") == "loops-#"
    assert thread_class("etcd-keepalive-127.0.0.1:2379") == "etcd-keepalive-#.#.#.#:#"
    assert thread_class("Thread-12 (_serve)") == "Thread-# (_serve)"


def test_thread_cpu_is_summed_by_class_to_the_millisecond() -> None:
    """Each thread's schedstat, not /proc's clock ticks: 30 threads that each ran ~4 ms
    add up to ~0.1 s, which ticks of 10 ms would round to about nothing."""
    start = threading.Barrier(31)

    def spin(n: int) -> None:
        start.wait()
        end = time.thread_time() + 0.004
        while time.thread_time() < end:
            pass
        done.wait()

    done = threading.Event()
    threads = [
        threading.Thread(target=spin, args=(i,), name=f"spinner-node-{i:05d}") for i in range(30)
    ]
    for t in threads:
        t.start()
    before = thread_cpu_s().get("spinner-#", 0.0)
    start.wait()
    try:
        # Every thread spins its 4 ms, then waits: their CPU adds up to ~0.12 s.
        assert wait_until(lambda: thread_cpu_s().get("spinner-#", 0.0) - before >= 0.1, 30)
        spent = thread_cpu_s().get("spinner-#", 0.0) - before
        assert spent < 1.0, spent
    finally:
        done.set()
        for t in threads:
            t.join()


def test_agents_are_put_on_shared_connections_in_groups(tmp_path: Path) -> None:
    cluster = SimCluster(
        "127.0.0.1:1", [], 1, tmp_path, sim_spec("j", 5, 1), share_etcd=True,
        agents_per_connection=2,
    )  # fmt: skip
    try:
        kvs = [cluster._kv() for _ in range(5)]
        assert kvs[0] is kvs[1] and kvs[2] is kvs[3] and kvs[4] is not kvs[3]
        assert len({id(kv) for kv in kvs}) == 3 == len(cluster.kvs)
    finally:
        cluster.close()
    alone = SimCluster("127.0.0.1:1", [], 1, tmp_path, sim_spec("j", 5, 1), share_etcd=False)
    assert alone._kv() is None  # each agent opens its own
    one = SimCluster("127.0.0.1:1", [], 1, tmp_path, sim_spec("j", 5, 1), share_etcd=True)
    try:
        assert len({id(one._kv()) for _ in range(5)}) == 1  # 0: every agent on one
    finally:
        one.close()
