"""What every ``offpolicy`` command shares: the typer application the commands register on, the console, and
one-line errors and warnings (a ``ValueError`` or ``OSError`` is ``error: …`` and exit code 2, never a traceback).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

HELP = "``offpolicy`` command line: demo, train, lab, inspect, presets, diagnose."

# Markdown: the docstrings' ``code`` shows as code and their 120-column line breaks are re-flowed to the terminal.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown", help=HELP)


def _quiet_transformers() -> None:
    """No "Loading weights" / "Writing model shards" bars between our own progress lines."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # transformers is a CLI dependency; without it the run fails later with a clear error
        pass


def make_console() -> Console:
    _quiet_transformers()
    # emoji=False: rich would turn ":b:" in user text (task.name=a:b:c) into an emoji; escape() does not stop that
    console = Console(highlight=False, emoji=False)
    if not console.is_terminal:  # logs / CI: rich would wrap the summary table at 80 columns
        console = Console(highlight=False, emoji=False, width=max(console.width, 140))
    return console


def fail(console: Console, message: str) -> NoReturn:
    # escape: messages quote user text (task.name=a:b:c, run.out_dir=runs/[exp1]) that rich would read as markup
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)  # soft_wrap: one line, even in a log
    raise typer.Exit(code=2)


def os_error(err: OSError) -> str:
    """One line naming the path an OSError is about (its default str() may not, and a traceback is worse)."""
    where = f" {str(err.filename)!r}" if err.filename is not None else ""
    return f"cannot write or read{where}: {err.strerror or err}"


@contextlib.contextmanager
def failing(console: Console) -> Iterator[None]:
    """A ``ValueError`` (bad input, a server's :class:`~offpolicy.rollout.http.ServerError`) or an ``OSError`` (a
    path, with :func:`os_error`) raised in the block: :func:`fail` with its one line."""
    try:
        yield
    except ValueError as err:
        fail(console, str(err))
    except OSError as err:
        fail(console, os_error(err))


@contextlib.contextmanager
def warnings_on(console: Console) -> Iterator[None]:
    """Library warnings (a replaced earlier run, a half-written metrics line, …) as one ``warning:`` line each on
    the console, instead of Python's two-line ``file:line: UserWarning`` format."""

    def show(message, category, filename, lineno, file=None, line=None):  # the warnings.showwarning signature
        console.print(f"[yellow]warning:[/yellow] {escape(str(message))}", soft_wrap=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def make_dir(console: Console, path: Path, option: str) -> None:
    """Create an output folder before any work, failing with one line naming the option and the path."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        fail(console, f"{option} {str(path)!r} cannot be created: {err.strerror or err}")
