"""The shape of what the agent reads from etcd and its peers before it is checked: JSON.

A `Record` is one JSON object as a member key, a barrier arrival or a timeline holds it;
its values are `JSONValue`s, which a reader narrows (an `isinstance`, `barriers.check_*`)
before it uses them: nothing read from outside is taken for more than JSON."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias

JSONValue: TypeAlias = "bool | int | float | str | list[JSONValue] | dict[str, JSONValue] | None"
Record: TypeAlias = Mapping[str, JSONValue]


def fields(value: JSONValue) -> Record:
    """`value` as a JSON object; anything else reads as an empty one. (A barrier arrival is
    checked for its barrier's shape when it is read: `cluster.barriers.check_arrival`.)"""
    return value if isinstance(value, dict) else {}


def number(record: Record, key: str, default: float | None = None) -> float:
    """`record[key]` as a number (`default` if absent; without one, KeyError); raises
    TypeError or ValueError on a value that is not one."""
    value = record[key] if default is None else record.get(key, default)
    if isinstance(value, (int, float, str)):
        return float(value)
    raise TypeError(f"{key}: expected a number, got {type(value).__name__}")


def integer(record: Record, key: str, default: int | None = None) -> int:
    """`record[key]` as an integer (`default` if absent; without one, KeyError); raises
    TypeError or ValueError on a value that is not one."""
    value = record[key] if default is None else record.get(key, default)
    if isinstance(value, (int, float, str)):
        return int(value)
    raise TypeError(f"{key}: expected an integer, got {type(value).__name__}")
