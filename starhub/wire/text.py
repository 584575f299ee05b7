"""A peer's free text as this side shows it: the names in cards (and in the reports built
from them) reach logs, status lines and terminals, so each is made printable and short once,
where it is decoded."""

from __future__ import annotations

MAX_NAME = 64
"""Characters of a name kept for display."""
CUT = "..."


def printable(text: str, limit: int = MAX_NAME) -> str:
    """``text`` with each character that is not printable (newlines, ANSI escape sequences'
    ESC, other control and format characters) replaced by ``?``, and cut to ``limit``
    characters, the cut marked with ``...``."""
    if len(text) <= limit and text.isprintable():
        return text
    clean = "".join(c if c.isprintable() else "?" for c in text[:limit + 1])
    return clean if len(clean) <= limit else clean[:limit - len(CUT)] + CUT
