"""Prometheus metrics of one agent, on a registry of its own (never the global one).

Names follow Prometheus's rules: `elasticpp_` prefix, base units, counters end in `_total`.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics import MetricWrapperBase

from elasticpp import __version__

M = TypeVar("M", bound=MetricWrapperBase)

WORKER_STATES = ("warm", "starting", "running", "stopping", "stopped", "done", "failed")


@dataclass
class AgentMetrics:
    registry: CollectorRegistry
    step: Gauge
    loss: Gauge
    generation: Gauge
    is_leader: Gauge
    etcd_up: Gauge
    members: Gauge
    safe_step: Gauge
    workers: Gauge
    steps_total: Counter
    worker_failures_total: Counter
    recoveries_total: Counter
    recovery_seconds: Histogram
    step_seconds: Histogram
    state_fetched_bytes_total: Counter
    etcd_values_skipped_total: Counter
    etcd_requests_total: Counter
    errors_total: Counter
    warm_started_total: Counter
    snapshot_failures_total: Counter
    halted: Gauge
    quarantined_nodes: Gauge
    quarantined: Gauge
    quarantines_total: Counter
    job_ended: Gauge
    job_finished: Gauge
    layout: Gauge
    certificate_expiry: Gauge
    learning_rate: Gauge
    grad_norm: Gauge
    samples_total: Counter
    tokens_total: Counter
    model_tflops: Gauge
    mfu: Gauge
    target_steps: Gauge
    build_info: Gauge
    labels: dict[str, str]
    # (metric, extra labels) -> its child with this agent's labels: `labels(**kw)` costs
    # microseconds a call, and the loop sets a dozen gauges a second on every node.
    _children: dict[tuple[int, tuple[tuple[str, str], ...]], MetricWrapperBase] = field(
        default_factory=dict
    )

    def of(self, metric: M, **extra: str) -> M:
        """`metric`'s child for this agent's labels and `extra`, looked up once."""
        key = (id(metric), tuple(sorted(extra.items())))
        child = self._children.get(key)
        if child is None:
            child = metric.labels(**self.labels, **extra)
            self._children[key] = child
        return cast(M, child)  # the child of a Gauge is a Gauge (prometheus_client's labels)

    def drop(self, metric: MetricWrapperBase, **extra: str) -> None:
        """Remove `metric`'s series for this agent's labels and `extra` (absent, not 0)."""
        key = (id(metric), tuple(sorted(extra.items())))
        if self._children.pop(key, None) is not None:
            metric.remove(*{**self.labels, **extra}.values())

    @classmethod
    def create(cls, node_id: str, job: str) -> AgentMetrics:
        r = CollectorRegistry(auto_describe=True)
        labels = {"node_id": node_id, "job_name": job}

        def g(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*labels, *extra], registry=r)

        def c(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=r)

        made = cls(
            registry=r,
            step=g("elasticpp_step", "Newest step this node's workers completed"),
            loss=g("elasticpp_loss", "Loss of the newest completed step (global-batch mean)"),
            generation=g("elasticpp_generation", "Plan generation this agent follows"),
            is_leader=g("elasticpp_is_leader", "1 if this agent is the leader"),
            etcd_up=g("elasticpp_etcd_up", "1 if the agent's last etcd call succeeded"),
            members=g(
                "elasticpp_members",
                "Registered nodes of the job (on a follower: the nodes of its generation)",
            ),
            safe_step=g(
                "elasticpp_safe_step",
                "Newest step this node knows to survive any single node loss (its store's "
                "floor); -1 until the leader first publishes one",
            ),
            workers=g("elasticpp_workers", "Local worker processes by state", ("state",)),
            steps_total=c("elasticpp_steps", "Steps completed by this node's workers"),
            worker_failures_total=c(
                "elasticpp_worker_failures", "Local worker exits or hangs that needed recovery"
            ),
            recoveries_total=c("elasticpp_recoveries", "Generations after the first"),
            recovery_seconds=Histogram(
                "elasticpp_recovery_seconds",
                "Seconds from detection to training resumed, per recovery (leader only)",
                list(labels),
                buckets=(0.5, 1, 2, 3, 4.5, 6, 10, 20, 45, 90),
                registry=r,
            ),
            step_seconds=Histogram(
                "elasticpp_step_seconds",
                "Wall time of one training step",
                list(labels),
                # Up to an hour: a step of a large model on few nodes can take minutes.
                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
                registry=r,
            ),
            state_fetched_bytes_total=c(
                "elasticpp_state_fetched_bytes", "Bytes of state pieces fetched from peers"
            ),
            etcd_values_skipped_total=c(
                "elasticpp_etcd_values_skipped",
                "etcd values this agent could not read (malformed or a newer format) and skipped",
            ),
            etcd_requests_total=Counter(
                "elasticpp_etcd_requests",
                "Requests this agent sent to etcd, by method (Range, Put, Txn, LeaseKeepAlive, "
                "...; Watch for a watch created, WatchEvent for an event a watch delivered)",
                [*labels, "method"],
                registry=r,
            ),
            errors_total=Counter(
                "elasticpp_agent_errors",
                "Errors the agent survived, by where they came from (etcd, disk, worker, "
                "internal): each was logged and the decision loop went on",
                [*labels, "source"],
                registry=r,
            ),
            warm_started_total=Counter(
                "elasticpp_warm_workers_started",
                "Warm workers this agent started, by how: fork (from the node's worker "
                "template, which imported torch once) or exec (a new interpreter importing "
                "torch: until the template is ready, or for good if it failed)",
                [*labels, "how"],
                registry=r,
            ),
            snapshot_failures_total=c(
                "elasticpp_snapshot_failures",
                "Snapshots a worker could not write (a full disk, an I/O error); their steps "
                "are not committed on this node",
            ),
            halted=g(
                "elasticpp_halted",
                "1 if training halted because a step's loss or gradient norm was not finite",
            ),
            quarantined_nodes=g(
                "elasticpp_quarantined_nodes",
                "Nodes of the job set aside (quarantined) by the leader, as this agent sees",
            ),
            quarantined=g("elasticpp_quarantined", "1 if this node is quarantined"),
            quarantines_total=c(
                "elasticpp_quarantines",
                "Quarantines this agent published as leader (a node failed generation after "
                "generation, missed a deadline, or cannot hold its state)",
            ),
            certificate_expiry=g(
                "elasticpp_tls_certificate_expiry_timestamp_seconds",
                "When the agent's TLS certificate (--tls-cert) expires, Unix time; read from "
                "the file at each scrape (a renewed certificate shows at once)",
            ),
            job_ended=g(
                "elasticpp_job_ended",
                "1 once the job ended, by status: finished, failed (failure budget spent), "
                "halted, or stopped (elasticpp job stop)",
                ("status",),
            ),
            layout=g(
                "elasticpp_layout",
                "The layout of the generation this agent follows: its size in each dimension "
                "(pp, tp, dp); 0 before any",
                ("dimension",),
            ),
            job_finished=g(
                "elasticpp_job_finished", "1 once the job trained all its steps (0 until then)"
            ),
            learning_rate=g("elasticpp_learning_rate", "Learning rate of the newest step"),
            grad_norm=g(
                "elasticpp_grad_norm", "Global gradient norm of the newest step (before clipping)"
            ),
            samples_total=c(
                "elasticpp_samples",
                "Samples trained in the steps this node took part in (the global batch a step)",
            ),
            tokens_total=c(
                "elasticpp_tokens",
                "Tokens trained in the steps this node took part in (global batch x seq_len)",
            ),
            model_tflops=g(
                "elasticpp_model_tflops",
                "Model TFLOP/s of this node's workers: the model FLOPs of their share of each "
                "step (elasticpp.plan.flops) over the steps' time, the newest 10 steps",
            ),
            mfu=g(
                "elasticpp_mfu",
                "Model FLOPs utilisation of this node's workers (0-1): elasticpp_model_tflops "
                "over their peak; absent where no peak is known (CPU slots without the job "
                "spec's peak_tflops, a GPU the peak table does not know)",
            ),
            target_steps=g("elasticpp_target_steps", "Steps the job trains in all (its spec)"),
            build_info=Gauge(
                "elasticpp_build_info",
                "Always 1; the labels say which elasticpp, Python and torch the agent runs",
                [*labels, "version", "python"],
                registry=r,
            ),
            labels=labels,
        )
        made.of(made.build_info, version=__version__, python=platform.python_version()).set(1)
        # Counters and histograms exist at 0 from the start (a rate over them says 0, not
        # "no data", before the first event).
        for metric in (
            made.steps_total, made.worker_failures_total, made.recoveries_total,
            made.recovery_seconds, made.step_seconds, made.state_fetched_bytes_total,
            made.etcd_values_skipped_total, made.snapshot_failures_total,
            made.quarantines_total, made.samples_total, made.tokens_total,
        ):  # fmt: skip
            made.of(metric)
        return made

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
