"""The `trainrec` command line.

Subcommands live in modules ``trainrec.tools.cmd_*``; each exposes ``add_parser(subparsers)``, which
adds its parser and sets ``func`` with ``set_defaults``, and a ``run(args) -> int``. Errors of the
trainrec tree are printed as one clear line with exit code 2; damage found by ``check`` is exit 1.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.metadata
import logging
import pkgutil
import re
import sys

import trainrec.tools as _tools_pkg
from trainrec.schema.errors import TrainrecError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainrec",
        description="Replay and analyse trainrec flight-recorder logs of PyTorch training.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log warnings and progress details")
    parser.add_argument("--version", action="version", version=f"trainrec {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(_tools_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("cmd_"):
            module = importlib.import_module(f"trainrec.tools.{info.name}")
            module.add_parser(sub)
    for p in _subparsers(parser):
        # the subcommands' descriptions are their modules' docstrings: plain text in --help
        p.description = plain_text(p.description) if p.description else None
        p.epilog = plain_text(p.epilog) if p.epilog else None
        if not any("--verbose" in a.option_strings for a in p._actions):  # `trainrec inspect RUN -v` too
            p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                           help="log warnings and progress details")
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in dict.fromkeys(action.choices.values()):  # (an alias maps to the same parser)
                out.append(p)
                out.extend(_subparsers(p))
    return out


def plain_text(text: str) -> str:
    """reStructuredText markup of a docstring as plain text: ``:mod:`x``` and ````x```` become ``x``,
    and ``::`` ending a paragraph becomes ``:``."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return re.sub(r"::$", ":", text, flags=re.M)


def _version() -> str:
    try:
        return importlib.metadata.version("trainrec")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
        return "unknown"


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)subcommand's parser that ``args`` were parsed by: ``trainrec export csv``'s for that command."""
    while True:
        subs = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, subs.dest, None) if subs is not None else None
        if subs is None or name not in subs.choices:
            return parser
        parser = subs.choices[name]


def _unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """argparse's message for arguments no parser took, with the option meant where one looks like it."""
    known = [s[2:] for a in parser._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for arg in extra:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg[2:].split("=", 1)[0], known, n=1, cutoff=0.75)
            if close:
                hints.append(f"{arg.split('=', 1)[0]}: did you mean --{close[0]}?")
    return f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else "")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # under the subcommand's usage, not the top level's (which lists none of its options)
        chosen = _chosen_parser(parser, args)
        chosen.error(_unrecognized(chosen, extra))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, format="%(message)s")
    try:
        return int(args.func(args) or 0)
    except TrainrecError as exc:
        print(f"trainrec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `trainrec dump RUN | head`
        return 0
    except OSError as exc:  # a file the command had to read or write, that the system refused
        if args.verbose:
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"trainrec {args.command}: error: {where}{exc.strerror or exc} (-v for the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
