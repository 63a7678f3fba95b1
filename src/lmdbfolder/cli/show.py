"""``lmdbfolder show``: draw samples of a pack as a PNG contact sheet, to check it by eye."""

from __future__ import annotations

import argparse
import os
from typing import Any

from lmdbfolder.cli.common import EXIT_CODES, count, positive_int, print_json
from lmdbfolder.text import plural

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``show`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "show",
        help="draw samples of a pack as a PNG contact sheet, to check it by eye",
        description="Write a PNG grid of samples of the pack DST, decoded as ImageFolder loads them, each "
        "captioned with its index and class: a few per class (default 4, fewer for many classes; a row per "
        "class), a random sample, or the given indices. A sample that does not decode (or whose record is "
        "damaged) is drawn as a red tile and makes the exit code 1, as `lmdbfolder verify` does.",
    )
    p.add_argument("pack", metavar="DST", help="pack directory")
    p.add_argument("-o", "--output", metavar="PNG", help="the sheet to write (default: <pack name>-sheet.png here)")
    choice = p.add_mutually_exclusive_group()
    choice.add_argument("--per-class", type=positive_int, metavar="K", help="K samples of every class (default 4)")
    choice.add_argument("--random", type=positive_int, metavar="N", help="N samples drawn at random")
    choice.add_argument("--indices", type=count, nargs="+", metavar="I", help="these samples, in this order")
    p.add_argument("--size", type=positive_int, default=128, metavar="PX", help="tile size in pixels (default 128)")
    p.add_argument("--seed", type=int, default=0, help="random seed for --random (default 0)")
    p.add_argument("--json", action="store_true", help="print where each tile is, as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder show``: write the sheet, say what is on it."""
    from lmdbfolder import packdir
    from lmdbfolder.tools.show import contact_sheet

    found = packdir.require_pack(args.pack)
    output = args.output or f"{os.path.basename(found.path.rstrip(os.sep))}-sheet.png"
    result = contact_sheet(
        found.path,
        output,
        per_class=args.per_class,
        random=args.random,
        indices=args.indices,
        size=args.size,
        seed=args.seed,
    )
    problems = EXIT_CODES["problems found"] if result.undecodable else 0
    if args.json:
        print_json(result.as_dict())
        return problems
    print(
        f"wrote {result.path}: {plural(len(result.indices), 'sample')} of {found.path} in "
        f"{plural(result.rows, 'row')} of {plural(result.columns, 'tile')} ({result.size} px), "
        f"{result.width}x{result.height} px"
    )
    if result.undecodable:
        n = len(result.undecodable)
        shown = ", ".join(map(str, result.undecodable[:10])) + (", ..." if n > 10 else "")
        print(
            f"{plural(n, 'sample')} did not decode or {'is' if n == 1 else 'are'} damaged (red tiles): {shown}; "
            f"`lmdbfolder verify {found.path}` lists every damaged record"
        )
    return problems
