"""The `Membership` object: joining the job in etcd and this node's registration.

Joining is idempotent and waits for etcd up to JOIN_TIMEOUT_S: the spec checked against the
stored one, the leader's version, the job's epoch, warm workers, the registration, the
job's watches. The registration (a lease kept alive while the decision loop makes progress,
and the member key on it) is the shell's; its rules are in `step`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from elasticpp import __version__
from elasticpp.agent.actions import PublishMemberInfo
from elasticpp.agent.jobspec import JobSpec, diff
from elasticpp.agent.kernel.clock import LoopHeartbeat
from elasticpp.agent.kernel.executor import Executor
from elasticpp.agent.kernel.limits import JOIN_TIMEOUT_S, LEASE_STALL_S
from elasticpp.agent.membership import step
from elasticpp.cluster.errors import ClusterUnavailableError, LeaseNotFoundError
from elasticpp.cluster.leases import ProgressGate
from elasticpp.cluster.records import JobEpoch, WatchEvent, propose_epoch
from elasticpp.errors import ConfigError, ElasticppError

log = logging.getLogger("elasticpp.agent")


class RegistrationPort(Protocol):
    """This node's member key on its lease (`elasticpp.cluster.leases.Registration`)."""

    @property
    def lease_id(self) -> int: ...
    @property
    def conflict(self) -> str | None: ...
    def may_have_lapsed(self) -> bool: ...
    def update(self, info: dict[str, object]) -> bool: ...
    def close(self, *, revoke: bool = True) -> None: ...


class MembershipCluster(Protocol):
    """The etcd operations joining a job takes (`ClusterClient`'s)."""

    def put_spec_if_absent(self, spec_json: str) -> str: ...
    def leader(self) -> str | None: ...
    def member_records(self, nodes: Iterable[str]) -> Mapping[str, Mapping[str, object]]: ...
    def epoch_if_absent(self, proposed: int, node_id: str) -> JobEpoch: ...
    def register(
        self, node_id: str, info: dict[str, object], ttl_s: float, gate: ProgressGate | None
    ) -> RegistrationPort: ...
    def follow(
        self, on_event: Callable[[WatchEvent], None] | None, own_node: str | None
    ) -> None: ...


@dataclass(frozen=True)
class MembershipPorts:
    """What the membership reads and asks of the other parts."""

    newest_epoch: Callable[[], int]  # the newest epoch this node's store holds a commit of
    set_epoch: Callable[[int], None]  # the store commits in the job's epoch from now on
    spawn_warm: Callable[[], None]  # the supervisor's warm workers
    address: Callable[[], str]  # where peers dial this node
    slots: Callable[[], int]
    draining: Callable[[], bool]
    members: Callable[[], Mapping[str, Mapping[str, object]]]  # the view's member records
    on_watch: Callable[[WatchEvent], None]  # a change under the job's watched keys


