"""The `type=` of every flag that takes a value: each turns the text into the value and
refuses nonsense (a negative count, a timeout of 0, NaN, an empty path, a HOST:PORT without
a port) with `argparse.ArgumentTypeError`, whose message argparse prefixes with the flag's
name and `elasticpp.cli.envflags` with the variable's. So a value from the command line and
one from the environment are parsed and refused the same way, before a command runs.

Checks that need two flags (`--kill-at` < `--rejoin-at`) or a file stay in the commands.
"""

from __future__ import annotations

import math
from argparse import ArgumentTypeError
from collections.abc import Callable
from pathlib import Path

from elasticpp.errors import ConfigError


def _integer(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _number(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return value


def port(text: str) -> int:
    """A TCP port, 0 included (where 0 means "off" or "any", as the flag's help says)."""
    value = _integer(text)
    if not 0 <= value < 65536:
        raise ArgumentTypeError(f"must be a port in [0, 65535], got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A probability such as dropout: [0, 1)."""
    value = _number(text)
    if not 0 <= value < 1:
        raise ArgumentTypeError(f"must be a number in [0, 1), got {text!r}")
    return value


def nonempty(text: str) -> str:
    if not text.strip():
        raise ArgumentTypeError("must not be empty")
    return text


def path(text: str) -> Path:
    """A file or directory path; an empty one is refused (`Path("")` would be `.`)."""
    return Path(nonempty(text))


def host_port(text: str) -> str:
    """HOST:PORT (`[::1]:7430` for IPv6), the port in [0, 65535] (0: any free port)."""
    host, sep, number = text.strip().rpartition(":")
    if not sep or not host.strip("[]") or not number.isdigit() or int(number) > 65535:
        raise ArgumentTypeError(f"expected HOST:PORT, e.g. 127.0.0.1:7430, got {text!r}")
    return text.strip()


def host_port_or_empty(text: str) -> str:
    """HOST:PORT, or empty for "off"."""
    return "" if not text.strip() else host_port(text)


def agent_address(text: str) -> str:
    """An agent's gRPC HOST:PORT, or unix:PATH of its control socket."""
    if text.startswith("unix:"):
        if not text.removeprefix("unix:").removeprefix("//"):
            raise ArgumentTypeError(f"expected unix:PATH, got {text!r}")
        return text
    value = host_port(text)
    if value.endswith(":0"):
        raise ArgumentTypeError(f"port 0 is no agent's port, got {text!r}")
    return value


def etcd_endpoints(text: str) -> str:
    """HOST:PORT[,HOST:PORT...], each also as http:// or https:// (whether https fits the
    TLS flags is checked with them, in `etcdflags.etcd_from_args`)."""
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    if not endpoints:
        raise ArgumentTypeError("needs at least one HOST:PORT")
    for endpoint in endpoints:
        _checked(_parse_endpoint, endpoint)
    return text


def _parse_endpoint(text: str) -> tuple[str, int]:
    from elasticpp.cluster.etcd.security import parse_endpoint

    return parse_endpoint(text, tls=text.startswith("https://"))


def _checked(check: Callable[[str], object], text: str) -> None:
    try:
        check(text)
    except ConfigError as exc:
        raise ArgumentTypeError(str(exc)) from None


def name(text: str) -> str:
    """A job or node name, as the etcd key layout takes it."""
    from elasticpp.cluster.keys import check_name

    _checked(lambda t: check_name("name", t), text)
    return text


def etcd_prefix(text: str) -> str:
    from elasticpp.cluster.keys import check_prefix

    _checked(check_prefix, text)
    return text


def layout(text: str) -> str:
    """`pp=P,tp=T,dp=D`, checked here and parsed again by the command (a Layout)."""
    from elasticpp.plan import Layout

    _checked(Layout.parse, text)
    return text


def device_preset(text: str) -> str:
    from elasticpp.plan import load_device_spec

    _checked(load_device_spec, text)
    return text


def node_gpus(text: str) -> str:
    """`N,N,...`: the healthy GPUs of each node, at least one node, counts >= 0."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not counts or any(c < 0 for c in counts):
        raise ArgumentTypeError(f"needs at least one node and counts >= 0, got {text!r}")
    return text


def key_value(text: str) -> str:
    """`KEY=VALUE` with a non-empty KEY."""
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return text


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def since(text: str) -> float:
    """A point in time as wall-clock seconds: a duration back from now (`90s`, `10m`, `2h`,
    `1d`), or a date and time in ISO 8601 (`2026-12-04T19:00:00Z`; without a zone, UTC)."""
    import datetime
    import time

    value = text.strip()
    unit = _DURATION_UNITS.get(value[-1:].lower())
    if unit is not None:
        try:
            amount = float(value[:-1])
        except ValueError:
            amount = math.nan
        if math.isfinite(amount) and amount >= 0:
            return time.time() - amount * unit
    else:
        try:
            when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            if when.tzinfo is None:
                when = when.replace(tzinfo=datetime.UTC)
            return when.timestamp()
    raise ArgumentTypeError(
        f"expected a duration back from now (90s, 10m, 2h, 1d) or an ISO 8601 time, got {text!r}"
    )
