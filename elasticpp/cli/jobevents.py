"""`elasticpp job events`: what happened to a job, from its records in etcd
(elasticpp.cluster.events), oldest first; `--since` leaves out what came before a time,
`--follow` keeps reading and prints each new event once (and the end of a quarantine or a
cordon), until interrupted."""

from __future__ import annotations

import argparse
import datetime
import logging
import time
from typing import Any

from elasticpp.cli.output import emit, emit_item

log = logging.getLogger("elasticpp.cli")


def _when(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _line(event: dict[str, Any]) -> str:
    return f"{_when(event['at'])}  {event['kind']:<10}  {event['message']}"


def _table(events: list[dict[str, Any]]) -> str:
    return "\n".join(_line(e) for e in events) if events else "no events"


def run(client: Any, args: argparse.Namespace) -> int:
    from elasticpp.cluster.errors import ClusterUnavailableError
    from elasticpp.cluster.events import gone, job_events

    def after(events: list[Any]) -> list[Any]:
        return [e for e in events if args.since is None or e.at >= args.since]

    events = job_events(client)
    if not args.follow:
        emit([e.to_dict() for e in after(events)], args.output, _table)
        return 0
    for e in after(events):
        emit_item(e.to_dict(), args.output, _line)
    printed = {e.identity for e in events}
    current = {e.identity: e for e in events}
    unreachable = False
    while True:
        time.sleep(args.every)
        try:
            events = job_events(client)
        except ClusterUnavailableError as exc:
            if not unreachable:
                log.warning("etcd unavailable, reading again every %.0f s: %s", args.every, exc)
            unreachable = True
            continue
        unreachable = False
        new = [e for e in events if e.identity not in printed]
        for e in [*gone(current, events, time.time()), *after(new)]:
            emit_item(e.to_dict(), args.output, _line)
        printed |= {e.identity for e in events}
        current = {e.identity: e for e in events}
