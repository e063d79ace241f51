"""The documentation site: it builds with ``mkdocs build --strict``, documents every public name,
and the code it shows still runs.

* the build runs the venv's own mkdocs (``sys.executable -m mkdocs``) into a temporary folder;
* every ``python`` block of the narrative pages is executed, page by page and in order (blocks of
  one page share a namespace, as a reader running them one after the other would). A block right
  after an ``<!-- skip -->`` line is not run: keep those for GPU-only code, hub downloads and long
  runs. Tracebacks point at the page's own line numbers;
* every ``beaconkv ...`` command of a ``bash`` block must parse with the real command-line parser
  (tools whose module is not importable are skipped);
* the figure script still draws both figures;
* the command-line reference (``cli.md``) is generated from the real parser, the specification
  page's sections carry the anchors docstrings link to ("SPEC §4"), and docstring examples render
  as code.
"""

from __future__ import annotations

import argparse
import html
import importlib
import inspect
import os
import pkgutil
import re
import runpy
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

import beaconkv

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP_MARK = "<!-- skip -->"
# Narrative pages whose python blocks run. benchmarks.md only shows measured results.
EXECUTED_PAGES = ["index.md", "concepts.md", *sorted(p.relative_to(DOCS).as_posix() for p in DOCS.glob("guides/*.md"))]
# Modules that are entry points, not API.
NOT_API = {"beaconkv.eval.__main__", "beaconkv.measure.fidelity.__main__", "beaconkv.measure.speed.__main__"}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)")


def fenced_blocks(page: Path, lang: str) -> list[tuple[int, str, bool]]:
    """``(first_line, code, skipped)`` of every fenced block of language ``lang`` in ``page``.

    ``first_line`` is the 0-based line index of the block's first code line; ``skipped`` says
    whether an ``<!-- skip -->`` line precedes the opening fence (blank lines in between allowed).
    """
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if m["lang"] == lang:
            body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : j]]
            previous = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            blocks.append((i + 1, "\n".join(body) + "\n", previous == SKIP_MARK))
        i = j + 1
    return blocks


# ------------------------------------------------------------------------------------------ build
@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """Builds the site once with --strict; returns its folder."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(warnings or [proc.stderr[-4000:]])
    return out


def test_mkdocs_build_strict(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "img" / "budget.png").is_file() and (site / "img" / "beacon-lifecycle.png").is_file()


def _public_modules() -> list[str]:
    names = ["beaconkv"]
    names += [m.name for m in pkgutil.walk_packages(beaconkv.__path__, "beaconkv.")]
    return [n for n in names if n not in NOT_API and not any(part.startswith("_") for part in n.split("."))]


def _anchors(site: Path) -> set[str]:
    ids = set()
    for page in site.rglob("*.html"):
        ids.update(html.unescape(i) for i in re.findall(r'\bid="([^"]+)"', page.read_text(encoding="utf-8")))
    return ids


def _public_names(module) -> list[str]:
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name for name, obj in vars(module).items()
        if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__
        and (inspect.isclass(obj) or inspect.isroutine(obj))
    ]


def test_every_public_module_and_name_has_an_api_entry(site: Path) -> None:
    anchors = _anchors(site)
    missing = []
    for mod_name in _public_modules():
        module = importlib.import_module(mod_name)
        if mod_name not in anchors:
            missing.append(f"module {mod_name}: add docs/api/<...>.md with '::: {mod_name}' and list it in mkdocs.yml nav")
            continue
        for name in _public_names(module):
            try:
                obj = getattr(module, name)
            except (AttributeError, ImportError) as err:  # a lazy export whose module is not there
                missing.append(f"{mod_name}.{name} cannot be imported: {err}")
                continue
            if inspect.isclass(obj) or inspect.isroutine(obj):
                target = f"{obj.__module__}.{obj.__qualname__}"
                ok = target in anchors
            else:  # data: documented in its defining module, somewhere under this one
                target = f"{mod_name}.{name}"
                ok = target in anchors or any(a.startswith(mod_name + ".") and a.endswith("." + name) for a in anchors)
            if not ok:
                missing.append(f"{mod_name}.{name} (expected anchor {target!r}: a docstring and an API page)")
    assert not missing, "undocumented public API:\n  " + "\n  ".join(missing)


# ------------------------------------------------------------------------------------------- code
@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.long) if p == "guides/custom-stack.md" else p
                                  for p in EXECUTED_PAGES])
def test_page_code_runs(page: str, tmp_path, monkeypatch, one_thread) -> None:
    blocks = fenced_blocks(DOCS / page, "python")
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    module = types.ModuleType(f"docs_{Path(page).stem.replace('-', '_')}")  # a real module: dataclasses look it up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    ran = 0
    for first_line, code, skipped in blocks:
        if skipped:
            continue
        # pad so that tracebacks show the page's own line numbers; a reader's session has none of this
        # file's __future__ imports, so don't inherit them
        exec(compile("\n" * first_line + code, str(DOCS / page), "exec", dont_inherit=True), namespace)  # noqa: S102
        ran += 1
    if page.startswith("guides/") or page == "index.md":
        assert ran or not blocks, f"every python block of {page} is skipped"


def test_guides_have_executed_code() -> None:
    for page in ("index.md", "guides/custom-stack.md", "guides/custom-policy.md"):
        assert any(not skipped for _, _, skipped in fenced_blocks(DOCS / page, "python")), page


def _cli_commands() -> list:
    """One pytest param per ``beaconkv ...`` command (continuation lines joined) of a bash block."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        name = page.relative_to(DOCS).as_posix()
        for first_line, code, _ in fenced_blocks(page, "bash"):
            commands = [c.strip() for c in code.replace("\\\n", " ").splitlines()]
            for n, command in enumerate(c for c in commands if c.startswith("beaconkv ")):
                found.append(pytest.param(name, first_line + 1, command, id=f"{name}:{first_line + 1}:{n}"))
    return found


