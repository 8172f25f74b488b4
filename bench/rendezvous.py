"""What one rendezvous store sustains: the leader's TCPStore (libuv backend) under N ranks
meeting at once, each doing what a worker's `init_process_group` does against it.

    python bench/rendezvous.py [--ranks 256,1024,4096] [--procs 4]

N clients (threads spread over `--procs` processes, each with its own connection) connect
to one master store, then each: one `set` of its own key, one `add` to the arrival counter
(the last to arrive sets the barrier's key), a `wait` on the server for that key (as torch's
store barrier does), and one `get` of rank 0's key (as NCCL's unique-id exchange does).
Measured: the time from the first client's start (torch imported) to the last rank through,
and the store's requests per second over it. Prints a table; the
agent sizes the workers' rendezvous timeout from it (elasticpp.agent.leader.deadlines).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta

REQUESTS_PER_RANK = 4  # add, set, wait (a check loop on the server), get


def client_main(port: int, first: int, step: int, world: int) -> None:
    """One client process: ranks first, first + step, ... as threads; prints when each was
    through, as JSON on stdout."""
    import torch.distributed as dist

    done: list[float] = []
    lock = threading.Lock()

    def one(rank: int) -> None:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600), use_libuv=True
        )
        store.set(f"rank/{rank}", f"addr-{rank}")
        if int(store.add("arrived", 1)) == world:
            store.set("all-arrived", "1")  # the last one in opens the barrier
        store.wait(["all-arrived"])  # waits on the server, as torch's store barrier does
        store.get("rank/0")
        with lock:
            done.append(time.time())

    started = time.time()
    threads = [threading.Thread(target=one, args=(r,)) for r in range(first, world, step)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"started": started, "done": done}))


def measure(world: int, procs: int) -> tuple[float, float]:
    import torch.distributed as dist

    master = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True,
        timeout=timedelta(seconds=600),
    )  # fmt: skip
    ps = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--client",
                str(master.port),
                str(i),
                str(procs),
                str(world),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(procs)
    ]
    done: list[float] = []
    starts: list[float] = []
    try:
        for p in ps:
            out, _ = p.communicate(timeout=900)
            if p.returncode != 0:
                raise RuntimeError(f"a client process exited {p.returncode}")
            got = json.loads(out.strip().splitlines()[-1])
            done += got["done"]
            starts.append(float(got["started"]))
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.wait()
    elapsed = max(done) - min(starts)
    return elapsed, world * REQUESTS_PER_RANK / elapsed


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(*(int(x) for x in sys.argv[2:6]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="256,1024,4096")
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    print("| ranks | through (s), median | s per 1,000 ranks | requests/s |")
    print("|---:|---:|---:|---:|")
    for world in (int(x) for x in args.ranks.split(",")):
        runs = [measure(world, args.procs) for _ in range(args.repeats)]
        elapsed = statistics.median(r[0] for r in runs)
        rate = statistics.median(r[1] for r in runs)
        print(f"| {world:,} | {elapsed:.2f} | {1000 * elapsed / world:.2f} | {rate:,.0f} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
