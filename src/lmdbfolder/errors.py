"""Exceptions raised by lmdbfolder.

Every error names the file, pack or sample it is about, says what was found
and what was expected, and carries a ``hint``: what the user can do next.
These messages are the user interface for failures, read in two places:

* the command line prints ``error.text(cli=True)``: options are named by
  their flags (``--overwrite``), as the messages are written;
* Python code sees ``str(error)``: the same text with each flag outside a
  backquoted shell command rewritten to the keyword argument that does the
  same (``overwrite=True``), so one message never mixes the two
  (``PYTHON_FORMS``).

The CLI maps each class to an exit code.

Where ImageFolder raises a built-in error for the same situation, ours is that
error too, so code written for ImageFolder catches it: a pack that is not there
is a ``FileNotFoundError`` (``PackNotFoundError``, ``NoSamplesError``,
``SourceNotFoundError``), and a sample that cannot be read is an ``OSError``
(``DecodeError``, ``CorruptRecordError``), as Pillow's ``UnidentifiedImageError``
and "image file is truncated" are: ``except OSError`` around a loop, or in a
``__getitem__`` that skips bad images, works unchanged. Their ``errno``,
``strerror`` and ``filename`` are None, as Pillow's are; the text, ``hint``,
``index`` and ``path`` are lmdbfolder's.
"""

from __future__ import annotations

import errno
import re
from typing import Any

from lmdbfolder._version import __version__

__all__ = [
    "LmdbFolderError",
    "NotAPackError",
    "PackNotFoundError",
    "NoSamplesError",
    "FormatVersionError",
    "LossyMaskWarning",
    "PackChangedError",
    "CorruptRecordError",
    "SourceError",
    "SourceNotFoundError",
    "ListFileError",
    "UnsafePickleError",
    "OutputExistsError",
    "DecodeError",
    "FORGED_HINT",
    "BOMB_HINT",
    "PackError",
    "DecoderUnavailableError",
    "OptionError",
    "MissingDependencyError",
    "RemoteError",
    "SkippedFilesWarning",
    "SlowPathWarning",
    "PYTHON_FORMS",
    "python_form",
    "install_hint",
    "os_refusal",
    "os_hint",
]

#: Command-line flags that messages name, and the Python form of each
#: (regular expression on the flag and its value -> replacement). Longer
#: patterns first: ``--max-size N --quality Q --resize-side S`` before ``--max-size``.
PYTHON_FORMS: tuple[tuple[str, str], ...] = (
    (
        r"--max-size (\d+) --quality (\d+) --resize-side (\w+) --format (\w+)",
        r'resize=Resize(\1, \2, "\3", "\4")',
    ),
    (r"--max-size (\d+) --quality (\d+) --resize-side (\w+)", r'resize=Resize(\1, \2, "\3")'),
    (r"--max-size/--quality/--resize-side/--format", "resize"),
    (r"--max-size/--quality/--resize-side", "resize"),
    (r"--max-size (\d+)", r"resize=Resize(\1)"),
    (r"--max-size", "resize"),
    (r"--store (encoded|raw)", r'store="\1"'),
    (r"--check (header|decode|none|content)", r'check="\1"'),
    (r"--workers (\d+)", r"workers=\1"),
    (r"--shards (N|\d+)", r"shards=\1"),
    (r"--shard-index (I|\d+)", r"shard_index=\1"),
    (r"--overwrite", "overwrite=True"),
    (r"--update", "update=True"),
    (r"--restart", "restart=True"),
    (r"--strict", "strict=True"),
    (r"--allow-empty", "allow_empty=True"),
    (r"--no-space-check", "space_check=False"),
    (r"--flat", 'layout="flat"'),
    (r"--extensions", "extensions"),
    (r"--match", "match"),
    (r"--list", "list_file=..."),
    (r"--channel-order", "channel_order"),
    (r"--shard-size", "shard_size"),
    (r"--shard-index", "shard_index"),
    (r"--shards", "shards"),
    (r"--prefix", "prefix"),
    (r"--staging", "staging"),
    (r"--store", "store"),
    (r"--check", "check"),
    (r"--workers", "workers"),
    (r"--quality", "quality"),
    (r"--resize-side", "resize side"),
)
_FLAG = re.compile("|".join(f"(?:{pattern})(?![\\w-])" for pattern, _ in PYTHON_FORMS))
_COMPILED = [(re.compile(f"^(?:{pattern})$"), replacement) for pattern, replacement in PYTHON_FORMS]


