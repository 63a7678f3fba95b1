"""What every ``lmdbfolder`` command shares: the parser class, the exit codes and
the one error path, JSON output, the output flags and the argument types.

A command module (``lmdbfolder.cli.pack``, ...) only adds its parser and prints
its result; every error it raises reaches the user through ``run_command``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import sys
from typing import Any, Callable

from lmdbfolder.errors import (
    LmdbFolderError,
    MissingDependencyError,
    NotAPackError,
    OptionError,
    OutputExistsError,
    PackError,
    RemoteError,
    SourceError,
    os_refusal,
)
from lmdbfolder.text import printable

__all__ = [
    "EXIT_CODES",
    "Parser",
    "run_command",
    "usage",
    "print_json",
    "add_output_flags",
    "show_progress",
    "nothing_to_do",
    "positive_int",
    "count",
    "quality",
]

#: The commands that write a pack or files: the system refusing a write ends them
#: with "pack failed" (6), others with "other error" (7).
WRITING_COMMANDS = frozenset({"pack", "import", "copy", "export", "index"})
#: The most characters of an error message printed (a path read from a pack may be huge).
MAX_MESSAGE = 4000
#: Exit status of each outcome; documented in docs/cli.md ("Exit codes").
EXIT_CODES = {
    "ok": 0,
    "problems found": 1,
    "usage": 2,
    "not a pack": 3,
    "output exists": 4,
    "source error": 5,
    "pack failed": 6,
    "other error": 7,
    "missing dependency": 8,
    "storage error": 9,
    "interrupted": 130,
}


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and a hint (not the whole usage), exit code 2."""

    def error(self, message: str) -> Any:  # argparse's signature says NoReturn
        self.exit(EXIT_CODES["usage"], f"{self.prog}: error: {message}\n  hint: see `{self.prog} --help`\n")


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command ``args.run(args)``; turn every lmdbfolder error, Ctrl-C
    (and SIGTERM) and a closed pipe into one message on stderr and an exit code."""
    run: Callable[[argparse.Namespace], int] = args.run
    previous = _terminate_as_interrupt()
    stdout = sys.stdout
    errors = _escape_unencodable(stdout)
    try:
        return run(args)
    # Before OSError: some of ours are OSErrors too (DecodeError, CorruptRecordError,
    # the FileNotFoundErrors), and their own message and exit code say more.
    except LmdbFolderError as exc:
        text = exc.text(cli=True).replace("`lmdbfolder COMMAND ", f"`lmdbfolder {args.command} ")
        # Messages name paths and values read from packs (anyone's): no control sequences, bounded.
        text = printable(text, MAX_MESSAGE, newlines=True)
        print(f"lmdbfolder {args.command}: error: {text}", file=sys.stderr)
        return _exit_code(exc)
    except OSError as exc:
        if isinstance(exc, BrokenPipeError) and _reader_gone(sys.stdout):
            # Output piped into `head` and the like: not an error of ours.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 0
        # The system said no (a full disk, a read-only folder, ...) where no lmdbfolder
        # error says more: one message naming the path, never a traceback.
        message, hint = os_refusal(exc, "the system refused:")
        text = printable(f"{message}\n  hint: {hint}", MAX_MESSAGE, newlines=True)
        print(f"lmdbfolder {args.command}: error: {text}", file=sys.stderr)
        return EXIT_CODES["pack failed"] if args.command in WRITING_COMMANDS else EXIT_CODES["other error"]
    except KeyboardInterrupt:
        hint = "; run the same command again to resume" if _resumes(args) else ""
        print(f"lmdbfolder {args.command}: interrupted{hint}", file=sys.stderr)
        return EXIT_CODES["interrupted"]
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if errors is not None:
            stdout.reconfigure(errors=errors)  # type: ignore[union-attr]


def _escape_unencodable(stream: Any) -> str | None:
    """Let ``stream`` write what its encoding cannot as ``\\udcff`` escapes; return its
    previous error handler to restore (None when unchanged).

    A file name that is not UTF-8 is a str with lone surrogates (``os.fsdecode``),
    and a strict stdout (a UTF-8 locale) raised UnicodeEncodeError on it in a
    summary line, after the work was done."""
    errors = getattr(stream, "errors", None)
    if errors != "strict" or not hasattr(stream, "reconfigure"):
        return None
    try:
        stream.reconfigure(errors="backslashreplace")
    except (AttributeError, ValueError, OSError):  # a stream that cannot change
        return None
    return "strict"


def _resumes(args: argparse.Namespace) -> bool:
    """Whether running the interrupted command again resumes it: a pack, and a
    download (its parts are journaled in ``DST.copying``)."""
    if args.command == "pack":
        return True
    if args.command == "copy":
        from lmdbfolder.remote import is_url

        return is_url(args.src) and not is_url(args.dst)
    return False


def _reader_gone(stream: Any) -> bool:
    """Whether ``stream`` is a pipe whose reading end was closed (poll says POLLERR), so that a
    broken pipe of our own (a reader process, a connection) is never taken for ``| head``."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no file descriptor
        return True


