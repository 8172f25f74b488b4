"""The one error root of elasticpp. A leaf module: it imports nothing of ours.

Bad input raises a `ConfigError` (or a subclass) whose message names the field and the
allowed values; the CLI turns any `ElasticppError` into one line on stderr and exit code 2.
"""


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
