"""`-o table|json|yaml`: how every command that prints a result prints it.

A command builds its result as plain data (dicts, lists, strings, numbers, None) once, and
hands it here with the function that draws its table. JSON is indented, keys sorted; YAML is
PyYAML's `safe_dump` (plain types only: nothing a reader could turn into code), keys sorted
too, so both list the same fields in the same order. A protobuf message becomes plain data
through `proto_dict`, not the bare proto3 JSON mapping, which writes int64 values as strings
(`"generation": "1"`) and leaves out every field at its zero value (a rank 0 worker without
`rank`, a recovery at step 0 without `resume_step`), which a script must then guess: here
every field is present and whole numbers are numbers.

A stream (`ctl events`) prints one item at a time: a table line, one JSON object a line
(JSON Lines), or one YAML document each (`---` first), flushed as it comes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

FORMATS = ("table", "json", "yaml")


def add_output_flag(p: argparse.ArgumentParser, *, json_alias: bool = False) -> None:
    """`-o/--output table|json|yaml`; with `json_alias`, `--json` as the older `-o json`."""
    p.add_argument(
        "-o",
        "--output",
        choices=FORMATS,
        default="table",
        help="table (for people), json or yaml (every field, numbers as numbers)",
    )
    if json_alias:
        p.add_argument(
            "--json",
            dest="output",
            action="store_const",
            const="json",
            help="the same as -o json (kept for the scripts that use it)",
        )


def proto_dict(message: Any) -> dict[str, Any]:
    """A protobuf message as plain data: field names as in the .proto, every field present
    (zeros and empty lists too), int64 values as numbers where a double holds them exactly
    (2**53; larger ones stay strings, as the proto3 JSON mapping says)."""
    from google.protobuf.json_format import MessageToDict  # type: ignore[import-untyped]
    from google.protobuf.message import Message  # type: ignore[import-untyped]

    if not isinstance(message, Message):
        raise TypeError(f"not a protobuf message: {type(message).__name__}")
    plain: dict[str, Any] = MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )
    return plain


def render(value: Any, fmt: str, table: Callable[[Any], str]) -> str:
    """The text of a result in `fmt` (one of FORMATS), without a final newline."""
    if fmt == "json":
        return json.dumps(value, indent=1, sort_keys=True)
    if fmt == "yaml":
        import yaml

        return str(yaml.safe_dump(value, sort_keys=True, allow_unicode=True)).rstrip("\n")
    if fmt == "table":
        return table(value)
    raise ValueError(f"unknown output format {fmt!r}; one of {', '.join(FORMATS)}")


def emit(value: Any, fmt: str, table: Callable[[Any], str]) -> None:
    """Print a result in `fmt`."""
    print(render(value, fmt, table))


def emit_item(value: Any, fmt: str, line: Callable[[Any], str]) -> None:
    """Print one item of a stream in `fmt`, at once."""
    if fmt == "json":
        text = json.dumps(value, sort_keys=True)
    elif fmt == "yaml":
        text = "---\n" + render(value, "yaml", line)
    else:
        text = render(value, fmt, line)
    print(text, flush=True)
    sys.stdout.flush()


def message_table(value: dict[str, Any]) -> str:
    """The table of a result that is a sentence (`drain`, `lift`, `job reset`): the sentence."""
    return str(value["message"])
