"""What each barrier's and member's value must look like, checked where it leaves etcd.

A value with a valid envelope and a bad payload (a `done` arrival whose value is null, a
`started` arrival that is a string, a member without an address) used to reach the agent and
raise in the middle of its decision loop, every tick, for as long as it stayed in etcd: the
rest of the tick never ran. Here each value is checked against its barrier's shape; one that
does not fit is skipped and counted like an unreadable value, and only that key is lost.

Barrier names are `<kind>` or `<kind>-<generation>`; kinds not listed here pass unchecked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from elasticpp.cluster.errors import ClusterDataError

_Check = Callable[[str, Any], None]


def _number(what: str, value: Any, name: str, *, required: bool = True) -> None:
    if name not in value and not required:
        return
    v = value.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ClusterDataError(f"{what}: {name} must be a number, got {v!r}")


def _integer(what: str, value: Any, name: str, *, required: bool = True) -> None:
    if name not in value and not required:
        return
    v = value.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ClusterDataError(f"{what}: {name} must be an integer, got {v!r}")


def _text(what: str, value: Any, name: str, *, required: bool = True) -> None:
    if name not in value and not required:
        return
    if not isinstance(value.get(name), str):
        raise ClusterDataError(f"{what}: {name} must be a string, got {value.get(name)!r}")


def _done(what: str, v: Any) -> None:
    _integer(what, v, "step")


def _stop(what: str, v: Any) -> None:
    _integer(what, v, "step")
    _text(what, v, "checkpoint")


def _checkpoint(what: str, v: Any) -> None:
    _text(what, v, "id")
    held = v.get("held")
    if held is not None and not (
        isinstance(held, list)
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in held)
    ):
        raise ClusterDataError(f"{what}: held must be a list of steps")
    _integer(what, v, "step", required=False)
    _text(what, v, "outcome", required=False)


def _failed(what: str, v: Any) -> None:
    _text(what, v, "reason")
    _number(what, v, "at")
    for flag in ("culprit", "severe", "peer"):
        if flag in v and not isinstance(v[flag], bool):
            raise ClusterDataError(f"{what}: {flag} must be true or false, got {v[flag]!r}")


# The holdings digest's format (elasticpp.store.digest, which decodes it; this layer does not
# import the store): a digest of another release is refused here, by name. An arrival with
# `holdings` in full instead is the previous release's form, still read.
DIGEST_FORMAT = 1


def _stopped(what: str, v: Any) -> None:
    if "digest" in v:
        digest = v["digest"]
        if not isinstance(digest, dict):
            raise ClusterDataError(f"{what}: digest must be an object")
        if digest.get("format") != DIGEST_FORMAT:
            raise ClusterDataError(
                f"{what}: holdings digest format {digest.get('format')!r} is not "
                f"{DIGEST_FORMAT} (written by an agent of another release)"
            )
    elif not isinstance(v.get("holdings"), dict):
        raise ClusterDataError(f"{what}: needs a holdings digest (or holdings) object")
    _integer(what, v, "next_step")
    _number(what, v, "at")


def _started(what: str, v: Any) -> None:
    _number(what, v, "at")
    _number(what, v, "moved_at")


def _stepped(what: str, v: Any) -> None:
    _integer(what, v, "step")
    _number(what, v, "at")


# The resume instruction's format (elasticpp.store.instruction, which decodes it; this layer
# does not import the store): a value of another release is refused here, by name.
RESUME_FORMAT_VERSION = 2


def _resume(what: str, v: Any) -> None:
    version = v.get("format_version")
    if version != RESUME_FORMAT_VERSION:
        raise ClusterDataError(
            f"{what}: resume instruction format_version {version!r} is not "
            f"{RESUME_FORMAT_VERSION} (written by a leader of another release)"
        )
    _integer(what, v, "step")
    _integer(what, v, "recomputed", required=False)
    _integer(what, v, "pieces_parts", required=False)
    for name in ("pieces", "reshard", "reshard_by_node", "by_node", "infos_by_node"):
        if not isinstance(v.get(name), dict):
            raise ClusterDataError(f"{what}: {name} must be an object")
    if not isinstance(v.get("nodes"), list):
        raise ClusterDataError(f"{what}: nodes must be a list")


# The barriers of generation G, by name: every agent arrives at `stopped-G` (its old workers
# stopped, what it holds), `started-G` (its ranks run) and `stepped-G` (its ranks completed a
# step of G: only then are its strikes cleared, `elasticpp.agent.sick`); `failed-G` holds
# the failures its nodes report; `resume-G` the leader's resume instruction. Barrier
# `timelines` has one member per generation whose transition is over (`timeline_member`).
# The job-wide barriers of an operator's request: every agent's answer to `job stop`
# (elasticpp.agent.stop) and to `job checkpoint` (elasticpp.agent.checkpoint).
STOP_BARRIER = "stop"
CHECKPOINT_BARRIER = "checkpoint"


def stopped_barrier(generation: int) -> str:
    return f"stopped-{generation}"


def started_barrier(generation: int) -> str:
    return f"started-{generation}"


def stepped_barrier(generation: int) -> str:
    return f"stepped-{generation}"


def failed_barrier(generation: int) -> str:
    return f"failed-{generation}"


def resume_barrier(generation: int) -> str:
    return f"resume-{generation}"


def timeline_member(generation: int) -> str:
    return f"gen-{generation}"


# A resume instruction's `pieces` table (one entry per distinct piece: ~85 KiB for llama-70b
# pp=8 tp=8) is written in parts of at most this many bytes of JSON, as members of the same
# barrier in the same transaction, so that no etcd value passes 64 KiB.
RESUME_PART_BYTES = 48 * 1024
_RESUME_PART = re.compile(r"^resume-part-(?P<index>[0-9]{4})")
# The member of barrier `resume-<G>` that holds the leader's resume instruction.
RESUME_MEMBER = "resume"
# The member of barrier `resume-<G>` by which a leader that cannot resume the generation says
# so and why, `{"why": ..., "at": ...}`: its followers wait for state without a deadline
# instead of failing the generation (which would blame and quarantine healthy nodes).
RESUME_WAIT_MEMBER = "wait"


def resume_part_member(index: int) -> str:
    return f"resume-part-{index:04d}"


def split_resume(value: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The instruction without its `pieces` (naming how many parts hold them) and the parts,
    each `{"part": i, "of": n, "pieces": {...}}` of at most ~RESUME_PART_BYTES of JSON. A
    table that fits in one part stays in the instruction (no parts)."""
    pieces = value.get("pieces", {})
    if len(json.dumps(pieces, separators=(",", ":"))) <= RESUME_PART_BYTES:
        return value, []
    chunks: list[dict[str, Any]] = [{}]
    size = 0
    for name, info in pieces.items():
        entry = len(json.dumps({name: info}, separators=(",", ":")))
        if size + entry > RESUME_PART_BYTES and chunks[-1]:
            chunks.append({})
            size = 0
        chunks[-1][name] = info
        size += entry
    parts = [{"part": i, "of": len(chunks), "pieces": c} for i, c in enumerate(chunks)]
    return {**value, "pieces": {}, "pieces_parts": len(chunks)}, parts


