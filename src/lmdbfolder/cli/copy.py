"""``lmdbfolder copy``: copy a pack (or sharded pack) safely, every page and record checked, compacted."""

from __future__ import annotations

import argparse
from typing import Any

from lmdbfolder.cli.common import add_output_flags, positive_int, print_json, show_progress
from lmdbfolder.errors import OptionError
from lmdbfolder.remote import DEFAULT_JOBS, DEFAULT_PART_SIZE, is_url
from lmdbfolder.text import megabytes, plural

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``copy`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "copy",
        help="copy a pack (or sharded pack) safely, also to and from object storage (s3://, gs://, az://)",
        description="Copy the pack SRC to the new path DST, compacted, reading every page and record "
        "checked (a damaged SRC is an error, never a crash); "
        "a sharded pack is copied shard by shard with its index. DST appears only when complete. "
        "Either side may be a URL (s3://bucket/prefix; credentials and endpoint from the standard "
        "AWS_* variables and ~/.aws files): an upload writes the index last, with each shard's SHA-256; "
        "a download fetches shards in parallel in ranged parts, checks each against the index before "
        "publishing it, and resumes when run again (only the missing parts are fetched).",
    )
    p.add_argument("src", metavar="SRC", help="pack or sharded pack directory, or its URL")
    p.add_argument("dst", metavar="DST", help="path or URL of the copy")
    p.add_argument("--overwrite", action="store_true", help="replace an existing pack at DST")
    p.add_argument("--verify", action="store_true", help="check every record of the copy before publishing it")
    p.add_argument(
        "--jobs", type=positive_int, default=DEFAULT_JOBS, help=f"requests in flight (default {DEFAULT_JOBS})"
    )
    p.add_argument(
        "--part-size",
        type=size_arg,
        default=DEFAULT_PART_SIZE,
        help=f"bytes per ranged request of a download, e.g. 16MB (default {DEFAULT_PART_SIZE >> 20}MiB)",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="give a download up when the server sends nothing for this long (default 60, or $LMDBFOLDER_REMOTE_STALL)",
    )
    p.add_argument(
        "--min-rate",
        type=size_arg,
        default=None,
        metavar="BYTES",
        help="give a download up when a response brings less than this many bytes a second once it has "
        "taken a minute, e.g. 16KiB (default 16KiB, or $LMDBFOLDER_REMOTE_MIN_RATE)",
    )
    add_output_flags(p, "print the summary as JSON")
    p.set_defaults(run=run)


def size_arg(text: str) -> int:
    """An argument type: a size in bytes, with an optional unit (``16MB``, ``1GiB``)."""
    from lmdbfolder.write.shards import parse_size

    try:
        value = parse_size(text)
    except (ValueError, OptionError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder copy``: copy, then say how much it read and wrote."""
    import dataclasses

    from lmdbfolder.remote import Limits
    from lmdbfolder.tools.copy import copy_pack

    limits = Limits.current()
    if args.stall_timeout is not None:
        limits = dataclasses.replace(limits, stall=args.stall_timeout)
    if args.min_rate is not None:
        limits = dataclasses.replace(limits, min_rate=float(args.min_rate))
    result = copy_pack(
        args.src,
        args.dst,
        overwrite=args.overwrite,
        verify=args.verify,
        jobs=args.jobs,
        part_size=args.part_size,
        progress=show_progress(args),
        limits=limits,
    )
    if args.json:
        print_json(result.as_dict())
        return 0
    shards = f" ({plural(result.shards, 'shard')})" if result.shards > 1 or _sharded(result.dst) else ""
    sizes = f"{megabytes(result.bytes_before)} -> {megabytes(result.bytes_after)}"
    if is_url(args.src) or is_url(args.dst):
        sizes = f"{megabytes(result.transferred)} transferred"
    print(
        f"copied {plural(result.count, 'image')}{shards} to {result.dst} in {result.seconds:.1f} s: {sizes}"
        + (", verified" if args.verify else "")
    )
    return 0


def _sharded(path: str) -> bool:
    from lmdbfolder import packdir

    return not is_url(path) and packdir.inspect(path).kind is packdir.Kind.SHARDED
