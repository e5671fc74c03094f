"""The ``kvstore`` entry point: every command module registered, one parser built from them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvstore.errors import KVStoreError
from kvstore_cli import engines, ops, processes, simulate, workloads
from kvstore_cli.registry import COMMANDS

# The order the commands are listed in ``kvstore --help``: by module, then as each module registers them.
_SECTIONS = [m.__name__ for m in (workloads, processes, engines, ops, simulate)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="kvstore: a distributed KVCache store.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in sorted(COMMANDS.items(), key=lambda item: _SECTIONS.index(item[1].run.__module__)):
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except KVStoreError as exc:
        print(f"kvstore {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
