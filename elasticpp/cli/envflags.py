"""Environment fallbacks of the flags: one rule for every flag of every command.

`--etcd-prefix` reads `ELASTICPP_ETCD_PREFIX` when the command line does not give it: the
flag's long name, upper case, `-` as `_`, after `ELASTICPP_`. The flag beats the variable,
and the variable beats the default; an empty variable counts as unset (`ELASTICPP_X=` in a
systemd unit clears it). A flag of the same name in two commands reads the same variable
(`ELASTICPP_ETCD` for `agent` and `job`), as its meaning is the same.

A value from a variable is parsed and checked by the flag's own `type=` and `choices`, so
it is refused the same way, with exit code 2 and one line naming the variable and its flag.
A switch (`--insecure`) takes `1`, `true`, `yes` or `on`, and `0`, `false`, `no` or `off`;
a flag given several times (`--model-option`, `--data`) takes its items split as a shell
would (`shlex`), and given on the command line it replaces the variable's items. Of a group
of flags that exclude one another, one given on the command line sets every variable of the
group aside, and two variables of the group are refused together.

Not read from the environment: `--help` and `--version`; `--force`, a confirmation of one
command that a variable left in a shell would give to every later command; aliases of
another flag (`--json`, which is `-o json`: `ELASTICPP_OUTPUT=json`); and positional
arguments. No flag takes a secret's value (a token or a password is a `*-file` path), so no
variable carries one either.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

PREFIX = "ELASTICPP_"
# Flags a variable does not give (see the module docstring).
NOT_FROM_ENVIRONMENT = frozenset({"--help", "--version", "--force", "--json"})
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def variable_of(action: argparse.Action) -> str | None:
    """The variable of a flag, or None for one the environment does not give."""
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs or set(action.option_strings) & NOT_FROM_ENVIRONMENT:
        return None
    if action.dest == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
        return None
    return PREFIX + max(longs, key=len)[2:].upper().replace("-", "_")


class _FromEnvironment(list[Any]):
    """The default a flag gets while its variable is set: a marker that survives argparse
    (an appending flag copies it, so a copy with items is the command line's)."""

    def __init__(self, variable: str, text: str) -> None:
        super().__init__()
        self.variable = variable
        self.text = text


class EnvironmentParser(argparse.ArgumentParser):
    """An ArgumentParser whose flags fall back to their variables (`install` names them).

    Errors are one line on stderr with exit code 2 (argparse's own code), no usage dump."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.environ: Mapping[str, str] = {}
        self.variables: dict[argparse.Action, str] = {}  # `install` names them

    def error(self, message: str) -> None:  # type: ignore[override]
        missing = "the following arguments are required: "
        if message.startswith(missing):  # say that a variable gives a flag as well
            by_flag = {"/".join(a.option_strings): v for a, v in self.variables.items()}
            message = missing + ", ".join(
                f"{name} (or {by_flag[name]})" if name in by_flag else name
                for name in message.removeprefix(missing).split(", ")
            )
        self.exit(2, f"elasticpp: error: {message}\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        variables = self.variables
        saved: dict[argparse.Action, tuple[Any, bool]] = {}
        for action, variable in variables.items():
            text = self.environ.get(variable, "")
            if text.strip():
                saved[action] = (action.default, action.required)
                action.default = _FromEnvironment(variable, text)
                action.required = False
        try:
            ns, extras = super().parse_known_args(args, namespace)
        finally:
            for action, (default, required) in saved.items():
                action.default, action.required = default, required
        self._resolve(ns, saved)
        return ns, extras

    def _resolve(
        self, ns: argparse.Namespace, saved: dict[argparse.Action, tuple[Any, bool]]
    ) -> None:
        for group in self._mutually_exclusive_groups:
            members = group._group_actions
            given = [
                a for a in members
                if not isinstance(getattr(ns, a.dest, None), _FromEnvironment)
                and getattr(ns, a.dest, None) != (saved[a][0] if a in saved else a.default)
            ]  # fmt: skip
            waiting = [
                a for a in members if isinstance(getattr(ns, a.dest, None), _FromEnvironment)
            ]
            if given:
                for a in waiting:  # the command line's flag beats the group's variables
                    setattr(ns, a.dest, saved[a][0])
            elif len(waiting) > 1:
                names = " and ".join(self.variables[a] for a in waiting)
                self.error(f"{names} exclude one another: set one")
        for action, (default, _) in saved.items():
            value = getattr(ns, action.dest, None)
            if not isinstance(value, _FromEnvironment):
                continue
            if value:  # an appending flag given on the command line: its items alone
                setattr(ns, action.dest, list(value))
                continue
            setattr(ns, action.dest, self._from_text(action, value, default))

    def _from_text(self, action: argparse.Action, value: _FromEnvironment, default: Any) -> Any:
        flag = max(action.option_strings, key=len)
        where = f"{value.variable}={value.text!r} (the variable of {flag})"
        if action.nargs == 0:  # a switch: store_true, store_false, store_const
            word = value.text.strip().lower()
            if word in _TRUE:
                return action.const
            if word in _FALSE:
                return default
            self.error(f"{where}: expected 1, true, yes or on, or 0, false, no or off")
        if isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*"):
            try:
                items = shlex.split(value.text)
            except ValueError as exc:
                self.error(f"{where}: {exc}")
            return [self._convert(action, where, item) for item in items]
        return self._convert(action, where, value.text)

    def _convert(self, action: argparse.Action, where: str, text: str) -> Any:
        convert = self._registry_get("type", action.type, action.type)
        try:
            value = convert(text)
        except argparse.ArgumentTypeError as exc:
            self.error(f"{where}: {exc}")
        except (TypeError, ValueError):
            self.error(f"{where}: invalid {getattr(action.type, '__name__', 'value')} value")
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(repr, action.choices))
            self.error(f"{where}: invalid choice {value!r} (choose from {choices})")
        return value


def install(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Name the variable of every flag of `parser` and its subcommands, say it in each
    flag's `--help`, and read them from `environ` when parsing."""
    if isinstance(parser, EnvironmentParser):
        parser.environ = environ
        parser.variables = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                install(sub, environ)
            continue
        variable = variable_of(action)
        if variable is None or not isinstance(parser, EnvironmentParser):
            continue
        parser.variables[action] = variable
        if action.help != argparse.SUPPRESS:
            action.help = f"{action.help or ''} [{variable}]".lstrip()


def variables(parser: argparse.ArgumentParser) -> dict[str, list[tuple[str, argparse.Action]]]:
    """Every variable of `parser`'s tree -> the (command, flag action) pairs that read it."""
    out: dict[str, list[tuple[str, argparse.Action]]] = {}

    def walk(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
            elif (variable := variable_of(action)) is not None:
                out.setdefault(variable, []).append((p.prog, action))

    walk(parser)
    return out
