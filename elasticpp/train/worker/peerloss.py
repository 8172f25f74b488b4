"""Whether a worker's failure followed a peer's: its collective or point-to-point transfer
broke because another rank went away (a crash, a kill, a lost host).

When one rank of a generation dies, every rank it talks to fails a moment later with
"Connection closed by peer" (gloo) or an aborted communicator (NCCL); their agents report
the generation failed within a fraction of a second of the first report. The leader's blame
(`elasticpp.agent.sick.blame`) took the earliest reports within 0.5 s as the cause, so the
victims were struck with the culprit; once strikes stopped being cleared at every start, a
node whose workers die in their first step would have taken its healthy peers into
quarantine with it. A worker therefore says, with its error, whether the error is one of
these (`peer` in its `error` event), and a report that followed a peer's is blamed only when
no other report names a cause.

Read from the exception's text and type, along its chain: the backends raise RuntimeError
(gloo) or torch.distributed.DistBackendError / DistNetworkError (NCCL, the TCP store) with
these messages. A timeout is not among them: a rank hung inside a collective is found by
the agent's hang rule, not by its peers' timeouts.
"""

from __future__ import annotations

from elasticpp.errors import causes

# Substrings of the errors a rank gets when a peer went away, by backend.
PEER_SIGNS = (
    "Connection closed by peer",  # gloo: the peer's socket closed (its process died)
    "Connection reset by peer",  # gloo, TCP store: the peer's host reset the connection
    "Broken pipe",  # a write to a peer that is gone
    "remote process exited",  # NCCL: "remote process exited or there was a network error"
    "ncclRemoteError",
    "NCCL communicator was aborted",
)


def followed_a_peer(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) is the error of a rank whose peer went away."""
    return any(
        type(e).__name__ == "DistNetworkError" or any(sign in str(e) for sign in PEER_SIGNS)
        for e in causes(exc)
    )
