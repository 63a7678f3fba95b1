"""``lmdbfolder export``: write a pack back out as files (byte for byte) or as WebDataset tar shards."""

from __future__ import annotations

import argparse
from typing import Any

from lmdbfolder.cli.common import add_output_flags, print_json, show_progress, usage
from lmdbfolder.text import megabytes, plural

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``export`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "export",
        help="write a pack back out as files (byte for byte) or as WebDataset tar shards",
        description="Write the samples of the pack DST into the new directory OUT (it must not exist, or be "
        "empty). files: the tree the pack came from (ImageFolder tree, flat folder, or list file and files), "
        "each file byte for byte as packed, at its relative path (not for --store raw or --max-size packs). "
        "webdataset: tar shards of about --shard-size, members <key>.jpg/.png/... and <key>.cls, __key__ = "
        "the path without its extension, and classes.txt.",
    )
    p.add_argument("pack", metavar="DST", help="pack directory")
    p.add_argument("out", metavar="OUT", help="new directory to write")
    p.add_argument("--format", choices=("files", "webdataset"), default="files", help="files (default) or webdataset")
    p.add_argument("--shard-size", default="1GB", metavar="SIZE", help="webdataset: bytes per tar shard (default 1GB)")
    add_output_flags(p, "print the summary as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder export``: write OUT, say how much and in what form."""
    from lmdbfolder.tools.export import export
    from lmdbfolder.write.shards import parse_size

    try:
        parse_size(args.shard_size)
    except ValueError as exc:
        return usage("export", f"--shard-size: {exc}")
    result = export(args.pack, args.out, format=args.format, shard_size=args.shard_size, progress=show_progress(args))
    if args.json:
        print_json(result.as_dict())
        return 0
    what = (
        f"{plural(len(result.shards), 'tar shard')}"
        if result.format == "webdataset"
        else "files" + (f" and the list {result.list_file}" if result.list_file else "")
    )
    print(
        f"exported {plural(result.samples, 'sample')} ({megabytes(result.bytes)}) to {result.path} as {what} "
        f"in {result.seconds:.1f} s"
    )
    return 0
