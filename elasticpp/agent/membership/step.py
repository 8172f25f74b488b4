"""The membership's rules (pure): what this node's member record says, whether the job's
leader runs another elasticpp, and whether another agent holds this node's id."""

from __future__ import annotations

from collections.abc import Mapping


def member_info(
    address: str, slots: int, draining: bool, incarnation: str, pid: int, version: str
) -> dict[str, object]:
    """This node's member record: where peers dial it, what it offers, who it is."""
    return {
        "address": address,
        "slots": slots,
        "draining": draining,
        "incarnation": incarnation,
        "pid": pid,
        "version": version,
    }


def version_refusal(
    job: str, node_id: str, leader: str | None, theirs: object, ours: str
) -> str | None:
    """Why this agent may not join: the job's leader (`leader`, its member record's version
    `theirs`) runs another elasticpp than `ours` (records may change between versions). None
    when it may: no leader, this node itself, or a record that names no version."""
    if leader is None or leader == node_id or not isinstance(theirs, str) or theirs == ours:
        return None
    return (
        f"job {job!r} runs elasticpp {theirs[:40]} (its leader {leader}); this agent is "
        f"elasticpp {ours}: a job's agents run one version. To upgrade, stop every agent of "
        "the job, then start the new version (docs/deploy.md, 'Upgrading a job')"
    )


def id_conflict(
    lost_to: str | None,
    members: Mapping[str, Mapping[str, object]],
    node_id: str,
    incarnation: str,
) -> str | None:
    """Why this agent must stop because another agent registered its node id: its lease
    lapsed and the key is another incarnation's (`lost_to`, what the registration's keeper
    found), or the key was taken over while its lease still lived (the members read
    shows another incarnation)."""
    if lost_to is not None:
        return lost_to
    other = members.get(node_id, {}).get("incarnation", incarnation)
    if other == incarnation:
        return None
    return (
        f"another agent with the same node id is registered: incarnation {other}, "
        f"this agent is {incarnation}; this agent stops"
    )
