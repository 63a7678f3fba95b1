"""Exceptions raised by lmdbfolder.

Every error names the file, pack or sample it is about, says what was found
and what was expected, and carries a ``hint``: what the user can do next.
The CLI prints ``str(error)`` (which includes the hint) and maps each class to
an exit code, so these messages are the user interface for failures.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "LmdbFolderError",
    "NotAPackError",
    "FormatVersionError",
    "CorruptRecordError",
    "SourceError",
    "ListFileError",
    "UnsafePickleError",
    "OutputExistsError",
    "DecodeError",
    "PackError",
    "DecoderUnavailableError",
    "OptionError",
]


class LmdbFolderError(Exception):
    """Base class of every lmdbfolder error. ``hint`` says what to try."""

    hint: str = ""

    def __init__(self, message: str, hint: str | None = None) -> None:
        if hint is not None:
            self.hint = hint
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # The subclasses take structured arguments, so the default
        # ``cls(*args)`` cannot rebuild them; rebuild from the attributes instead.
        # Errors cross process boundaries (Ray tasks, DataLoader workers) pickled.
        return (_rebuild_error, (type(self), self.__dict__.copy()))


def _rebuild_error(cls: type[LmdbFolderError], state: dict[str, Any]) -> LmdbFolderError:
    """Unpickle an lmdbfolder error without calling its ``__init__``."""
    error = cls.__new__(cls)
    Exception.__init__(error, state.get("message", ""))
    error.__dict__.update(state)
    return error


class NotAPackError(LmdbFolderError):
    """The path is not a (finished) lmdbfolder pack."""

    hint = "pass the directory written by `lmdbfolder pack` (it holds data.mdb)"

    def __init__(self, path: Any, why: str, hint: str | None = None) -> None:
        self.path = str(path)
        super().__init__(f"{self.path} is not an lmdbfolder pack: {why}", hint)


class FormatVersionError(NotAPackError):
    """The pack was written in a format version this reader does not know."""

    def __init__(self, path: Any, found: Any, expected: int, readable: tuple[int, ...] | None = None) -> None:
        self.found = found if isinstance(found, (int, str, type(None))) else type(found).__name__
        self.expected = expected
        if isinstance(found, int) and found > expected:
            hint = "it was written by a newer lmdbfolder: upgrade with `pip install -U lmdbfolder`"
        else:
            hint = "repack it from the source images with this version of lmdbfolder"
        shown = repr(self.found) if len(repr(self.found)) <= 40 else repr(self.found)[:37] + "..."
        versions = (
            f"version {expected}"
            if not readable or len(readable) == 1
            else "versions " + ", ".join(map(str, readable[:-1])) + f" and {readable[-1]}"
        )
        super().__init__(path, f"format version {shown}, this lmdbfolder reads {versions}", hint)


class CorruptRecordError(LmdbFolderError):
    """A stored record is damaged (bad header, length or checksum).

    ``kind`` is ``"checksum"`` for a CRC mismatch and ``"header"`` otherwise.
    """

    hint = "run `lmdbfolder verify` on the pack to list every damaged record, then repack"

    def __init__(
        self, index: int | None, why: str, path: str | None = None, pack: str | None = None, *, kind: str = "header"
    ) -> None:
        self.index = index
        self.path = path
        self.pack = pack
        self.why = why
        self.kind = kind
        super().__init__(self._describe())

    def _describe(self) -> str:
        where = "record" if self.index is None else f"record {self.index}"
        if self.path is not None:
            where += f" ({self.path})"
        if self.pack is not None:
            where += f" in {self.pack}"
        return f"{where} is corrupt: {self.why}"

    def locate(self, path: str | None, pack: str | None) -> CorruptRecordError:
        """Fill in the original file path and the pack, once the caller knows them."""
        self.path, self.pack = path, pack
        self.message = self._describe()
        self.args = (self.message,)
        return self


class SourceError(LmdbFolderError):
    """The source images cannot be used as given (missing, unreadable, empty)."""

    def __init__(self, path: Any, why: str, hint: str | None = None) -> None:
        self.path = str(path)
        super().__init__(f"{self.path}: {why}", hint)


class ListFileError(SourceError):
    """A line of a ``path label`` list file cannot be parsed."""

    hint = "each line must be `relative/path label` with an integer label; blank lines and # comments are allowed"

    def __init__(self, path: Any, lineno: int, line: str, why: str) -> None:
        self.lineno = lineno
        self.line = line
        super().__init__(f"{path}:{lineno}", f"{why}: {line!r}")


class UnsafePickleError(SourceError):
    """A pickle (in a recipe LMDB being imported) asked for more than plain data."""

    hint = (
        "lmdbfolder reads only pickles of plain tuples/lists/dicts/str/bytes/numbers, so opening a file "
        "never runs code from it; re-export the data without custom classes or numpy arrays, "
        "or repack from the source images"
    )


class OutputExistsError(LmdbFolderError):
    """The output path exists and overwriting was not requested."""

    hint = "choose another output path, or pass --overwrite (overwrite=True) to replace it"

    def __init__(self, path: Any, why: str = "already exists", hint: str | None = None) -> None:
        self.path = str(path)
        super().__init__(f"{self.path} {why}", hint)


class DecodeError(LmdbFolderError):
    """A stored image could not be decoded."""

    hint = "run `lmdbfolder verify --decode` to find every undecodable image; repack with a fixed source file"

    def __init__(self, index: int, path: str | None, why: str) -> None:
        self.index = index
        self.path = path
        where = f"record {index}" + (f" ({path})" if path else "")
        super().__init__(f"{where} cannot be decoded: {why}")


class PackError(LmdbFolderError):
    """Packing stopped (for example the disk is full); the partial output is kept."""


class DecoderUnavailableError(LmdbFolderError, ValueError):
    """The requested image decoder is not installed (or cannot load its library)."""

    def __init__(self, name: str, why: str, hint: str | None = None) -> None:
        self.name = name
        self.why = why
        super().__init__(
            f"decoder {name!r} is not available: {why}",
            hint
            or "choose another decoder (decoder='pillow' always works, decoder='auto' picks the fastest installed)",
        )


class OptionError(LmdbFolderError, ValueError):
    """An option has a value it cannot take (the command line reports it as a usage error)."""

    hint = "see `lmdbfolder COMMAND --help` (or the function's docstring) for the allowed values"
