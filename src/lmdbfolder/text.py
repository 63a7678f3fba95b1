"""Small helpers for the words of messages and reports (no lmdbfolder imports)."""

from __future__ import annotations

import re
from typing import Any, Mapping

__all__ = ["plural", "megabytes", "escape_field", "printable", "MAX_FIELD", "describe_changes", "skipped_line"]


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``"1 image"``, ``"2 images"``, ``"1,281,167 images"``: ``n`` and the noun in the right number.

    ``many`` is the plural when it is not ``noun + "s"`` (``plural(n, "class", "classes")``).
    """
    return f"{n:,} {noun if n == 1 else (many or noun + 's')}"


def megabytes(n: float) -> str:
    """``"1,234.5 MB"``: a byte count in decimal megabytes, one decimal, as every report prints sizes."""
    return f"{n / 1e6:,.1f} MB"


def disk_size(n: float) -> str:
    """A size on a disk for a message: ``"12.34 GB"`` from 1 GB up, else ``"123.4 MB"``
    (a small disk's room in GB read "0.00 GB free" whatever it held)."""
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else megabytes(n)


_ESCAPES = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}


def escape_field(text: str) -> str:
    r"""``text`` safe for one field of a tab-separated line: backslash, tab, newline
    and carriage return written as ``\\``, ``\t``, ``\n``, ``\r`` (file names may hold them)."""
    if not any(c in text for c in _ESCAPES):
        return text
    return "".join(_ESCAPES.get(c, c) for c in text)


#: The most characters of one value read from a pack that a report prints.
MAX_FIELD = 200
# C0 and C1 controls (ESC starts terminal escape sequences), DEL, the bidirectional
# and invisible formatting characters (they reorder or hide what follows), and lone
# surrogates (undecodable file names, which a UTF-8 terminal cannot print).
_FORMATTING = "\\x7f-\\x9f\\u061c\\u200b-\\u200f\\u2028-\\u202e\\u2060-\\u206f\\ufeff\\ud800-\\udfff"
_UNPRINTABLE = re.compile(f"[\\x00-\\x1f{_FORMATTING}]")
_UNPRINTABLE_LINES = re.compile(f"[\\x00-\\x09\\x0b-\\x1f{_FORMATTING}]")  # newlines kept


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, limit: int | None = MAX_FIELD, *, newlines: bool = False) -> str:
    r"""``text`` safe to print on a terminal: every control character (an escape sequence's
    ESC, a carriage return, bidirectional overrides, lone surrogates) written as a
    ``\xNN`` / ``\uNNNN`` escape, and at most ``limit`` characters (the rest cut and
    counted; None: no limit). Newlines are kept with ``newlines=True`` (a message
    of several lines), else escaped too (one field of one line).

    For everything read from a pack (class names, paths, manifest fields) on its
    way to a terminal: a pack may have been written by anyone.
    """
    text = str(text)
    if limit is not None and len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit:,} more characters)"
    return (_UNPRINTABLE_LINES if newlines else _UNPRINTABLE).sub(_escape, text)


def skipped_line(path: str, reason: str) -> str:
    """The live ``skipped PATH: REASON`` line of a pack: the file name is anyone's, so
    its control characters (an escape sequence, a carriage return) are escaped."""
    return f"skipped {printable(path, 1000)}: {printable(reason)}"


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
            shown = ", ".join(printable(n, 40) for n in names[:3])
            more = f" and {len(names) - 3:,} more" if len(names) > 3 else ""
            classes.append(f"{sign}{plural(len(names), 'class', 'classes')} ({shown}{more})")
    return text + (f"; {'; '.join(classes)}" if classes else "")
