"""Hold a process at its exit for a while, as a process in uninterruptible sleep (a driver or
file system hang) holds off SIGKILL: `python hold_exit.py PID HOLD_S`.

It attaches to PID with ptrace (PTRACE_SEIZE, PTRACE_O_TRACEEXIT; root or a permissive
ptrace scope needed), passes every signal on, and when the process starts to exit — SIGKILL
included — keeps it stopped there for HOLD_S seconds before letting it go. Until then the
process exists and its parent cannot reap it, whatever signals it sends. Prints "attached"
once attached and "held" when the exit is held; dying, it lets the process go (the kernel
detaches a dead tracer's tracees).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

PTRACE_CONT = 7
PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_O_TRACEEXIT = 0x40
PTRACE_EVENT_EXIT = 6
WALL = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def _ptrace(request: int, pid: int, data: int = 0) -> None:
    if _libc.ptrace(request, pid, None, ctypes.c_void_p(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({request}, {pid}): {os.strerror(err)}")


def main() -> int:
    pid, hold_s = int(sys.argv[1]), float(sys.argv[2])
    _ptrace(PTRACE_SEIZE, pid, PTRACE_O_TRACEEXIT)
    print("attached", flush=True)
    while True:
        _, status = os.waitpid(pid, WALL)
        if not os.WIFSTOPPED(status):
            return 0  # gone
        if status >> 16 == PTRACE_EVENT_EXIT:
            print("held", flush=True)
            time.sleep(hold_s)
            _ptrace(PTRACE_DETACH, pid)
            return 0
        event = status >> 16
        # A signal-delivery-stop passes its signal on; any other stop resumes as it was.
        _ptrace(PTRACE_CONT, pid, os.WSTOPSIG(status) if event == 0 else 0)


if __name__ == "__main__":
    sys.exit(main())
