"""``lmdbfolder warm``: read a pack once so that it is in the page cache (before training)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lmdbfolder.cli.common import add_output_flags, print_json, show_progress
from lmdbfolder.text import megabytes

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``warm`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "warm",
        help="read a pack once so that it is in the page cache (before training)",
        description="Read data.mdb of the pack DST (every shard's, for a sharded pack) once, sequentially, so "
        "that training reads it from memory; says how much of it the page cache held before and after.",
    )
    p.add_argument("pack", metavar="DST", help="pack directory")
    add_output_flags(p, "print the summary as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder warm``: read the pack, say how much was cached before and after."""
    from lmdbfolder.tools.cache import warm

    report = warm(args.pack, progress=show_progress(args))
    if args.json:
        print_json(report.as_dict())
        return 0

    def pct(x: float | None) -> str:
        return "unknown" if x is None else f"{x:.0%}"

    print(
        f"{report.path}: read {megabytes(report.nbytes)} in {report.seconds:.1f} s ({report.mb_per_second:,.0f} MB/s); "
        f"in the page cache before {pct(report.resident_before)}, after {pct(report.resident_after)}"
    )
    if report.mem_available is not None and report.nbytes > report.mem_available:
        print(
            f"warning: the pack ({megabytes(report.nbytes)}) is larger than the available memory "
            f"({megabytes(report.mem_available)}); only part of it can stay cached",
            file=sys.stderr,
        )
    return 0
