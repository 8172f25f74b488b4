"""The one character set of model unit and parameter names, and its one parser.

A leaf module (it imports only `elasticpp.errors`), so the planner, the checkpoint format
and the model contract all read names the same way.

A name is 1 to 128 characters of lowercase ASCII letters, digits, `_`, `.` and `-`, and
starts with a letter or a digit. Such a name can never be a path (no `/`), never be `.` or
`..`, and never start a hidden file, so a piece file named after a unit stays inside its
step directory whatever a peer or an etcd value claims. Hugging Face parameter names
(`model.layers.0.self_attn.q_proj.weight`) fit as they are.
"""

from __future__ import annotations

import re

from elasticpp.errors import ConfigError

NAME_PATTERN = r"[a-z0-9][a-z0-9_.-]{0,127}"
_NAME_RE = re.compile(rf"^{NAME_PATTERN}$")
CHARSET = "lowercase letters, digits, '_', '.', '-' (first a letter or digit, at most 128)"


def parse_name(name: object, *, what: str = "name") -> str:
    """`name` if it is a valid unit or parameter name; `ConfigError` naming it otherwise."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"{what} {name!r:.80} is not a valid name: use {CHARSET}")
    return name


def is_name(name: str) -> bool:
    return bool(_NAME_RE.fullmatch(name))
