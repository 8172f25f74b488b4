"""Fixtures the integration tests share (defined in tests/recovery.py and tests/etcdtls.py)."""

from tests.etcdtls import certs
from tests.recovery import reference, references

__all__ = ["certs", "reference", "references"]
