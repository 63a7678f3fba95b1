"""``lmdbfolder info``: describe a pack (count, classes, size, encodings, version).

The text layout is ``lmdbfolder.tools.info.format_info``'s; this module picks
what to read (the size sample) and prints it, or the JSON.
"""

from __future__ import annotations

import argparse
from typing import Any

from lmdbfolder.cli.common import count, print_json

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``info`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "info",
        help="describe a pack (count, classes, size, encodings, version)",
        description="Describe the pack DST from its manifest: count, classes, store, encodings, size on disk, "
        "format version, source and skipped files.",
    )
    p.add_argument("pack", metavar="DST", help="pack directory")
    p.add_argument(
        "--sizes",
        type=count,
        default=None,
        metavar="N",
        help="read N evenly spaced record headers for the image sizes (default 10000; 0 = every record)",
    )
    p.add_argument("--no-sizes", action="store_true", help="leave out the image sizes (reads no record at all)")
    p.add_argument("--json", action="store_true", help="print JSON (every class's count included)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder info``: the manifest's summary and the statistics, as text or JSON."""
    from lmdbfolder.tools.info import DEFAULT_SIZE_SAMPLE, format_info, pack_info, pack_statistics

    info = pack_info(args.pack)
    sizes = -1 if args.no_sizes else (DEFAULT_SIZE_SAMPLE if args.sizes is None else args.sizes)
    stats = pack_statistics(info["path"], sizes=sizes)
    info.update({k: v for k, v in stats.items() if k not in ("path", "count", "encodings")})
    info["encoding_shares"] = {k: v["share"] for k, v in stats["encodings"].items()}
    if args.json:
        print_json(info)
        return 0
    print(format_info(info))
    return 0
