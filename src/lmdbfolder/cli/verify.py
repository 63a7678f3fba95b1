"""``lmdbfolder verify``: check every record's checksum, the count and the keys (exit code 1 on a problem)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lmdbfolder.cli.common import EXIT_CODES, add_output_flags, print_json, show_progress, usage
from lmdbfolder.text import megabytes, plural, printable

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``verify`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "verify",
        help="check every record's checksum, the count and the keys",
        description="Check the pack DST: the manifest, the keys 0..count-1, every record's header, CRC-32 and "
        "label, and that every JPEG/PNG ends with its end marker; --decode also decodes every image, --against "
        "compares with the source files. Exit code 1 when a problem is found; each is named by record and path.",
    )
    p.add_argument("pack", metavar="DST", help="pack directory")
    p.add_argument("--decode", action="store_true", help="also decode every image")
    p.add_argument("--against", metavar="SRC", help="compare with the source folder: same files, labels and bytes")
    p.add_argument("--list", metavar="FILE", dest="list_file", help="with --against: the list file to compare with")
    p.add_argument(
        "--annotations",
        metavar="FILE",
        help="with --against, a pack of the coco or table layout: its annotation file or table "
        "(default: the file of the recorded name in SRC, beside it or in annotations/ beside it)",
    )
    add_output_flags(p, "print the report as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder verify``: the problems on stderr, one summary line; 1 if any problem was found."""
    from lmdbfolder.tools.verify import verify

    if args.list_file is not None and args.against is None:
        return usage("verify", "--list FILE compares with a source and needs --against SRC")

    report = verify(
        args.pack,
        decode=args.decode,
        against=args.against,
        list_file=args.list_file,
        annotations=args.annotations,
        progress=show_progress(args),
    )
    if args.json:
        print_json(report.as_dict())
    else:
        for problem in report.problems:
            print(printable(problem, 2000), file=sys.stderr)  # paths and values from the pack: escaped
        for note in report.notes:
            print(f"note: {note}", file=sys.stderr)
        what = (
            "checksums"
            + (", decoding" if report.decoded else "")
            + (f", against {args.against}" if args.against else "")
        )
        status = (
            "OK"
            if report.ok
            else f"{plural(len(report.problems), 'problem')} in {plural(len(report.bad_indices), 'record')}"
        )
        print(
            f"{report.path}: {report.checked:,} of {plural(report.count, 'record')} checked ({what}), "
            f"{megabytes(report.payload_bytes)} in {report.seconds:.1f} s: {status}"
        )
    return 0 if report.ok else EXIT_CODES["problems found"]
