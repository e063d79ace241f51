"""A griffe extension that turns the Sphinx idioms of beaconkv's docstrings into Markdown.

The package's docstrings are Google style with a few reStructuredText habits that Markdown would
print verbatim:

* cross-reference roles, ``:class:`~beaconkv.models.CausalLM```, ``:meth:`score```,
  ``:func:`generate``` ... become inline code that links to the object's API entry when it can be
  resolved from the docstring's scope (an *optional* autoref: an unresolvable name stays plain
  code instead of failing the strict build);
* a paragraph ending in ``::`` (a reST literal-block marker) ends in ``:`` (the indented block
  that follows is already a Markdown code block);
* a free-form heading line such as ``Invariants:`` directly followed by an indented bullet list
  (Google style, but not a section griffe knows) gets the blank line and dedent Markdown needs to
  render the list as a list;
* a reference to the specification, ``SPEC §4`` (or ``SPEC §3-4``), links to that section of the
  site's ``spec.md`` page. The anchors are read from the page's own ``## N. Title`` headings, and
  the links are required autorefs: a reference to a section that does not exist fails the strict
  build.

Loaded by mkdocstrings through ``extensions:`` in ``mkdocs.yml``; it only rewrites the docstring
text griffe hands to the renderer, never the package's files.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import griffe
from markdown.extensions.toc import slugify

#: The specification page whose sections ``SPEC §N`` references link to.
SPEC_PAGE = Path(__file__).resolve().parents[1] / "spec.md"
_SPEC_HEADING = re.compile(r"^## (?P<number>\d+)\. (?P<title>.+?)\s*$", re.MULTILINE)
_SPEC_REF = re.compile(r"SPEC §(?P<first>\d+)(?:(?P<dash>[-–])(?P<last>\d+))?")

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(?P<tilde>~?)(?P<target>[^`]+)`")
_LITERAL_MARKER = re.compile(r"(?<=\S)::[ \t]*$", re.MULTILINE)
_HEADED_LIST = re.compile(r"^(?P<head>\S[^\n]*:)[ \t]*\n(?P<body>(?:[ \t]+\S[^\n]*\n?)+)", re.MULTILINE)
_BULLET = re.compile(r"^[ \t]+[*-] ")


def _headed_list(match: re.Match) -> str:
    body = match["body"]
    if not _BULLET.match(body):
        return match[0]
    lines = body.splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    dedented = "\n".join(line[indent:] if line[:indent].isspace() else line.lstrip() for line in lines)
    return f"{match['head']}\n\n{dedented}\n"


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """Full path of ``target`` as seen from ``obj``'s scope, or None when it cannot be found."""
    collection = obj.modules_collection
    candidates = []
    head, _, rest = target.partition(".")
    if "." in target:
        candidates.append(target)  # already a full path
    try:
        base = obj.resolve(head)  # members, imports and enclosing scopes
    except Exception:  # noqa: BLE001 - any failure means "not found"
        base = None
    if base:
        candidates.append(f"{base}.{rest}" if rest else base)
    for path in candidates:
        try:
            collection.get_member(path)
        except Exception:  # noqa: BLE001
            continue
        return path
    return None


def spec_anchors(page: Path = SPEC_PAGE) -> dict[str, str]:
    """Section number -> heading anchor of the specification page (``"4"`` -> ``"4-beaconkv-step-by-step"``)."""
    text = page.read_text(encoding="utf-8") if page.is_file() else ""
    return {m["number"]: slugify(f"{m['number']}. {m['title']}", "-") for m in _SPEC_HEADING.finditer(text)}


def _spec_links(text: str, anchors: dict[str, str]) -> str:
    def link(number: str, shown: str) -> str:
        anchor = anchors.get(number, f"spec-section-{number}-does-not-exist")
        return f'<autoref identifier="{anchor}">{shown}</autoref>'

    def ref(match: re.Match) -> str:
        out = link(match["first"], f"SPEC §{match['first']}")
        if match["last"]:
            out += match["dash"] + link(match["last"], match["last"])
        return out

    return _SPEC_REF.sub(ref, text)


def _rewrite(obj: griffe.Object, text: str) -> str:
    def role(match: re.Match) -> str:
        target = match["target"].strip().removesuffix("()")
        shown = target.rsplit(".", 1)[-1] if match["tilde"] else target
        code = f"<code>{html.escape(shown)}</code>"
        path = _resolve(obj, target)
        if path is None:
            return f"`{shown}`"
        return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'

    text = _HEADED_LIST.sub(_headed_list, _LITERAL_MARKER.sub(":", _ROLE.sub(role, text)))
    return _spec_links(text, _ANCHORS) if "SPEC §" in text else text


_ANCHORS = spec_anchors()


class SphinxRoles(griffe.Extension):
    """Rewrites reST roles and ``::`` markers in every docstring of a loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Walks the package once it is fully loaded (so every name can be resolved)."""
        self._walk(pkg, seen=set())

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = _rewrite(obj, obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, seen)