def join_resume(members: dict[str, Any], resume_member: str) -> dict[str, Any]:
    """`members` of a resume barrier with the parts folded back into the instruction (as
    `split_resume` had it). Raises ClusterDataError when a part the instruction names is
    missing or does not fit; parts without an instruction are dropped (none is written
    without the other: one transaction writes them all)."""
    parts = {m: v for m, v in members.items() if _RESUME_PART.fullmatch(m)}
    out = {m: v for m, v in members.items() if m not in parts}
    main = out.get(resume_member)
    if main is None or "pieces_parts" not in main:
        return out
    count = main["pieces_parts"]
    if count < 1:
        raise ClusterDataError(f"resume instruction: pieces_parts must be >= 1, got {count}")
    pieces: dict[str, Any] = {}
    for i in range(count):
        part = parts.get(resume_part_member(i))
        if part is None or part.get("of") != count or part.get("part") != i:
            raise ClusterDataError(
                f"resume instruction: part {i} of {count} is missing or does not match"
            )
        pieces.update(part["pieces"])
    joined = {k: v for k, v in main.items() if k != "pieces_parts"}
    joined["pieces"] = pieces
    out[resume_member] = joined
    return out


def _resume_wait(what: str, v: Any) -> None:
    _text(what, v, "why")
    _number(what, v, "at")


def _resume_part(what: str, v: Any) -> None:
    _integer(what, v, "part")
    _integer(what, v, "of")
    if not isinstance(v.get("pieces"), dict):
        raise ClusterDataError(f"{what}: pieces must be an object")


def _timeline(what: str, v: Any) -> None:
    for name in ("generation", "resume_step", "steps_recomputed"):
        _integer(what, v, name)
    for name in ("reason", "layout_before", "layout_after"):
        _text(what, v, name)
    for name in ("detected_at", "planned_s", "stopped_s", "moved_s", "resumed_s"):
        _number(what, v, name)


CHECKS: dict[str, _Check] = {
    "done": _done,
    "failed": _failed,
    "stopped": _stopped,
    "stop": _stop,
    "checkpoint": _checkpoint,
    "started": _started,
    "stepped": _stepped,
    "resume": _resume,
    "timelines": _timeline,
}
_KIND = re.compile(r"^(?P<kind>[a-z]+)(?:-[0-9]{1,19})?")


def check_arrival(barrier: str, member: str, value: Any) -> Any:
    """`value` if it has the shape barrier `barrier` needs; raises ClusterDataError if not."""
    m = _KIND.fullmatch(barrier)
    check = CHECKS.get(m.group("kind")) if m else None
    if check is None:
        return value
    what = f"{barrier} arrival of {member}"
    if not isinstance(value, dict):
        raise ClusterDataError(f"{what}: expected an object, got {type(value).__name__}")
    if check is _resume and _RESUME_PART.fullmatch(member):
        check = _resume_part
    elif check is _resume and member == RESUME_WAIT_MEMBER:
        check = _resume_wait
    check(what, value)
    return value


def check_member(node_id: str, value: Mapping[str, Any]) -> Mapping[str, Any]:
    """A member record the planner can use: an address to dial, a positive slot count."""
    what = f"member {node_id}"
    address = value.get("address")
    if not isinstance(address, str) or not address.rpartition(":")[2].isdigit():
        raise ClusterDataError(f"{what}: address must be HOST:PORT, got {address!r}")
    slots = value.get("slots", 1)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ClusterDataError(f"{what}: slots must be an integer >= 1, got {slots!r}")
    _text(what, value, "incarnation", required=False)
    return value