def python_form(text: str) -> str:
    """``text`` with every command-line flag outside backquotes replaced by its
    Python keyword (``pass --overwrite`` -> ``pass overwrite=True``).

    A backquoted command (`` `lmdbfolder index DST --prefix P` ``) is a shell
    command in either context, so it is left alone.
    """

    def replace(match: re.Match[str]) -> str:
        flag = match.group(0)
        for pattern, replacement in _COMPILED:
            if pattern.match(flag):
                return pattern.sub(replacement, flag)
        return flag  # pragma: no cover - every alternative of _FLAG is in _COMPILED

    parts = text.split("`")
    for k in range(0, len(parts), 2):  # even parts are outside backquotes
        parts[k] = _FLAG.sub(replace, parts[k])
    return "`".join(parts)


def install_hint(extra: str, what: str | None = None) -> str:
    """How to install lmdbfolder's optional ``extra`` (``"torch"``, ``"ray"``, ``"fast"``, ...).

    lmdbfolder is not on a package index yet: it is installed from a checkout
    of its source or from a built wheel. The requirement is double-quoted, so
    the brackets survive zsh. ``what`` names the libraries (default: the extra).
    """
    return (
        f'install {what or extra}: `pip install ".[{extra}]"` in the lmdbfolder source folder, or '
        f'`pip install "lmdbfolder[{extra}] @ file:///path/to/lmdbfolder-{__version__}-py3-none-any.whl"` '
        "from a built wheel"
    )


