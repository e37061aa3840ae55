"""The `trainrec` command line.

Subcommands live in modules ``trainrec.tools.cmd_*``; each exposes ``add_parser(subparsers)``, which
adds its parser and sets ``func`` with ``set_defaults``, and a ``run(args) -> int``. Errors of the
trainrec tree are printed as one clear line with exit code 2; damage found by ``check`` is exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

import trainrec.tools as _tools_pkg
from trainrec.schema.errors import TrainrecError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainrec",
        description="Replay and analyse trainrec flight-recorder logs of PyTorch training.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log warnings and progress details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(_tools_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("cmd_"):
            module = importlib.import_module(f"trainrec.tools.{info.name}")
            module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, format="%(message)s")
    try:
        return int(args.func(args) or 0)
    except TrainrecError as exc:
        print(f"trainrec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `trainrec dump RUN | head`
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
