"""What one value costs when every node watches its key: etcd's fan-out, by value size.

    .venv/bin/python bench/fanout.py --watchers 2048 --connections 32 --sizes 300,40000

Every agent watches the generation record; a new generation is one put that etcd sends to
each of N watchers. The record holds the plan's node list, so it grows with N and a
transition's watch bytes grow as N²: 2,048 nodes × a 39 KB record is 80 MB of watch
messages. This measures what that costs, against a small value in the same run: a fresh etcd
on loopback, `--watchers` watches of one key spread over `--connections` clients (as the
simulation's agents share connections, bench/scale.py), then puts of each size in turn,
`--repeat` times, alternating. Per size: the seconds from the put until every watcher
had the event, and the CPU seconds of the etcd server and of this process (the watchers'
gRPC threads) over that time and the quiet half second after it, so that a put's last
messages are counted.

It answers one question of bench/scale.py's: how much of a transition's CPU is the
record's size (a record carrying only what changed would cost the small value's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.scale import pid_cpu_s
from elasticpp.cluster.etcd.kv import EtcdKV, WatchBatch, WatchItem
from elasticpp.cluster.etcd.server import EtcdServer
from elasticpp.errors import ElasticppError

KEY = "/fanout/record"
QUIET_S = 0.5  # after the last delivery: the put's remaining CPU is counted


@dataclass(frozen=True)
class Put:
    size: int
    deliver_s: float  # put -> every watcher had it
    etcd_cpu_s: float
    client_cpu_s: float


class Watchers:
    """`n` watches of KEY over `connections` clients; `wait(count)` until `count` events
    came in all (events are counted, not kept)."""

    def __init__(self, endpoint: str, n: int, connections: int) -> None:
        self._cond = threading.Condition()
        self._events = 0
        self.clients = [EtcdKV([endpoint]) for _ in range(connections)]
        for i in range(n):
            self.clients[i % connections].add_watch(KEY, None, None, self._sink)

    def _sink(self, item: WatchItem) -> None:
        if isinstance(item, WatchBatch):
            with self._cond:
                self._events += len(item.events)
                self._cond.notify_all()

    def events(self) -> int:
        with self._cond:
            return self._events

    def wait(self, count: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._events >= count, timeout_s)

    def close(self) -> None:
        for client in self.clients:
            client.close()


def measure(
    watchers: int, connections: int, sizes: list[int], repeat: int, timeout_s: float = 60.0
) -> list[Put]:
    """Puts of each size in `sizes`, `repeat` rounds of them, against a fresh etcd."""
    if watchers < 1 or connections < 1 or repeat < 1 or not sizes or min(sizes) < 1:
        raise ElasticppError("watchers, connections, repeat and every size must be >= 1")
    with tempfile.TemporaryDirectory() as work:
        etcd = EtcdServer(Path(work) / "etcd")
        etcd.start()
        group: Watchers | None = None
        writer: EtcdKV | None = None
        try:
            group = Watchers(etcd.endpoint, watchers, min(connections, watchers))
            writer = EtcdKV([etcd.endpoint])
            out = []
            for _ in range(repeat):
                for size in sizes:
                    want = group.events() + watchers
                    etcd0, client0 = pid_cpu_s(etcd.pid), time.process_time()
                    t0 = time.monotonic()
                    writer.put(KEY, "x" * size)
                    if not group.wait(want, timeout_s):
                        raise ElasticppError(
                            f"a {size} B put reached {group.events() - want + watchers} of "
                            f"{watchers} watchers in {timeout_s:.0f} s"
                        )
                    deliver_s = time.monotonic() - t0
                    time.sleep(QUIET_S)  # a measuring window, not a wait for a condition
                    etcd1 = pid_cpu_s(etcd.pid)
                    etcd_cpu = etcd1 - etcd0 if etcd0 is not None and etcd1 is not None else 0.0
                    out.append(Put(size, deliver_s, etcd_cpu, time.process_time() - client0))
            return out
        finally:
            if writer is not None:
                writer.close()
            if group is not None:
                group.close()
            etcd.stop()


def table(watchers: int, puts: list[Put]) -> str:
    """Medians per size, and each against the smallest size's (the baseline of the run)."""
    sizes = sorted({p.size for p in puts})

    def med(size: int, field: str) -> float:
        return statistics.median(getattr(p, field) for p in puts if p.size == size)

    base = sizes[0]
    lines = [
        f"{watchers} watchers, medians of {len(puts) // len(sizes)} puts each",
        f"| value B | watch MB | deliver s | etcd CPU s | watchers' CPU s | CPU vs {base} B |",
        "|---|---|---|---|---|---|",
    ]
    for size in sizes:
        cpu = med(size, "etcd_cpu_s") + med(size, "client_cpu_s")
        cpu0 = med(base, "etcd_cpu_s") + med(base, "client_cpu_s")
        lines.append(
            f"| {size} | {size * watchers / 1e6:.1f} | {med(size, 'deliver_s'):.3f} "
            f"| {med(size, 'etcd_cpu_s'):.2f} | {med(size, 'client_cpu_s'):.2f} "
            f"| {cpu / cpu0 if cpu0 > 0 else float('nan'):.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--watchers", type=int, default=2048)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--sizes", default="300,40000", help="value sizes in bytes, a,b,...")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        puts = measure(args.watchers, args.connections, sizes, args.repeat)
    except (ValueError, ElasticppError) as exc:
        print(f"fanout: {exc}", file=sys.stderr)
        return 2
    print(table(args.watchers, puts))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(p) for p in puts], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
