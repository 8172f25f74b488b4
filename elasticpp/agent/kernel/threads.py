"""Work off the loop: a thread of its own whose result comes back through a future, which
the loop polls (a done callback wakes it). The thread writes nothing of the agent's."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


def run_in_thread(name: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Run `fn(*args)` on a daemon thread of its own; its result (or error) comes back
    through the future, which the loop polls: the thread itself writes no agent state."""
    future: Future[Any] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to the loop, which decides what it means
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name=name).start()
    return future
