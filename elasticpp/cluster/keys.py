"""The etcd key layout of a job — written down here and nowhere else.

Every key of job `<job>` lives under `<prefix>/<job>/`, the prefix `/elasticpp` by default
(`--etcd-prefix`: the chart makes it `/elasticpp/<namespace>`, so that jobs of one name in two
namespaces sharing an etcd never meet; an etcd role grants `<prefix>/<job>/` and nothing
else). Values are UTF-8 JSON objects with a
`format_version` (never pickle), except `leader`, whose value is the bare node id so that a
transaction can compare it.

key (under /elasticpp/<job>/)        lease           value (writer)
-----------------------------------  --------------  ------------------------------------------
spec                                 none            job spec JSON; first writer wins (any agent)
epoch                                none            {format_version, epoch, created_by,
                                                     created_at}: the job epoch, new whenever
                                                     the job's etcd state starts afresh;
                                                     created once (first agent to join)
nodes/<node_id>                      node's lease    {format_version, node_id, registered_at,
                                                     address, slots, started_at, ...} (the node)
leader                               leader's lease  the leader's node id, plain text (winner)
generation                           none            GenerationRecord JSON: generation, plan,
                                                     leader, created_at, resume_step,
                                                     switch_step, store_address, extra
                                                     (leader, by compare-and-swap)
generations/<generation:012d>        none            GenerationSummary JSON: generation,
                                                     leader, created_at, layout, nodes (count),
                                                     reason, previous_layout; history (same
                                                     txn; earlier releases kept full copies)
suspects/<node_id>                   none            {format_version, node_id, by, reason, at}
barriers/<name>/<node_id>            none            {format_version, node_id, value, at}
commits/<generation:012d>/<node_id>  none            {format_version, node_id, generation, step,
                                                     at, anchors, replicas} (each node: newest
                                                     committed step, -1 if none; the anchor
                                                     steps of this generation it holds, own
                                                     and per origin, newest first, bounded)
safe                                 none            {format_version, generation, step, at}: the
                                                     newest safe step (leader, compare-and-swap,
                                                     only when it rises)
quarantine/<node_id>                 none            {format_version, node_id, reason, since,
                                                     until, count, incarnation}: a node set
                                                     aside (leader, fenced by its term; an
                                                     operator's lift deletes it)
ended                                none            {format_version, status, reason, by, at,
                                                     step}: the job ended without finishing
                                                     (failed, halted); written once (any agent)
stop                                 none            {v, by, reason, at}: an operator asked the
                                                     job to stop (`job stop`); written once
checkpoint                           none            {v, id, by, reason, at, step}: an operator
                                                     asked for a checkpoint now (`job
                                                     checkpoint`; a new request replaces it)
cordon/<node_id>                     none            {v, node_id, by, reason, at}: a node an
                                                     operator set aside (`job cordon`; `job
                                                     uncordon` deletes it)

Generation numbers in key names are zero-padded to 12 digits so that etcd's byte order is the
numeric order. Node ids and barrier names must not contain `/` (checked by `check_name`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from elasticpp.errors import ConfigError

ROOT = "/elasticpp"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
_PREFIX = re.compile(r"(/[a-z0-9][a-z0-9._-]{0,62}){1,4}")


def check_prefix(prefix: str) -> str:
    """A key prefix: one to four `/`-led path segments of lowercase letters, digits and ._-
    (no trailing slash, no `..`)."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix) or "/." in prefix:
        raise ConfigError(
            f"etcd prefix {prefix!r:.80}: must be like /elasticpp or /elasticpp/team-a (1-4 "
            "segments of lowercase letters, digits and ._-, each starting with a letter or digit)"
        )
    return prefix


def check_name(field: str, value: str) -> str:
    """Refuse names that would break the key layout (slashes, empty, odd characters)."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ConfigError(
            f"{field} {value!r:.80}: must be 1-128 characters of letters, digits and ._:@- "
            "starting with a letter or digit"
        )
    return value


def prefix_end(prefix: str) -> str:
    """The exclusive range end of a prefix (etcd's "all keys starting with")."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


@dataclass(frozen=True)
class JobKeys:
    """Key names of one job; see the module docstring for what each holds."""

    job: str
    prefix: str = ROOT

    def __post_init__(self) -> None:
        check_name("job", self.job)
        check_prefix(self.prefix)

    @property
    def root(self) -> str:
        return f"{self.prefix}/{self.job}/"

    @property
    def spec(self) -> str:
        return self.root + "spec"

    @property
    def epoch(self) -> str:
        return self.root + "epoch"

    @property
    def nodes_prefix(self) -> str:
        return self.root + "nodes/"

    def node(self, node_id: str) -> str:
        return self.nodes_prefix + check_name("node_id", node_id)

    @property
    def leader(self) -> str:
        return self.root + "leader"

    @property
    def generation(self) -> str:
        return self.root + "generation"

    @property
    def generations_prefix(self) -> str:
        return self.root + "generations/"

    def generation_history(self, generation: int) -> str:
        return f"{self.generations_prefix}{generation:012d}"

    @property
    def suspects_prefix(self) -> str:
        return self.root + "suspects/"

    def suspect(self, node_id: str) -> str:
        return self.suspects_prefix + check_name("node_id", node_id)

    @property
    def barriers_prefix(self) -> str:
        return self.root + "barriers/"

    def barrier_prefix(self, barrier: str) -> str:
        return f"{self.barriers_prefix}{check_name('barrier', barrier)}/"

    def barrier(self, barrier: str, node_id: str) -> str:
        return self.barrier_prefix(barrier) + check_name("node_id", node_id)

    @property
    def housekeeping(self) -> str:
        return self.root + "housekeeping"

    @property
    def compaction(self) -> str:
        """The revision the leader read at its last compaction (it compacts to it next)."""
        return self.root + "compaction"

    @property
    def commits_prefix(self) -> str:
        return self.root + "commits/"

    def commits_of(self, generation: int) -> str:
        return f"{self.commits_prefix}{generation:012d}/"

    def commit(self, generation: int, node_id: str) -> str:
        return self.commits_of(generation) + check_name("node_id", node_id)

    @property
    def safe(self) -> str:
        return self.root + "safe"

    @property
    def quarantine_prefix(self) -> str:
        return self.root + "quarantine/"

    def quarantine(self, node_id: str) -> str:
        return self.quarantine_prefix + check_name("node_id", node_id)

    @property
    def ended(self) -> str:
        return self.root + "ended"

    @property
    def stop(self) -> str:
        return self.root + "stop"

    @property
    def checkpoint(self) -> str:
        return self.root + "checkpoint"

    @property
    def cordon_prefix(self) -> str:
        return self.root + "cordon/"

    def cordon(self, node_id: str) -> str:
        return self.cordon_prefix + check_name("node_id", node_id)


def last_segment(key: str) -> str:
    """`/elasticpp/job/nodes/n1` -> `n1` (the node id of a per-node key)."""
    return key.rstrip("/").rsplit("/", 1)[-1]
