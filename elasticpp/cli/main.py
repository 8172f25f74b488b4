"""The `elasticpp` command: argument parsing and dispatch only.

Each subcommand lives in its own module `elasticpp.cli.<name>` with
`add_parser(subparsers) -> None` and `run(args) -> int`; modules are imported lazily so
that `elasticpp plan` never imports torch. Any `ElasticppError` becomes one line on stderr
and exit code 2. `kill -USR1 <pid>` prints every thread's Python stack to stderr (a process
that seems stuck says where it is; it goes on running).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import signal
import sys
from collections.abc import Sequence

from elasticpp.errors import ElasticppError

# name -> one-line help; the module elasticpp.cli.<name> implements it.
SUBCOMMANDS: dict[str, str] = {
    "plan": "choose the fastest (p, t, d) layout for a cluster",
    "train": "train with a fixed layout on local worker processes",
    "agent": "run the node agent (one per node)",
    "ctl": "talk to a running agent over gRPC",
    "job": "a job as etcd holds it: status, reset, delete (also once its agents are gone)",
    "demo": "local elastic demo: 4 agents, a node killed and brought back",
    "export": "write a saved step as a Hugging Face model directory",
    "data": "prepare training data: tokenise text files into a token file",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's own exit code is 2 too; keep it to one line on stderr.
        self.exit(2, f"elasticpp: error: {message}\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, object]]:
    parser = _Parser(prog="elasticpp", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    modules: dict[str, object] = {}
    for name, help_text in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(f"elasticpp.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"elasticpp.cli.{name}":
                raise
            continue  # not built yet
        sp = sub.add_parser(name, help=help_text, description=help_text)
        module.add_parser(sp)
        modules[name] = module
    return parser, modules


def _dump_stacks_on_usr1() -> None:
    """`kill -USR1` prints the threads' stacks to the process's stderr (when it has a file
    descriptor: not when a caller replaced sys.stderr, as an in-process test does)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return
    faulthandler.register(signal.SIGUSR1, file=fd, all_threads=True, chain=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    _dump_stacks_on_usr1()
    module = modules[args.command]
    try:
        return int(module.run(args))  # type: ignore[attr-defined]
    except ElasticppError as exc:
        print(f"elasticpp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"elasticpp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
