"""``lmdbfolder index``: write DST/index.json once every shard of a sharded pack is packed."""

from __future__ import annotations

import argparse
import os
from typing import Any

from lmdbfolder.cli.common import print_json
from lmdbfolder.text import plural

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``index`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "index",
        help="write DST/index.json once every shard of a sharded pack is packed",
        description="Check the shards in DST (all present, finished, from one split) and write DST/index.json.",
    )
    p.add_argument("dst", metavar="DST", help="the directory holding the shards")
    p.add_argument("--prefix", help="use the shards named PREFIX-* (when several splits share DST)")
    p.add_argument("--json", action="store_true", help="print the index as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder index``: check the shards, write the index, say what it holds."""
    from lmdbfolder.write.shards import write_index

    index = write_index(args.dst, prefix=args.prefix)
    if args.json:
        print_json(index.to_dict())
        return 0
    print(
        f"wrote {os.path.join(os.path.abspath(args.dst), 'index.json')}: {plural(index.count, 'image')} "
        f"in {plural(len(index.shards), 'shard')}, {plural(len(index.classes), 'class', 'classes')}"
        + (f", {plural(index.skipped, 'source file')} skipped" if index.skipped else "")
    )
    return 0
