"""What a leader's turn derives from N nodes while a transition's arrivals come in.

    .venv/bin/python -m bench.leader_turn [--nodes 256,1024,2048] [--repeats 20]

During a transition each of the leader's turns sees one or a few new `stopped-G`
arrivals of N and decides again. Timed per turn (CPU seconds, `time.process_time`, the best
of `--repeats` batches of 20 calls), in one process, nothing else:

- the arrivals' view after one of N arrivals changed (`JobReads.values_once`, as
  `barrier_state` builds it from the watch-fed cache): each key looked up, the new one parsed
  and checked; against the same call deriving all N again (a `what` it has not seen: each
  parsed-once lookup, key split and check, as every rebuild did before);
- `decide_replan` with the node lists the leader keeps (`decide.NodeLists`, computed again
  only when members, dead or quarantined nodes change) against the same view computing them
  (sorting every member and looking at each, as every turn did before).

Prints a markdown table; the ratios are the comparison (same process, same run).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from elasticpp.agent.kernel.decide import ClusterView, decide_replan, node_lists
from elasticpp.cluster.barriers import check_arrival
from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.records import KeyValue, dumps
from elasticpp.store.digest import digest_of
from elasticpp.store.holdings import NodeHoldings

CALLS = 20


def _best_per_call(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        t = time.process_time()
        for _ in range(CALLS):
            fn()
        best = min(best, (time.process_time() - t) / CALLS)
    return best


def _arrivals(client: ClusterClient, n: int) -> list[KeyValue]:
    prefix = client.keys.barrier_prefix("stopped-2")
    kvs = []
    for i in range(n):
        node = f"node-{i:05d}"
        digest = digest_of(NodeHoldings(node), f"{node}:1").to_dict()
        value = {"digest": digest, "next_step": 0, "at": 1.0}
        record = dumps({"node_id": node, "value": value, "at": 1.0})
        kvs.append(KeyValue(prefix + node, record, 100 + i, 100 + i, 0))
    return kvs


def measure(n: int, repeats: int) -> dict[str, float]:
    client = ClusterClient(["127.0.0.1:1"], "bench")  # never connects: no request is made
    try:
        kvs = _arrivals(client, n)

        def check(node: str, r: dict[str, Any]) -> Any:
            return check_arrival("stopped-2", node, r.get("value"))

        client.reads.values_once(kvs, "kept", check)
        changed = [0]

        def one_changed() -> None:
            # A new KeyValue for one key, as the cache makes for a watch event.
            i = changed[0] = (changed[0] + 1) % n
            kv = kvs[i]
            kvs[i] = KeyValue(kv.key, kv.value, kv.mod_revision, kv.create_revision, 0)
            client.reads.values_once(kvs, "kept", check)

        fresh = iter(range(10**9))
        kept_s = _best_per_call(one_changed, repeats)
        all_s = _best_per_call(
            lambda: client.reads.values_once(kvs, f"n{next(fresh)}", check), repeats
        )
    finally:
        client.close()
    members = {f"node-{i:05d}": {"address": "h:1", "slots": 8} for i in range(n)}
    view = ClusterView(
        members=members,
        dead=frozenset(),
        current_nodes=tuple(sorted(members)),
        failed=frozenset(),
        now_s=100.0,
        last_join_s=0.0,
    )
    kept_view = replace(view, lists=node_lists(members, view.dead, view.quarantined))

    def decide(v: ClusterView) -> Callable[[], Any]:
        return lambda: decide_replan(v, min_nodes=1, max_nodes=n, settle_s=5.0)

    return {
        "arrivals_kept_ms": kept_s * 1e3,
        "arrivals_all_ms": all_s * 1e3,
        "decide_kept_ms": _best_per_call(decide(kept_view), repeats) * 1e3,
        "decide_all_ms": _best_per_call(decide(view), repeats) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="256,1024,2048")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    print(
        "| nodes | arrivals' view: one changed ms | all derived ms | ratio "
        "| decide: lists kept ms | lists computed ms | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.nodes.split(",")):
        m = measure(n, args.repeats)
        print(
            f"| {n:,} | {m['arrivals_kept_ms']:.3f} | {m['arrivals_all_ms']:.3f} "
            f"| {m['arrivals_all_ms'] / m['arrivals_kept_ms']:.1f}x "
            f"| {m['decide_kept_ms']:.3f} | {m['decide_all_ms']:.3f} "
            f"| {m['decide_all_ms'] / m['decide_kept_ms']:.1f}x |"
        )


if __name__ == "__main__":
    main()
