"""``lmdbfolder copy``: copy a pack (or sharded pack) safely, every page and record checked, compacted."""

from __future__ import annotations

import argparse
from typing import Any

from lmdbfolder.cli.common import print_json
from lmdbfolder.text import megabytes, plural

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``copy`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "copy",
        help="copy a pack (or sharded pack) safely: every page and record checked, compacted",
        description="Copy the pack SRC to the new path DST, compacted, reading every page and record "
        "checked (a damaged SRC is an error, never a crash); "
        "a sharded pack is copied shard by shard with its index. DST appears only when complete.",
    )
    p.add_argument("src", metavar="SRC", help="pack or sharded pack directory")
    p.add_argument("dst", metavar="DST", help="path of the copy")
    p.add_argument("--overwrite", action="store_true", help="replace an existing pack at DST")
    p.add_argument("--verify", action="store_true", help="check every record of the copy before publishing it")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder copy``: copy, then say how much it read and wrote."""
    from lmdbfolder import packdir
    from lmdbfolder.tools.copy import copy_pack

    result = copy_pack(args.src, args.dst, overwrite=args.overwrite, verify=args.verify)
    if args.json:
        print_json(result.as_dict())
        return 0
    shards = f" ({plural(result.shards, 'shard')})" if packdir.inspect(result.dst).kind is packdir.Kind.SHARDED else ""
    print(
        f"copied {plural(result.count, 'image')}{shards} to {result.dst} in {result.seconds:.1f} s: "
        f"{megabytes(result.bytes_before)} -> {megabytes(result.bytes_after)}" + (", verified" if args.verify else "")
    )
    return 0
