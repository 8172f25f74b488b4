"""Which processes count as gone, and which orphans a subreaper reaps (elasticpp.proctree):
a zombie is gone (it holds nothing but its exit status), a process in uninterruptible sleep
is not; a subreaper reaps only what it adopted, never a child its own code waits for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from elasticpp.proctree import ProcStat, adopted_zombies, counts_as_gone, parse_stat, read_stat
from elasticpp.train.worker.procs import _ForkedChild
from elasticpp.waiting import wait_until


def _stat_line(pid: int, comm: str, state: str, ppid: int, *, start: int, exit_code: int) -> str:
    # 52 fields as proc(5) numbers them: pid (comm) state ppid ... starttime (22) ...
    # exit_code (52).
    fields = [str(pid), f"({comm})", state, str(ppid)] + ["0"] * 48
    fields[21] = str(start)
    fields[51] = str(exit_code)
    return " ".join(fields) + "\n"


def test_a_stat_line_is_read_after_the_last_parenthesis_of_its_command_name() -> None:
    stat = parse_stat(_stat_line(41, "a (b) c", "Z", 7, start=12345, exit_code=9))
    assert stat == ProcStat(state="Z", ppid=7, start_ticks=12345, wait_status=9)
    with pytest.raises(ValueError):
        parse_stat("41 (short) S 1 2 3\n")


@pytest.mark.parametrize("state", ["Z", "X"])
def test_a_zombie_is_gone_it_holds_nothing_but_its_exit_status(state: str) -> None:
    assert counts_as_gone(ProcStat(state, 1, 10, 9))
    assert counts_as_gone(None)  # not there at all


@pytest.mark.parametrize("state", ["D", "T", "t", "R", "S"])
def test_a_process_in_uninterruptible_sleep_or_stopped_is_not_gone(state: str) -> None:
    # D: a driver or file system hang, out of reach of SIGKILL with everything it holds;
    # the node that has one stays set aside until it goes.
    assert not counts_as_gone(ProcStat(state, 1, 10, 0))


def test_a_subreaper_reaps_only_the_zombies_it_adopted() -> None:
    children = {
        10: ProcStat("Z", 1, 100, 9),  # seen before as another's child: adopted
        11: ProcStat("Z", 1, 110, 0),  # its own child, never another's: its code waits
        12: ProcStat("Z", 1, 999, 0),  # pid seen elsewhere, but another process since
        13: ProcStat("S", 1, 130, 0),  # adopted, still running
    }
    assert adopted_zombies(children, {10: 100, 12: 120, 13: 130}) == [10]


def test_a_forked_worker_that_is_a_zombie_of_its_template_is_gone_with_its_status() -> None:
    # This process stands for the template: a child it has not reaped is a zombie.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        forked = _ForkedChild(child.pid, os.getpid())
        assert forked.poll() is None
        os.kill(child.pid, signal.SIGSTOP)  # stopped: not gone
        assert wait_until(lambda: (read_stat(child.pid) or ProcStat("", 0, 0, 0)).state == "T", 5)
        assert forked.poll() is None
        os.kill(child.pid, signal.SIGKILL)
        assert wait_until(lambda: forked.poll() is not None, 5)
        assert forked.returncode == -signal.SIGKILL
        assert forked.wait(timeout=1) == -signal.SIGKILL
        assert read_stat(child.pid) is not None  # still a zombie: its parent reads it
    finally:
        child.kill()
        child.wait()


REAPER = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from elasticpp.proctree import OrphanReaper, become_subreaper, read_stat
    from elasticpp.waiting import wait_until

    assert become_subreaper()
    reaper = OrphanReaper()
    # A parent that starts a grandchild and exits once the grandchild is seen: the
    # grandchild is adopted by this process.
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.5)']);"
        "print(p.pid, flush=True); sys.stdin.readline()"
    )], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    orphan = int(parent.stdout.readline())
    reaper.scan()  # sees it as its parent's child
    own = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    parent.stdin.close()
    parent.wait()
    reaped = []
    wait_until(lambda: bool(reaped.extend(reaper.scan()) or reaped), 10)
    # Its own child exited meanwhile and is a zombie: the reaper left it to Popen.
    wait_until(lambda: read_stat(own.pid).state == "Z", 10)  # unreaped: it stays
    reaper.scan()
    print(json.dumps({"orphan": orphan, "reaped": reaped, "own": own.wait()}))
    """
)


def test_an_adopted_orphan_is_reaped_and_a_child_the_agent_waits_for_is_left_to_it() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("a child subreaper is Linux's")
    out = subprocess.run(
        [sys.executable, "-c", REAPER], capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["reaped"] == [[result["orphan"], 0]]
    assert result["own"] == 3  # not stolen: its exit status came to the code that waited
