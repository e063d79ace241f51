"""The size of the package's rooms (issue #41): no file in ``beaconkv/`` over 600 lines, no class over 400.

A file or class past these limits does more than one job; split it on its seams (see the house style). Every
offender is listed by path and line, so one run shows all of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import beaconkv

PACKAGE = Path(beaconkv.__file__).resolve().parent
ROOT = PACKAGE.parent
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 400


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _long_classes(path: Path) -> list[tuple[int, str, int]]:
    """``(line, qualified name, lines)`` of each class of ``path`` (nested ones too) over the limit."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
                length = child.end_lineno - child.lineno + 1
                if length > MAX_CLASS_LINES:
                    found.append((child.lineno, name, length))
                name += "."
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}.<locals>."
            visit(child, name)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "")
    return found


def test_the_package_has_sources_to_check() -> None:
    sources = _sources()
    assert len(sources) > 100 and PACKAGE / "session.py" in sources


def test_no_file_in_the_package_is_over_600_lines() -> None:
    long_files = [
        f"{path.relative_to(ROOT)}:1: {lines} lines (limit {MAX_FILE_LINES})"
        for path in _sources() if (lines := _line_count(path)) > MAX_FILE_LINES
    ]
    assert not long_files, "files over the limit, split them on their seams:\n  " + "\n  ".join(long_files)


def test_no_class_in_the_package_is_over_400_lines() -> None:
    long_classes = [
        f"{path.relative_to(ROOT)}:{line}: class {name}, {length} lines (limit {MAX_CLASS_LINES})"
        for path in _sources() for line, name, length in _long_classes(path)
    ]
    assert not long_classes, "classes over the limit, split them:\n  " + "\n  ".join(long_classes)


def test_the_limits_catch_what_they_should(tmp_path: Path) -> None:
    source = tmp_path / "big.py"
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_CLASS_LINES))
    source.write_text(f"class Small:\n    a = 1\n\n\ndef f():\n    class Big:\n{body}\n")
    assert _long_classes(source) == [(6, "f.<locals>.Big", MAX_CLASS_LINES + 1)]
    assert _line_count(source) == MAX_CLASS_LINES + 6
