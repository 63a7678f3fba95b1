"""Small helpers for the words of messages and reports (no lmdbfolder imports)."""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["plural", "megabytes", "escape_field", "shown_name", "describe_changes"]


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``"1 image"``, ``"2 images"``, ``"1,281,167 images"``: ``n`` and the noun in the right number.

    ``many`` is the plural when it is not ``noun + "s"`` (``plural(n, "class", "classes")``).
    """
    return f"{n:,} {noun if n == 1 else (many or noun + 's')}"


def megabytes(n: float) -> str:
    """``"1,234.5 MB"``: a byte count in decimal megabytes, one decimal, as every report prints sizes."""
    return f"{n / 1e6:,.1f} MB"


_ESCAPES = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}


def escape_field(text: str) -> str:
    r"""``text`` safe for one field of a tab-separated line: backslash, tab, newline
    and carriage return written as ``\\``, ``\t``, ``\n``, ``\r`` (file names may hold them)."""
    if not any(c in text for c in _ESCAPES):
        return text
    return "".join(_ESCAPES.get(c, c) for c in text)


def shown_name(text: str, limit: int = 40) -> str:
    """A name read from a pack, safe and short for one line of a terminal: escaped as
    ``escape_field`` does, other unprintable characters as ``\\xNN``/``\\uNNNN``, cut at ``limit``."""
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in escape_field(text))
    return out if len(out) <= limit else out[: limit - 3] + "..."


def describe_changes(entry: Mapping[str, Any]) -> str:
    """``+N / -M / ~K; +1 class (name)``: what an update changed (samples added, removed,
    changed; classes added and removed), from a pack history entry."""

    def number(key: str) -> int:
        value = entry.get(key, 0)
        return value if type(value) is int else 0

    text = f"+{number('added'):,} / -{number('removed'):,} / ~{number('changed'):,}"
    classes = []
    for key, sign in (("classes_added", "+"), ("classes_removed", "-")):
        names = entry.get(key)
        if isinstance(names, list) and names:
            shown = ", ".join(shown_name(str(n)) for n in names[:3])
            more = f" and {len(names) - 3:,} more" if len(names) > 3 else ""
            classes.append(f"{sign}{plural(len(names), 'class', 'classes')} ({shown}{more})")
    return text + (f"; {'; '.join(classes)}" if classes else "")
