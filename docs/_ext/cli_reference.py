"""A mkdocs hook that writes the command-line reference from the real argument parser.

``docs/cli.md`` holds the page's introduction and a ``<!-- cli-reference -->`` marker; at build
time this hook replaces the marker with ``beaconkv --help`` and the ``--help`` of every
subcommand, rendered from :func:`beaconkv.cli.build_parser` — so a new subcommand or option shows
up in the reference by itself and the page can never go stale. Loaded through ``hooks:`` in
``mkdocs.yml``; ``tests/test_docs.py`` checks the built page against the parser.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from beaconkv.cli import build_parser

#: The line of ``docs/cli.md`` the reference replaces.
MARKER = "<!-- cli-reference -->"
#: Columns the help is wrapped to (argparse reads ``$COLUMNS``), whatever the terminal of the build.
WIDTH = 100


@contextmanager
def _columns(width: int) -> Iterator[None]:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, one-line help, parser)`` of every subcommand of ``parser``, in the order they were added."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help or "" for a in action._choices_actions}
    return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]


def render_cli_reference(width: int = WIDTH) -> str:
    """The Markdown of the reference: a table of the subcommands, then every ``--help``, as text blocks."""
    parser = build_parser()
    commands = subcommands(parser)
    with _columns(width):
        out = ["| command | what it does |", "|---|---|"]
        out += [f"| [`beaconkv {name}`](#beaconkv-{name}) | {help_} |" for name, help_, _ in commands]
        out += ["", "## `beaconkv`", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, help_, sub in commands:
            out += [f"## `beaconkv {name}` {{#beaconkv-{name}}}", "", f"{help_[:1].upper()}{help_[1:]}.", "",
                    "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs event: fills the marker of the CLI page (other pages pass through unchanged)."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render_cli_reference())
