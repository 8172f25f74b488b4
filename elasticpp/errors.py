"""The one error root of elasticpp. A leaf module: it imports nothing of ours.

Bad input raises a `ConfigError` (or a subclass) whose message names the field and the
allowed values; the CLI turns any `ElasticppError` into one line on stderr and exit code 2.
"""

from __future__ import annotations

from collections.abc import Iterator


class ElasticppError(Exception):
    """Root of every error elasticpp raises on purpose."""


class ConfigError(ElasticppError):
    """A setting, flag, spec file or argument is invalid."""


class PlanError(ElasticppError):
    """No layout satisfies the request (nothing fits, batch too small, ...)."""


class CheckpointError(ElasticppError):
    """A checkpoint or state piece is missing, incomplete or corrupt."""


class StateUnavailableError(ElasticppError):
    """No live holder has the state a new layout needs."""


class StaleGenerationError(ElasticppError):
    """A request, worker or transfer belongs to an older plan generation."""


def causes(exc: BaseException | None, limit: int = 8) -> Iterator[BaseException]:
    """`exc` and what caused it (`__cause__`, else `__context__`), at most `limit` deep."""
    seen = 0
    while exc is not None and seen < limit:
        yield exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
