"""The ``lmdbfolder`` command line: pack, info, verify, show, export, import, index, copy, bench, warm, demo, doctor.

``main(argv) -> int`` is the whole interface: it parses, runs one subcommand
and turns every lmdbfolder error into one message on stderr and an exit code
(see EXIT_CODES). Usage errors (bad arguments, bad option values) are one
line and a hint, exit code 2. Errors name options by their flags
(``LmdbFolderError.text(cli=True)``). Subcommands import what they need when
they run, so ``lmdbfolder info`` never imports torch.

Each command is one module here (``pack``, ``info``, ..., ``importing`` for
``import``) with ``add_parser(sub)`` (its flags and help) and ``run(args) -> int``
(the work and what it prints); ``common`` holds what they share: the parser
class, the exit codes and the one error path (``run_command``), JSON output,
the output flags and the argument types.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from lmdbfolder._version import __version__
from lmdbfolder.cli import bench, copy, demo, doctor, export, importing, index, info, pack, show, verify, warm
from lmdbfolder.cli.common import EXIT_CODES, Parser, run_command

__all__ = ["main", "console", "EXIT_CODES"]

#: The command modules, in the order ``lmdbfolder --help`` lists them.
COMMANDS = (pack, info, verify, show, export, importing, index, copy, bench, warm, demo, doctor)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``lmdbfolder`` command."""
    parser = Parser(
        prog="lmdbfolder",
        description="Pack image datasets into LMDB and read them from PyTorch as an ImageFolder.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"lmdbfolder {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lmdbfolder`` command with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help, --version and usage errors
        return int(exc.code or 0)
    return run_command(args)


def console() -> int:
    """The ``lmdbfolder`` command's entry point (and ``python -m lmdbfolder``'s): ``main()``
    in a process of its own, whose heap may be tuned for packing (``keep_freed_memory``)."""
    from lmdbfolder.write.runtime import keep_freed_memory

    keep_freed_memory()
    return main()
