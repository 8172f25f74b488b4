"""The interfaces the parts are built with: what a part may ask of the world. Each part takes
the ports it needs in its constructor; tests hand it fakes with the same methods."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from elasticpp.agent.kernel.summaries import WorkerSeen


class PoolPort(Protocol):
    """The supervisor's workers as other parts see them."""

    def counts(self) -> dict[str, int]: ...
    def any_alive(self) -> bool: ...
    def has_spares(self) -> bool: ...
    def release_spares(self) -> None: ...
    def seen(self) -> Sequence[WorkerSeen]: ...


class HealthPort(Protocol):
    """The gRPC health service: what probes and kubelet are told."""

    def set(self, service: str, status: int) -> None: ...
