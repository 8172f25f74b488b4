"""`elasticpp job checkpoint`: a persistent checkpoint of a running job, now.

It writes a request (elasticpp.agent.checkpoint); every agent reports the committed steps it
holds; the newest step every planned node holds is chosen and written into the request;
every agent persists its pieces of that step into the job's persist_dir, training on, and
reports the outcome. Exit 0 once every planned node's pieces are persisted (the checkpoint's
manifest is then written: elasticpp.store.persist), 1 if one failed or did not answer
within `--wait`, 2 for a job that cannot be checkpointed (none, no persist_dir, not
running)."""

from __future__ import annotations

import argparse
import getpass
import socket
import time
from typing import Any

from elasticpp.cli.output import emit, message_table
from elasticpp.cluster.barriers import CHECKPOINT_BARRIER
from elasticpp.errors import ConfigError


def _spec_persist_dir(client: Any, name: str) -> str | None:
    from elasticpp.agent.jobspec import JobSpec
    from elasticpp.errors import ElasticppError

    text = client.spec()
    try:
        return None if text is None else JobSpec.from_json(text).persist_dir
    except (ElasticppError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"job {name}: its spec in etcd cannot be read: {exc}") from None


def _reports(client: Any, request_id: str, nodes: list[str], field: str) -> dict[str, Any]:
    arrivals, _ = client.arrivals.barrier_state(CHECKPOINT_BARRIER)
    return {
        n: v[field]
        for n, v in arrivals.items()
        if n in nodes and isinstance(v, dict) and v.get("id") == request_id and field in v
    }


def run(client: Any, args: argparse.Namespace, status: dict[str, Any]) -> int:
    name, state = args.name, status["state"]
    if state in ("finished", "failed", "halted", "stopped"):
        raise ConfigError(f"job {name} is {state}: there is nothing to checkpoint")
    persist_dir = _spec_persist_dir(client, name)
    if not persist_dir:
        raise ConfigError(
            f"job {name} has no persist_dir in its spec: there is nowhere to checkpoint to"
        )
    nodes = list(status["planned_nodes"])
    if state != "running" or not nodes:
        raise ConfigError(f"job {name} is {state}: no generation runs, so no node holds a step")
    request = client.requests.request_checkpoint(
        by=f"{getpass.getuser()}@{socket.gethostname()}", reason=args.reason
    )
    deadline = time.monotonic() + args.wait

    def wait_for(field: str) -> dict[str, Any]:
        got = _reports(client, request.id, nodes, field)
        while len(got) < len(nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
            got = _reports(client, request.id, nodes, field)
        return got

    def result(step: int | None, outcomes: dict[str, str], message: str) -> None:
        emit({"job": name, "request": request.id, "step": step, "persist_dir": persist_dir,
              "nodes": outcomes, "message": message}, args.output, message_table)  # fmt: skip

    held = wait_for("held")
    missing = sorted(set(nodes) - set(held))
    if missing:
        result(
            None, {}, f"job {name}: no answer within {args.wait:.0f} s from {', '.join(missing)}"
        )
        return 1
    common = set.intersection(*(set(steps) for steps in held.values()))
    if not common:
        each = "; ".join(f"{n}: {sorted(s) or 'none'}" for n, s in sorted(held.items()))
        result(None, {}, f"job {name}: no committed step is held by every node ({each})")
        return 1
    step = max(common)
    if not client.requests.choose_checkpoint_step(request, step):
        result(step, {}, f"job {name}: another checkpoint request replaced this one")
        return 1
    outcomes = wait_for("outcome")
    for node in set(nodes) - set(outcomes):
        outcomes[node] = f"no answer within {args.wait:.0f} s"
    failed = {n: o for n, o in sorted(outcomes.items()) if o != "persisted"}
    if failed:
        why = "; ".join(f"{n}: {o}" for n, o in failed.items())
        result(step, outcomes, f"job {name}: step {step} not checkpointed: {why}")
        return 1
    result(step, outcomes, f"job {name}: step {step} checkpointed in {persist_dir}")
    return 0
