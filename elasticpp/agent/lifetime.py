"""The agent process's own lifetime: what it adopts, and that its stop leaves nothing.

The agent's shutdown (`node.Agent.shutdown`) kills what it started and knows: its workers,
its spares, its worker template. What it does not know can still be of its tree: the
workers a killed template forked (re-parented when it died), whatever a worker started, a
stopped process. So the agent process

- is a child subreaper (`proctree.become_subreaper`): an orphan of its tree is re-parented
  to it, not to init, and stays in its tree; its orphan reaper reaps the ones that exit
  (`proctree.OrphanReaper`, which never takes the exit status of a child the agent's own
  code waits for);
- ends its stop with its whole tree (`finish`): SIGTERM and SIGCONT (a stopped process
  handles its SIGTERM only once it runs), SIGKILL of what is left after AGENT_STOP_GRACE_S,
  every exited child reaped;
- holds its stop to a deadline (`stop_requested`): a shutdown not over `stop_timeout_s`
  after the stop signal is cut short by SIGKILL of the tree and the process's exit, so that
  within stop_timeout_s + AGENT_STOP_KILL_WAIT_S of SIGTERM no process of its tree is left
  (but one in uninterruptible sleep, which no signal ends).

Only the entry point that owns the process uses this (`elasticpp agent`): an agent built in
another program (a test, a simulation) must not adopt or kill that program's processes.
"""

from __future__ import annotations

import logging
import os
import threading

from elasticpp.agent.kernel.limits import (
    AGENT_STOP_GRACE_S,
    AGENT_STOP_KILL_WAIT_S,
    ORPHAN_SCAN_EVERY_S,
)
from elasticpp.proctree import OrphanReaper, become_subreaper, reap_all_children, stop_tree

log = logging.getLogger("elasticpp.agent")

STOP_OVERDUE_EXIT = 1  # the stop did not finish by its deadline: cut short


class AgentProcess:
    def __init__(self, stop_timeout_s: float) -> None:
        self.stop_timeout_s = stop_timeout_s
        self._reaper = OrphanReaper()
        self._deadline: threading.Timer | None = None
        self._lock = threading.Lock()

    def adopt_orphans(self) -> bool:
        """Become the reaper of this process's tree, and reap what it adopts."""
        if not become_subreaper():
            log.info("not a child subreaper (not Linux?): orphans of workers go to init")
            return False
        self._reaper.start(ORPHAN_SCAN_EVERY_S)
        return True

    def stop_requested(self) -> None:
        """The stop signal came (from a signal handler): the stop has its deadline now."""
        with self._lock:
            if self._deadline is None:
                self._deadline = threading.Timer(self.stop_timeout_s, self._overdue)
                self._deadline.daemon = True
                self._deadline.start()

    def _overdue(self) -> None:
        log.warning(
            "the agent's stop is not over %.0f s after the stop signal (stop_timeout_s): "
            "SIGKILL of every process of its tree, and exit",
            self.stop_timeout_s,
        )
        self._reaper.stop()
        left = stop_tree(
            os.getpid(), grace_s=0, kill_wait_s=AGENT_STOP_KILL_WAIT_S, reap=reap_all_children
        )
        if left:
            log.warning("outlived SIGKILL (uninterruptible sleep?): %s", left)
        logging.shutdown()
        os._exit(STOP_OVERDUE_EXIT)

    def finish(self) -> list[int]:
        """After the agent's shutdown: stop what is left of the process's tree and reap it.
        The agent's code waits for no child any more, so every exited child is reaped.
        Returns the processes that outlived SIGKILL."""
        self._reaper.stop()
        left = stop_tree(
            os.getpid(),
            grace_s=AGENT_STOP_GRACE_S,
            kill_wait_s=AGENT_STOP_KILL_WAIT_S,
            reap=reap_all_children,
        )
        if left:
            log.warning(
                "processes of this agent outlived SIGKILL (uninterruptible sleep?): %s", left
            )
        with self._lock:
            if self._deadline is not None:
                self._deadline.cancel()
        return left
