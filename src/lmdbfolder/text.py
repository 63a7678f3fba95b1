"""Small helpers for the words of messages and reports (no lmdbfolder imports)."""

from __future__ import annotations

__all__ = ["plural", "megabytes", "escape_field"]


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