class _FromText(type):
    """The metaclass of lmdbfolder's errors: ``SomeError(message=text)`` makes one from its
    whole text alone, whatever arguments the class takes otherwise.

    torch's DataLoader re-raises an error from a worker process in the main process as
    a new one of its type, ``type(error)(message=text)`` when the class has a
    ``message`` attribute (else ``type(error)(text)``), and as a RuntimeError when that
    fails. The errors here take structured arguments (a record's index and path, ...),
    so without this every one of them arrived as a RuntimeError, and ``except
    DecodeError`` around a loop with ``num_workers > 0`` caught nothing, where
    ImageFolder's errors keep their type. Made so, an error holds torch's text (which
    names the worker, the record and the hint); its structured attributes read as the
    class's defaults (None or empty: ``error.index``, ``error.kind``, ... never raise).
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not args and len(kwargs) == 1 and isinstance(kwargs.get("message"), str):
            error = cls.__new__(cls)  # type: ignore[call-overload]
            Exception.__init__(error, kwargs["message"])
            error.message = kwargs["message"]
            error.hint = ""  # the text already ends with it
            return error
        return super().__call__(*args, **kwargs)


class LmdbFolderError(Exception, metaclass=_FromText):
    """Base class of every lmdbfolder error. ``hint`` says what to try.

    ``SomeError(message=text)`` makes any of them from a whole text (see ``_FromText``).
    """

    hint: str = ""
    #: The message (set on each error). The class has one too: that is how torch's
    #: DataLoader knows to re-raise a worker's error as ``type(error)(message=text)``.
    message: str = "(the message of an lmdbfolder error)"

    def __init__(self, message: str, hint: str | None = None) -> None:
        if hint is not None:
            self.hint = hint
        self.message = message
        super().__init__(message)

    def text(self, *, cli: bool = False) -> str:
        """The message and the hint; options named as command-line flags (``cli=True``,
        what ``lmdbfolder`` prints) or as Python keywords (``str(error)``)."""
        full = f"{self.message}\n  hint: {self.hint}" if self.hint else self.message
        return full if cli else python_form(full)

    def __str__(self) -> str:
        return self.text()

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
    #: The pack's path ("" in an error rebuilt from a worker's text: see ``_FromText``).
    path: str = ""
    #: What is wrong, without the path (``verify`` lists it as a problem of the pack);
    #: "" in an error rebuilt from a worker's text.
    why: str = ""

    def __init__(self, path: Any, why: str, hint: str | None = None) -> None:
        self.path = str(path)
        self.why = why
        super().__init__(f"{self.path} is not an lmdbfolder pack: {why}", hint)


def _not_found(error: OSError, filename: str) -> None:
    # The OSError fields that code catching FileNotFoundError reads.
    error.errno = errno.ENOENT
    error.strerror = "No such file or directory"
    error.filename = filename


def _rebuild_not_found(cls: type[LmdbFolderError], state: dict[str, Any], filename: str) -> LmdbFolderError:
    """Unpickle an lmdbfolder error that is also a FileNotFoundError (errno and filename are not in ``__dict__``)."""
    error = _rebuild_error(cls, state)
    if isinstance(error, OSError):
        _not_found(error, filename)
    return error


class PackNotFoundError(NotAPackError, FileNotFoundError):
    """There is no pack at the path: nothing at all, or a directory without ``data.mdb``/``index.json``.

    Also a ``FileNotFoundError`` (``errno.ENOENT``, ``filename`` is the path), which is what
    ``ImageFolder`` raises for a root without class folders, so code written for it
    (``except FileNotFoundError``) handles this too.
    """

    def __init__(self, path: Any, why: str, hint: str | None = None) -> None:
        super().__init__(path, why, hint)
        _not_found(self, self.path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_not_found, (type(self), self.__dict__.copy(), self.path))


class NoSamplesError(LmdbFolderError, FileNotFoundError):
    """Classes without a sample after filtering a pack at read time (``LMDBFolder(extensions=...,
    is_valid_file=..., find_classes override)``), where ImageFolder raises FileNotFoundError too.

    ``classes`` names them; ``where`` is the pack.
    """

    hint = "pass allow_empty=True to keep classes without samples, or change the filter"
    where: str = ""
    classes: list[str] = []  # noqa: RUF012 (read only: an error rebuilt from text has none)

    def __init__(self, where: str, classes: list[str], why: str, hint: str | None = None) -> None:
        self.where = where
        self.classes = list(classes)
        super().__init__(f"{where}: {why}", hint)
        _not_found(self, where)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_not_found, (type(self), self.__dict__.copy(), self.where))


class FormatVersionError(NotAPackError):
    """The pack was written in a format version this reader does not know."""

    found: int | str | None = None
    expected: int = 0

    def __init__(self, path: Any, found: Any, expected: int, readable: tuple[int, ...] | None = None) -> None:
        self.found = found if isinstance(found, (int, str, type(None))) else type(found).__name__
        self.expected = expected
        if isinstance(found, int) and found > expected:
            hint = (
                "it was written by a newer lmdbfolder: upgrade (`pip install -U .` in an updated source "
                "folder, or install a newer wheel)"
            )
        else:
            hint = "repack it from the source images with this version of lmdbfolder"
        shown = repr(self.found) if len(repr(self.found)) <= 40 else repr(self.found)[:37] + "..."
        versions = (
            f"version {expected}"
            if not readable or len(readable) == 1
            else "versions " + ", ".join(map(str, readable[:-1])) + f" and {readable[-1]}"
        )
        super().__init__(path, f"format version {shown}, this lmdbfolder reads {versions}", hint)


class PackChangedError(NotAPackError):
    """The pack a dataset opened has been replaced or updated since (``pack --overwrite``,
    ``pack --update``, a new copy): reading on would mix samples of two versions."""

    hint = (
        "open the pack again (create the dataset and its DataLoader anew) to read the new version; "
        "a training job does this between epochs"
    )

    def __init__(self, path: Any, why: str, hint: str | None = None) -> None:
        self.path = str(path)
        self.why = why
        LmdbFolderError.__init__(self, f"{self.path} {why}", hint)


class CorruptRecordError(LmdbFolderError, OSError):
    """A stored record is damaged (bad header, length or checksum).

    ``kind`` is ``"checksum"`` for a CRC mismatch, ``"page"`` when the database is
    damaged where the record is stored, and ``"header"`` otherwise.

    Also an ``OSError`` (``errno`` None), as ImageFolder's error for a file it cannot
    read is: code that skips bad images with ``except OSError`` skips this record too.
    """

    hint = "run `lmdbfolder verify` on the pack to list every damaged record, then repack"
    index: int | None = None
    path: str | None = None
    pack: str | None = None
    why: str = ""
    kind: str = "header"

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

    path: str = ""

    def __init__(self, path: Any, why: str, hint: str | None = None) -> None:
        self.path = str(path)
        super().__init__(f"{self.path}: {why}", hint)


class SourceNotFoundError(SourceError, FileNotFoundError):
    """No images where the source should have them: the folder does not exist, holds
    no class folder, or a class folder (or a flat folder) holds no image.

    Also a ``FileNotFoundError`` (``errno.ENOENT``, ``filename`` is the folder), as
    torchvision's ``ImageFolder`` raises for the same tree, with its words for an
    empty class ("Found no valid file for the classes ...").
    """

    def __init__(self, path: Any, why: str, hint: str | None = None) -> None:
        super().__init__(path, why, hint)
        _not_found(self, self.path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_not_found, (type(self), self.__dict__.copy(), self.path))


class ListFileError(SourceError):
    """A line of a ``path label`` list file cannot be parsed."""

    hint = (
        "each line must be `relative/path label`, the label a class index or a class name, each path once; "
        "blank lines and # comments are allowed"
    )
    lineno: int = 0
    line: str = ""

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

    hint = "choose another output path, or pass --overwrite to replace it"
    path: str = ""

    def __init__(self, path: Any, why: str = "already exists", hint: str | None = None) -> None:
        self.path = str(path)
        super().__init__(f"{self.path} {why}", hint)


class DecodeError(LmdbFolderError, OSError):
    """A stored image could not be decoded.

    Also an ``OSError`` (``errno`` None), as what ImageFolder raises for the same
    file is (Pillow's ``UnidentifiedImageError``, "image file is truncated"): code
    that skips bad images with ``except OSError`` skips this record too.
    """

    hint = "run `lmdbfolder verify --decode` to find every undecodable image; repack with a fixed source file"
    index: int | None = None
    path: str | None = None

    def __init__(self, index: int, path: str | None, why: str, hint: str | None = None) -> None:
        self.index = index
        self.path = path
        where = f"record {index}" + (f" ({path})" if path else "")
        super().__init__(f"{where} cannot be decoded: {why}", hint)


#: The hint of a record whose header its payload contradicts (``encodings.PayloadMismatch``).
FORGED_HINT = (
    "the record's header disagrees with the image it holds: the pack is damaged or was not written by "
    "lmdbfolder; run `lmdbfolder verify` on it, and repack it from the source images"
)
#: The hint of an image over Pillow's decompression-bomb limit (ImageFolder refuses it too).
BOMB_HINT = (
    "ImageFolder refuses this image too (Pillow's PIL.Image.MAX_IMAGE_PIXELS); if you trust the pack, "
    "raise that limit in your program (as for ImageFolder), or repack with --max-size to shrink such images"
)


class PackError(LmdbFolderError):
    """Packing stopped (for example the disk is full); the partial output is kept."""


class DecoderUnavailableError(LmdbFolderError, ValueError):
    """The requested image decoder is not installed (or cannot load its library)."""

    name: str = ""
    why: str = ""

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

    hint = "see the function's docstring for the allowed values"
    #: The default hint on the command line (``lmdbfolder`` fills in the command).
    cli_hint = "see `lmdbfolder COMMAND --help` for the allowed values"

    def text(self, *, cli: bool = False) -> str:
        """As ``LmdbFolderError.text``; the default hint points at ``--help`` on the command line."""
        if cli and self.hint == OptionError.hint:
            return f"{self.message}\n  hint: {self.cli_hint}"
        return super().text(cli=cli)


class MissingDependencyError(LmdbFolderError, ImportError):
    """An optional library that this part of lmdbfolder needs is not installed.

    An ImportError too, so ``except ImportError`` keeps working; the original
    ImportError is its ``__cause__``.
    """

    what: str = ""
    extra: str = ""

    def __init__(self, what: str, extra: str, libraries: str | None = None) -> None:
        self.what = what
        self.extra = extra
        super().__init__(f"{what} needs {libraries or extra} (not installed)", install_hint(extra, libraries))


class RemoteError(LmdbFolderError):
    """Object storage refused or failed a request, or sent bytes that do not match their digest.

    ``url`` names the object or folder; ``kind`` says which failure it was:
    ``"credentials"`` (none found, or refused), ``"bucket"`` (no such
    bucket), ``"missing"`` (no such object), ``"connection"`` (the server did not answer), ``"digest"``
    (the bytes do not match the index), ``"disk"`` (the local disk refused
    them), ``"single"`` (a single pack where a sharded one was asked for) or
    ``"other"``. Callers decide by ``kind``, never by the message. Nothing half-copied is ever published; rerunning
    resumes.
    """

    url: str = ""
    kind: str = "other"

    def __init__(self, url: str, why: str, hint: str | None = None, *, kind: str = "other") -> None:
        self.url = str(url)
        self.kind = kind
        super().__init__(f"{self.url}: {why}", hint)


class SkippedFilesWarning(UserWarning):
    """``lmdbfolder.pack`` skipped source files (unreadable, truncated, not images).

    The message gives the count and where they are listed (``DST/skipped.txt``);
    the result's ``skipped`` holds every ``(path, reason)``. ``--strict`` /
    ``strict=True`` stops at the first one instead.
    """


class LossyMaskWarning(UserWarning):
    """A mask was packed in a lossy encoding (a JPEG, a lossy WebP): its class indices are
    not the ones it was drawn with near every edge. It is stored as it is (its bytes kept);
    the message names the samples. Save masks as PNG."""


class SlowPathWarning(UserWarning):
    """A faster read path is not available in this process (the compiled crop
    decoder was not built): the same pixels, more slowly. Warned once per
    process; ``lmdbfolder doctor`` says what to install."""


#: What to do about each way the operating system says no (``os_refusal``).
_OS_HINTS: dict[int, str] = {
    errno.ENOSPC: "the disk is full: free some space (or choose another disk), then run the same command again",
    errno.EDQUOT: "your disk quota is used up: free some space, then run the same command again",
    errno.EFBIG: "the file is larger than this file system or a limit (ulimit -f) allows: choose another disk",
    errno.EACCES: "you may not do that there: check its permissions (ls -ld), or choose another path",
    errno.EPERM: "you may not do that there: check its permissions (ls -ld), or choose another path",
    errno.EROFS: "that file system is mounted read-only: choose a path on a writable one",
    errno.EISDIR: "a folder is where a file was expected: choose another path, or remove the folder",
    errno.ENOTDIR: "a file is where a folder was expected: check the path",
    # makedirs, when a folder on the way is a file (creating a file that exists, too)
    errno.EEXIST: "a file is already there, where a folder (or a new file) was to be made: check the path",
    errno.ENAMETOOLONG: "the name is longer than this file system allows: choose a shorter path",
    errno.ENOENT: "check the path: a folder on the way may be missing",
}


def os_refusal(exc: OSError, doing: str, path: Any = None) -> tuple[str, str]:
    """``(message, hint)`` for an ``OSError`` the system raised while ``doing`` something
    ("cannot write", "cannot read the folder", ...), naming the path (``path``, else the
    error's own file name) and the reason in words; for the errors that turn disk full,
    permission denied, a read-only file system, a folder or a FIFO into clear ones."""
    where = path if path is not None else (exc.filename if exc.filename is not None else "")
    reason = exc.strerror or str(exc)
    return f"{doing} {where}: {reason}", os_hint(exc)


def os_hint(exc: OSError) -> str:
    """What to do about the system's refusal ``exc`` (see ``os_refusal``)."""
    return _OS_HINTS.get(exc.errno or -1, "check the path, and that the disk is present and healthy")
