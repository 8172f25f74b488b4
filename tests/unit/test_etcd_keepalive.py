"""The keep-alive stream's bookkeeping with a stand-in for gRPC's call (the same cases run
against a real etcd in tests/integration/test_etcd_client_streams.py): a late answer is
taken by the request it answers, and one slow answer on a shared stream fails only its own
caller."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.etcd.keepalive import KeepAliveStream
from elasticpp.rpc.etcd.v3 import etcd_pb2 as pb
from elasticpp.waiting import wait_until


class _Call:
    """etcd's side: answers are put by the test, requests are recorded."""

    def __init__(self, requests: Iterator[Any]) -> None:
        self.answers: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.sent: list[int] = []
        self.cancelled = False
        threading.Thread(target=self._consume, args=(requests,), daemon=True).start()

    def _consume(self, requests: Iterator[Any]) -> None:
        for r in requests:
            self.sent.append(int(r.ID))

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self.answers.get()
            if item is None:
                return
            yield item

    def cancel(self) -> None:
        self.cancelled = True
        self.answers.put(None)


class _Channel:
    call: _Call | None = None

    def stream_stream(self, *_: Any, **__: Any) -> Any:
        def start(requests: Iterator[Any], metadata: Any = None) -> _Call:
            self.call = _Call(requests)
            return self.call

        return start


def _answer(call: _Call, lease: int, ttl: int) -> None:
    call.answers.put(pb.LeaseKeepAliveResponse(ID=lease, TTL=ttl))


def test_a_late_answer_is_taken_by_the_request_it_answers_not_the_next() -> None:
    channel = _Channel()
    stream = KeepAliveStream(channel, None)
    assert channel.call is not None
    with pytest.raises(ClusterUnavailableError, match="no answer"):
        stream.refresh(7, timeout_s=0.2)  # nothing answered at all: the stream is stuck
    assert not stream.usable and channel.call.cancelled


def test_one_slow_answer_on_a_shared_stream_fails_only_its_caller() -> None:
    """Before, a timeout ended the stream: every lease sharing it (the simulated nodes of one
    process) failed its keep-alive at once, and the leaders among them lost their terms."""
    channel = _Channel()
    stream = KeepAliveStream(channel, None)
    call = channel.call
    assert call is not None
    results: dict[int, Any] = {}

    def refresh(lease: int) -> None:
        try:
            results[lease] = stream.refresh(lease, timeout_s=2.0).TTL
        except ClusterUnavailableError as exc:
            results[lease] = exc

    slow = threading.Thread(target=refresh, args=(1,))
    other = threading.Thread(target=lambda: results.__setitem__(2, stream.refresh(2, 5.0).TTL))
    slow.start()
    other.start()
    assert wait_until(lambda: sorted(call.sent) == [1, 2], 5.0, interval_s=0.01)
    _answer(call, 2, 10)  # another lease is answered meanwhile: the stream is alive
    other.join()
    slow.join()
    assert results[2] == 10
    assert isinstance(results[1], ClusterUnavailableError)
    assert stream.usable  # lease 1's caller failed; the stream stays for the others
    # Lease 1's late answer (TTL 3) comes now; the next request gets its own (TTL 9).
    _answer(call, 1, 3)
    nxt = threading.Thread(target=refresh, args=(1,))
    nxt.start()
    assert wait_until(lambda: call.sent.count(1) == 2, 5.0, interval_s=0.01)
    _answer(call, 1, 9)
    nxt.join()
    assert results[1] == 9


class _Clock:
    """The module's `time`: monotonic() is set by the test, everything else is real time."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_a_caller_that_wakes_late_does_not_end_a_stream_that_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a busy machine the timed-out caller may wake long after its deadline. Before, the
    stream counted as stuck when nothing had answered within `timeout_s` of that late wake-up,
    so an answer to another lease after the send did not save it (a flaky failure on a loaded
    CI machine); now only a stream that answered nothing since the send is ended."""
    import elasticpp.cluster.etcd.keepalive as keepalive

    clock = _Clock()
    monkeypatch.setattr(keepalive, "time", clock)
    channel = _Channel()
    stream = KeepAliveStream(channel, None)
    call = channel.call
    assert call is not None
    results: dict[int, Any] = {}

    def slow() -> None:
        try:
            results[1] = stream.refresh(1, timeout_s=1.0).TTL
        except ClusterUnavailableError as exc:
            results[1] = exc

    caller = threading.Thread(target=slow)
    caller.start()
    other = threading.Thread(target=lambda: results.__setitem__(2, stream.refresh(2, 5.0).TTL))
    other.start()
    assert wait_until(lambda: sorted(call.sent) == [1, 2], 5.0, interval_s=0.01)
    clock.now = 100.1  # lease 2 is answered after lease 1's request was sent
    _answer(call, 2, 10)
    other.join()
    clock.now = 110.0  # lease 1's caller wakes up ten seconds after that answer
    caller.join()
    assert results[2] == 10
    assert isinstance(results[1], ClusterUnavailableError)
    assert stream.usable and not call.cancelled


@pytest.mark.parametrize(("late_ttl", "told"), [(3, True), (0, False)], ids=["renewed", "gone"])
def test_a_late_answer_that_renewed_the_lease_is_told_to_its_caller(
    late_ttl: int, told: bool
) -> None:
    """On an overloaded etcd or process an answer may come after its request's timeout:
    the lease was renewed all the same (at that request), and the caller may credit it. A
    late TTL 0 (the lease is gone) is not a renewal; an answer in time is not late."""
    channel = _Channel()
    stream = KeepAliveStream(channel, None)
    call = channel.call
    assert call is not None
    late: list[str] = []
    other = threading.Thread(target=lambda: stream.refresh(2, 5.0, lambda: late.append("2")))
    other.start()
    with pytest.raises(ClusterUnavailableError, match="no answer"):
        threading.Timer(0.1, _answer, args=(call, 2, 10)).start()  # the stream is alive
        stream.refresh(1, timeout_s=0.5, on_late=lambda: late.append("1"))
    other.join()
    assert stream.usable and late == []
    _answer(call, 1, late_ttl)
    _answer(call, 2, 10)  # an answer to no one: lease 2's caller was answered in time
    nxt = threading.Thread(target=lambda: stream.refresh(1, 5.0, lambda: late.append("1b")))
    nxt.start()
    assert wait_until(lambda: call.sent.count(1) == 2, 5.0, interval_s=0.01)
    _answer(call, 1, 9)  # the next request's own answer, in time
    nxt.join()
    assert late == (["1"] if told else [])