@pytest.mark.parametrize("page,line,command", _cli_commands())
def test_cli_commands_in_docs_parse(page: str, line: int, command: str) -> None:
    from beaconkv.cli import build_parser

    argv = shlex.split(command, comments=True)[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse reports the error on stderr; --help exits with 0
        if exit_.code == 0:
            return
        pytest.fail(f"{page} (block at line {line}): `{command}` does not parse (exit {exit_.code})")


# ----------------------------------------------------------------------------------------- figures
def test_figure_script_draws_both_figures(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    script = runpy.run_path(str(DOCS / "figures" / "make_figures.py"), run_name="make_figures")
    paths = script["main"](["--out", str(tmp_path)])
    assert [p.name for p in paths] == ["budget.png", "beacon-lifecycle.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
        assert (DOCS / "img" / p.name).is_file(), f"run python docs/figures/make_figures.py to create docs/img/{p.name}"


# ------------------------------------------------------------------------ generated and linked pages
def _text(fragment: str) -> str:
    """The text of an HTML fragment: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def test_cli_reference_is_generated_from_the_parser(site: Path) -> None:
    from beaconkv.cli import build_parser

    page = (site / "cli" / "index.html").read_text(encoding="utf-8")
    text = _text(page)
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "usage: beaconkv [-h] [--version]" in text
    for name, subparser in sub.choices.items():
        assert f'id="beaconkv-{name}"' in page, f"no section for `beaconkv {name}` in cli.md"
        assert f"usage: beaconkv {name}" in text
        for action in subparser._actions:
            for option in action.option_strings:
                assert option in text, f"`beaconkv {name} {option}` is missing from the CLI reference"
    assert "<!-- cli-reference -->" not in page


def test_spec_page_sections_have_anchors_and_docstrings_link_to_them(site: Path) -> None:
    spec = (site / "spec" / "index.html").read_text(encoding="utf-8")
    expected = ["1-why", "2-terms-and-budget-semantics", "3-farthest-point-sampling", "4-beaconkv-step-by-step",
                "5-baselines", "6-paper-settings", "7-weaknesses", "8-the-embedded-model"]
    assert re.findall(r'<h2 id="(\d-[a-z-]+)"', spec) == expected
    beacon = (site / "api" / "policies" / "beacon" / "index.html").read_text(encoding="utf-8")
    assert re.search(r'href="[./]*spec/#4-beaconkv-step-by-step"[^>]*>\s*SPEC §4', beacon)
    assert "spec.md" in (ROOT / "mkdocs.yml").read_text() and "cli.md" in (ROOT / "mkdocs.yml").read_text()


def test_beaconkv_docstring_example_renders_as_code(site: Path) -> None:
    page = (site / "api" / "policies" / "beacon" / "index.html").read_text(encoding="utf-8")
    blocks = [_text(b) for b in re.findall(r"<pre[^>]*>(.*?)</pre>", page, flags=re.S)]
    assert any("policy = BeaconKV(budget=2048, n_beacon=16, n_recent=16" in b and "beaconkv.generate(" in b
               for b in blocks), "the Example of BeaconKV's docstring is not rendered inside a <pre> code block"