class Membership:
    """This node's membership of the job: `join`, then its registration's answers."""

    def __init__(
        self,
        node_id: str,
        incarnation: str,
        spec: JobSpec,
        *,
        cluster: MembershipCluster,
        heartbeat: LoopHeartbeat,
        ports: MembershipPorts,
    ) -> None:
        self.node_id = node_id
        self.incarnation = incarnation
        self._spec = spec
        self._cluster = cluster
        self._heartbeat = heartbeat
        self._ports = ports
        self._registration: RegistrationPort | None = None
        self.joined = False

    def register(self, executor: Executor) -> None:
        executor.register(PublishMemberInfo, lambda _: self.publish())

    # ------------------------------------------------------------------ joining
    def join(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Join the job; while etcd is busy or restarting, try again until `timeout_s`
        (then raise what etcd said). Raises ConfigError on a spec or version that differs
        from the job's."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._heartbeat.busy()  # each try at joining is the loop's work
            try:
                self._join_once()
                break
            except (ClusterUnavailableError, LeaseNotFoundError) as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning(
                    "joining job %s: etcd not available (%s); retrying", self._spec.name, exc
                )
                time.sleep(0.5)
        self.joined = True
        self._heartbeat.busy()

    def _join_once(self) -> None:
        """Idempotent: check the spec and the version, take the job's epoch, start warm
        workers, register, watch."""
        ours = self._spec.to_json()
        stored = self._cluster.put_spec_if_absent(ours)
        if stored != ours:
            fields = diff(self._spec, JobSpec.from_json(stored))
            raise ConfigError(
                f"job spec differs from the one job {self._spec.name!r} runs with, in: "
                f"{', '.join(fields) or 'format'}"
            )
        self.check_version()
        # Larger than every epoch this node's store knows, even with its clock behind.
        job_epoch = self._cluster.epoch_if_absent(
            propose_epoch(self._ports.newest_epoch()), self.node_id
        )
        self._ports.set_epoch(job_epoch.epoch)  # refuses one below this node's own commits
        self._ports.spawn_warm()
        self.take_lease()
        # The view reads the leader, generation, barriers and the safe step from the job's
        # watch-fed cache, and this node's own member key; each change wakes the loop. The
        # other member keys are cached on the leader alone.
        self._cluster.follow(self._ports.on_watch, self.node_id)

    def check_version(self) -> None:
        """One job's agents run one elasticpp: raises ConfigError when the job's leader runs
        another. One read: the leader's member key, not every node's."""
        leader = self._cluster.leader()
        if leader is None or leader == self.node_id:
            return
        theirs = self._cluster.member_records([leader]).get(leader, {}).get("version")
        why = step.version_refusal(self._spec.name, self.node_id, leader, theirs, __version__)
        if why is not None:
            raise ConfigError(why)

    def take_lease(self) -> None:
        """Register this node (once): its member key on a lease renewed while the decision
        loop makes progress."""
        if self._registration is None:
            self._registration = self._cluster.register(
                self.node_id, self.info(), self._spec.lease_ttl_s, self.lease_gate()
            )

    # ------------------------------------------------------------------ the registration
    def info(self) -> dict[str, object]:
        """This node's member record now."""
        p = self._ports
        return step.member_info(
            p.address(), p.slots(), p.draining(), self.incarnation, os.getpid(), __version__
        )

    def publish(self) -> None:
        """This node's member record again (slots, draining). The registration keeps the new
        info: its keeper writes it when it re-puts the key, if this write does not land
        (elasticpp.cluster.leases)."""
        if self._registration is not None:
            with contextlib.suppress(ElasticppError):
                self._registration.update(self.info())

    def lease_gate(self) -> ProgressGate:
        """Leases are renewed only while the decision loop runs (see limits.LEASE_STALL_S)."""
        return ProgressGate(self._heartbeat.stuck_s, LEASE_STALL_S)

    def fenced(self) -> bool:
        """Whether this node's lease may have lapsed: its writes as a node must wait."""
        reg = self._registration
        return reg is not None and reg.may_have_lapsed()

    def member_lease(self) -> int | None:
        """The lease this node's member key is meant to be on: its writes as a node (barrier
        arrivals, commit records) land only while the key is on it (`ClusterClient.arrive`)."""
        reg = self._registration
        return int(reg.lease_id) if reg is not None else None

    def conflict(self) -> str | None:
        """Why this agent must stop because another agent holds its node id (`step.id_conflict`);
        None while it is registered alone, or not registered."""
        reg = self._registration
        if reg is None:
            return None
        return step.id_conflict(reg.conflict, self._ports.members(), self.node_id, self.incarnation)

    def close(self, *, revoke: bool = True) -> None:
        """Leave: the lease is revoked (`revoke`), so the member key goes at once; a lost
        node's (`revoke=False`) lapses by its TTL."""
        reg, self._registration = self._registration, None
        if reg is not None:
            with contextlib.suppress(ElasticppError):
                reg.close(revoke=revoke)
