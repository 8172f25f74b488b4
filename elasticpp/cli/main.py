"""The `elasticpp` command: argument parsing and dispatch only.

Each subcommand lives in its own module `elasticpp.cli.<name>` with
`add_parser(subparsers) -> None` and `run(args) -> int`; modules are imported lazily so
that `elasticpp plan` never imports torch. Every flag falls back to its `ELASTICPP_*`
variable (elasticpp.cli.envflags); a bad value, of a flag or of a variable, and any
`ElasticppError` become one line on stderr and exit code 2. `kill -USR1 <pid>` prints every
thread's Python stack to stderr (a process that seems stuck says where it is; it goes on
running).

A command whose stdout reader goes away (`elasticpp plan ... | head -1`) ends quietly with
exit code 141, what a shell reports for a writer that SIGPIPE ended (128 + 13, as `yes |
head -1` gives under `set -o pipefail`): the output was cut short, which a script should be
able to tell, but it is no error of ours and deserves no traceback. SIGPIPE itself keeps
Python's handling (ignored, so a write raises): restoring its default would also end the
agent, silently, on a write to any pipe or socket whose peer left.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import importlib.metadata
import os
import select
import signal
import sys
from collections.abc import Mapping, Sequence

import elasticpp
from elasticpp.cli import envflags
from elasticpp.cli.envflags import EnvironmentParser
from elasticpp.errors import ElasticppError

EXIT_READER_GONE = 128 + signal.SIGPIPE  # 141: the shell's status of a writer SIGPIPE ended

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


def version() -> str:
    """The installed distribution's version (what pip and a wheel say), else the source
    tree's (`elasticpp.__version__`, run from a checkout that is not installed)."""
    try:
        return importlib.metadata.version("elasticpp")
    except importlib.metadata.PackageNotFoundError:
        return elasticpp.__version__


class _Version(argparse.Action):
    """`--version`: argparse's own action swallows a failed write (an unbuffered stdout
    whose reader left would exit 0, a buffered one 141); this one lets `main` tell."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(
            option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
            help="print the version and exit",
        )  # fmt: skip

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(f"elasticpp {version()}")
        parser.exit()


def build_parser(
    environ: Mapping[str, str] | None = None,
) -> tuple[argparse.ArgumentParser, dict[str, object]]:
    """The parser of every command, its flags falling back to `environ`'s `ELASTICPP_*`
    variables (elasticpp.cli.envflags; the process's environment by default)."""
    parser = EnvironmentParser(
        prog="elasticpp", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("-V", "--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=EnvironmentParser)
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
    envflags.install(parser, os.environ if environ is None else environ)
    return parser, modules


def _dump_stacks_on_usr1() -> None:
    """`kill -USR1` prints the threads' stacks to the process's stderr (when it has a file
    descriptor: not when a caller replaced sys.stderr, as an in-process test does)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return
    faulthandler.register(signal.SIGUSR1, file=fd, all_threads=True, chain=False)


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports POLLERR for it), so
    that a broken pipe elsewhere (a socket, a worker's pipe) keeps its traceback."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def _run(argv: Sequence[str] | None) -> int:
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


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _run(argv)
        finally:
            # Here, not at exit (also after --version's SystemExit): a reader that left
            # is told apart below.
            sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        # What is still buffered can go nowhere: stdout points at /dev/null from here, so
        # the interpreter's last flush does not fail again.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_READER_GONE


if __name__ == "__main__":
    sys.exit(main())
