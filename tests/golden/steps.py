"""The agent's pure steps by name: what the golden traces record and replay. A step that moves
keeps its name here; its import follows it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elasticpp.agent.control.step import control_step
from elasticpp.agent.durability.step import (
    durability_committed,
    durability_dropped,
    durability_on_snapshot,
    durability_on_snapshot_failed,
    durability_on_step,
    durability_recorded,
)
from elasticpp.agent.follower.step import (
    follower_arrived,
    follower_assigned,
    follower_fetch_started,
    follower_step,
)
from elasticpp.agent.health.step import job_end_step
from elasticpp.agent.leader.resume import (
    leader_fresh_checked,
    leader_pull_started,
    leader_resume_resolved,
    leader_resume_wait_published,
    leader_resume_written,
    stop_wait_step,
)
from elasticpp.agent.leader.step import (
    leader_generation_written,
    leader_safe_read,
    leader_safe_step,
    leader_safe_written,
    leader_step,
    leader_timeline_recorded,
)
from elasticpp.agent.liveness.step import leader_deposed, leader_probed, leader_watch_step
from elasticpp.agent.supervisor.step import supervisor_step, template_step
from elasticpp.agent.view.step import view_step

STEPS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        control_step,
        view_step,
        supervisor_step,
        template_step,
        leader_watch_step,
        leader_probed,
        leader_deposed,
        follower_step,
        follower_arrived,
        follower_fetch_started,
        follower_assigned,
        durability_on_step,
        durability_on_snapshot,
        durability_recorded,
        durability_dropped,
        durability_committed,
        durability_on_snapshot_failed,
        leader_step,
        leader_generation_written,
        leader_timeline_recorded,
        leader_safe_step,
        leader_safe_read,
        leader_safe_written,
        leader_pull_started,
        leader_resume_resolved,
        leader_fresh_checked,
        leader_resume_wait_published,
        leader_resume_written,
        job_end_step,
        stop_wait_step,
    )
}