def _exit_code(exc: LmdbFolderError) -> int:
    if isinstance(exc, MissingDependencyError):
        return EXIT_CODES["missing dependency"]
    if isinstance(exc, OptionError):
        return EXIT_CODES["usage"]
    if isinstance(exc, NotAPackError):
        return EXIT_CODES["not a pack"]
    if isinstance(exc, OutputExistsError):
        return EXIT_CODES["output exists"]
    if isinstance(exc, SourceError):
        return EXIT_CODES["source error"]
    if isinstance(exc, PackError):
        return EXIT_CODES["pack failed"]
    if isinstance(exc, RemoteError):
        return EXIT_CODES["storage error"]
    return EXIT_CODES["other error"]


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _terminate_as_interrupt() -> Any:
    """Treat SIGTERM like Ctrl-C (only possible in the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:
        return None


def usage(command: str, message: str) -> int:
    """Print a usage error of ``lmdbfolder COMMAND`` found after parsing (one line and a hint); return 2."""
    print(f"lmdbfolder {command}: error: {message}\n  hint: see `lmdbfolder {command} --help`", file=sys.stderr)
    return EXIT_CODES["usage"]


def print_json(obj: Any) -> None:
    """``--json`` output: ``obj`` on stdout, indented, non-ASCII kept.

    A file name that is not UTF-8 is a str with lone surrogates (``os.fsdecode``):
    those are written as JSON ``\\udcXX`` escapes, so the output is UTF-8 whatever the
    locale, and ``os.fsencode(json.loads(...))`` gives the name's bytes back.
    """
    text = json.dumps(obj, indent=2, ensure_ascii=False, default=str)
    sys.stdout.write(_SURROGATE.sub(lambda m: f"\\u{ord(m.group(0)):04x}", text) + "\n")


_SURROGATE = re.compile("[\\ud800-\\udfff]")


def add_output_flags(p: argparse.ArgumentParser, json_help: str) -> None:
    """``--no-progress`` and ``--json``, for the commands that draw a progress bar."""
    p.add_argument("--no-progress", action="store_true", help="do not draw a progress bar")
    p.add_argument("--json", action="store_true", help=json_help)


def show_progress(args: argparse.Namespace) -> bool | None:
    """No bar with --no-progress or --json; otherwise a bar on a terminal."""
    return False if args.no_progress or args.json else None


def nothing_to_do(path: str, what: str) -> str:
    """The message of a pack (or import) that finds its output already complete."""
    return (
        f"{path} is already packed from this source with these options: nothing to do ({what}; "
        "--overwrite packs it again)"
    )


def _whole_number(text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    if high is not None and value > high:
        raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argument type: a whole number of at least 1."""
    return _whole_number(text, 1)


def count(text: str) -> int:
    """A whole number of at least 0 (DataLoader workers, limits where 0 means all)."""
    return _whole_number(text, 0)


def quality(text: str) -> int:
    """An argument type: a JPEG/WebP quality, 1..100."""
    return _whole_number(text, 1, 100)
