"""Answer extraction: the final answer a model wrote, pulled out of its whole response.

* math: the content of the *last* ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched with nesting;
* multiple choice (GPQA): the letter of the last ``Answer: X`` / ``answer is X`` / ``\\boxed{X}``, a
  final line holding only a letter as the fallback.

Extraction only reads text: it knows nothing of problems or references, so both the loaders (a math
data set whose answer column is missing falls back to its solution's last box) and the graders
build on it. Code answers (the last fenced block) are extracted by
:func:`beaconkv.eval.code_grading.extract_code`.
"""

from __future__ import annotations

import re

__all__ = ["extract_choice_letter", "extract_last_boxed", "strip_text_commands"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")

_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")


def strip_text_commands(text: str) -> str:
    """Replace LaTeX text commands by their argument: ``\\text{Evelyn}`` -> ``Evelyn``.

    Handles ``\\text``, ``\\textbf``, ``\\textit``, ``\\mathrm``, ``\\mathbf``, ``\\mbox`` and
    ``\\operatorname`` with an argument free of braces.

    Args:
        text: LaTeX text, e.g. a boxed answer.

    Returns:
        The text with those commands unwrapped.
    """
    return _TEXT_CMD_RE.sub(r"\1", text)


def extract_last_boxed(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``.

    Braces nest (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); escaped braces ``\\{``/``\\}`` do not
    count. ``\\boxed 5`` (no braces) gives ``5``. If the last box is not closed (a truncated
    response), the result is ``None`` rather than an earlier box: the final answer was not given.

    Args:
        text: A model response.

    Returns:
        The stripped content of the last box, or ``None`` if there is no complete box.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd_end = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    i = cmd_end
    n = len(text)
    while i < n and text[i] in " \t":
        i += 1
    if i >= n:
        return None
    if text[i] != "{":
        # `\boxed 5`: the argument runs to the next whitespace, `$` or end.
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m and i > cmd_end else None
    depth = 0
    j = i
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2  # skip the escaped character, e.g. \{ or \}
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
        j += 1
    return None


def extract_choice_letter(response: str, letters: str = "ABCD") -> str | None:
    """Extract the chosen letter of a multiple choice response.

    Looks for ``Answer: X`` (also bold, ``$X$``, ``(X)``), ``answer is X`` and ``\\boxed{X}``
    (also ``\\boxed{\\text{(X)}}``) and returns the letter of the match that ends last. If none
    matches, a last non-empty line holding only a letter (``C``, ``(C)``, ``**C**``) is accepted.

    Args:
        response: The model's output.
        letters: The valid letters, e.g. ``"ABCD"``.

    Returns:
        The upper-case letter, or ``None`` if no valid letter is found.
    """
    cls = f"[{re.escape(letters)}]"
    patterns = [
        rf"(?i:answer)\s*(?:\*\*)?\s*[:：]\s*(?:\*\*)?\s*\$?\(?\s*({cls})\s*\)?\$?(?![A-Za-z])",
        rf"(?i:answer\s+is)\s*:?\s*(?:\*\*)?\s*(?:option\s+|choice\s+)?\$?\(?\s*({cls})\s*\)?\$?(?![A-Za-z])",
    ]
    best: tuple[int, str] | None = None
    for pattern in patterns:
        for m in re.finditer(pattern, response):
            if best is None or m.end() > best[0]:
                best = (m.end(), m.group(1))
    box = extract_last_boxed(response)
    if box is not None:
        inner = strip_text_commands(box).strip().strip("()").strip()
        if len(inner) == 1 and inner in letters:
            end = response.rfind(box) + len(box)
            if best is None or end > best[0]:
                best = (end, inner)
    if best is not None:
        return best[1]
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    if lines:
        m = re.fullmatch(rf"[*_]*\(?({cls})\)?[*_]*\.?", lines[-1])
        if m:
            return m.group(1)
    return None
