"""``lmdbfolder export``: write a pack back out as files (byte for byte), WebDataset tar shards or a
Hugging Face dataset (Parquet files and a dataset card that ``datasets.load_dataset`` reads)."""

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
        help="write a pack back out as files (byte for byte), WebDataset tar shards or a Hugging Face dataset",
        description="Write the samples of the pack DST into the new directory OUT (it must not exist, or be "
        "empty). files: the tree the pack came from (ImageFolder tree, flat folder, or list file and files), "
        "each file byte for byte as packed, at its relative path (not for --store raw or --max-size packs). "
        "webdataset: tar shards of about --shard-size, members <key>.jpg/.png/... and <key>.cls, __key__ = "
        "the path without its extension, and classes.txt. huggingface: what datasets.load_dataset(OUT) loads, "
        "features image (the stored bytes) and label (a ClassLabel of the class names): Parquet files of about "
        "--shard-size under OUT/data and the dataset card OUT/README.md (needs pyarrow). A pack of several "
        "fields: files writes its layout's files back (not the dataset layout); webdataset a member a field, "
        "<key>.<field>.<ext>; huggingface a column a field.",
    )
    p.add_argument("pack", metavar="DST", help="pack directory")
    p.add_argument("out", metavar="OUT", help="new directory to write")
    p.add_argument(
        "--format",
        choices=("files", "webdataset", "huggingface"),
        default="files",
        help="files (default), webdataset or huggingface",
    )
    p.add_argument(
        "--shard-size",
        default="1GB",
        metavar="SIZE",
        help="webdataset, huggingface: bytes per tar shard or Parquet file (default 1GB)",
    )
    p.add_argument(
        "--split", default="train", metavar="NAME", help="huggingface: the name of the split (default train)"
    )
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
    result = export(
        args.pack,
        args.out,
        format=args.format,
        shard_size=args.shard_size,
        progress=show_progress(args),
        split=args.split,
    )
    if args.json:
        print_json(result.as_dict())
        return 0
    if result.format == "webdataset":
        what = plural(len(result.shards), "tar shard")
    elif result.format == "huggingface":
        what = f"a Hugging Face dataset ({plural(len(result.shards), 'Parquet file')} and README.md)"
    else:
        what = "files" + (f" and the list {result.list_file}" if result.list_file else "")
    print(
        f"exported {plural(result.samples, 'sample')} ({megabytes(result.bytes)}) to {result.path} as {what} "
        f"in {result.seconds:.1f} s"
    )
    return 0
