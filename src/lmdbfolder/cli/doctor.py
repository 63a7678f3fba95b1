"""``lmdbfolder doctor``: which accelerations are active in this installation, and what to install."""

from __future__ import annotations

import argparse
from typing import Any

from lmdbfolder.cli.common import print_json

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``doctor`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "doctor",
        help="say which accelerations are active here (compiled crop decoder, JPEG decoders) and what to install",
        description="Check this installation as the read path does: the compiled crop decoder (region decoding, "
        "the exact resize), each JPEG decoder and whether it gives Pillow's pixels, the one decoder='auto' picks, "
        "the checksum implementation and the optional libraries; then say what would make reading faster here.",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder doctor``: the report (exit code 0 whatever it finds)."""
    from lmdbfolder.tools.doctor import format_report, system_report

    report = system_report()
    if args.json:
        print_json(report)
    else:
        print(format_report(report))
    return 0
