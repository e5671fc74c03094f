"""The registry of ``kvstore`` subcommands, and the helpers the command modules share.

A command module pairs an :func:`arguments` function with a :func:`command` function of the same
name; :mod:`kvstore_cli.main` imports every command module and builds the parser from
:data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from kvstore.config import parse_size
from kvstore.errors import KVStoreError


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def command(
    name: str, help: str
) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        adder = _ARGUMENTS.pop(name)
        COMMANDS[name] = Command(help, adder, fn)
        return fn

    return register


_ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {}


def arguments(
    name: str,
) -> Callable[[Callable[[argparse.ArgumentParser], None]], Callable[[argparse.ArgumentParser], None]]:
    def register(fn: Callable[[argparse.ArgumentParser], None]) -> Callable[[argparse.ArgumentParser], None]:
        _ARGUMENTS[name] = fn
        return fn

    return register


def size_arg(text: str) -> int:
    """An argparse ``type`` for sizes such as ``64KiB``."""
    try:
        return parse_size(text)
    except KVStoreError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def print_metrics(title: str, rows: Sequence[tuple[str, str]]) -> None:
    """A two-column table of named figures on standard output."""
    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
