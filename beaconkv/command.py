"""Running a ``beaconkv`` subcommand: user errors as one line, exit code 2, no empty output folders.

Every subcommand's ``run_*(args)`` raises the project's own exceptions for bad input (a missing
path, an unknown policy, an impossible budget...). :func:`run_command` turns them into
``beaconkv <command>: error: <message>`` on stderr and exit status 2 — the traceback only with
``--debug`` — and removes an ``--out`` folder the command created but left empty.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from .distributed.group import TensorParallelError
from .execution import CompileError
from .generation import PromptError
from .models.config import UnsupportedModelError
from .models.loading import CheckpointError
from .policies.config import PolicyConfigError
from .storage import StorageError

#: Exceptions that mean "the input was wrong", reported in one line. A ValueError from a library
#: (a dtype, a sampling parameter) is a user error too; anything else is a bug and shows its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, FileNotFoundError, NotADirectoryError, PermissionError, json.JSONDecodeError, PromptError,
    PolicyConfigError, StorageError, CheckpointError, UnsupportedModelError, CompileError, TensorParallelError,
)


def user_error_types() -> tuple[type[BaseException], ...]:
    """:data:`USER_ERRORS` plus the hub's offline/missing-repo errors when ``huggingface_hub`` is importable."""
    extra: list[type[BaseException]] = []
    try:
        from huggingface_hub import errors as hub_errors

        extra += [getattr(hub_errors, n) for n in ("HfHubHTTPError", "LocalEntryNotFoundError",
                                                   "RepositoryNotFoundError", "OfflineModeIsEnabled")
                  if hasattr(hub_errors, n)]
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        pass
    return (*USER_ERRORS, *extra)


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line too: ``beaconkv <command>: error: <message>``, exit 2.

    argparse prints the usage block before the error; this prints the error alone, with a pointer to
    ``--help``, so that a mistyped option reads like every other user error. Subparsers made with
    ``add_subparsers().add_parser`` are of the same class.
    """

    def error(self, message: str) -> NoReturn:
        """Prints ``<prog>: error: <message> (see '<prog> --help')`` on stderr and exits with status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def add_debug_argument(parser: argparse.ArgumentParser) -> None:
    """``--debug``: show the traceback of a user error too."""
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")


def module_main(name: str, add: Callable[[argparse.ArgumentParser], object],
                run: Callable[[argparse.Namespace], int | None], argv: list[str] | None = None) -> int:
    """``python -m`` entry of one subcommand: its parser (``add``), then :func:`run_command`."""
    parser = CommandParser(prog=f"beaconkv {name}")
    add(parser)
    add_debug_argument(parser)
    return run_command(name, run, parser.parse_args(argv))


def run_command(name: str, run: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Runs ``run(args)``; a user error prints one line and returns 2.

    Args:
        name: The subcommand (for the message).
        run: Its ``run_*`` function.
        args: Parsed arguments (``args.debug`` shows tracebacks; ``args.out``, if any, is the output folder).

    Returns:
        The command's exit status.
    """
    out = getattr(args, "out", None)
    existed = out is None or Path(out).exists()
    try:
        return int(run(args) or 0)
    except user_error_types() as err:
        if getattr(args, "debug", False):
            traceback.print_exc()
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"beaconkv {name}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"beaconkv {name}: interrupted", file=sys.stderr)
        return 130
    finally:
        if not existed and out is not None and Path(out).is_dir() and not any(Path(out).iterdir()):
            Path(out).rmdir()  # a folder this command made and left empty
