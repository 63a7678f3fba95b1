"""``lmdbfolder import``: convert an LMDB made by a blog recipe (pickled samples, BasicSR arrays) into a pack.

(The module is not named ``import``: that is a Python keyword.)
"""

from __future__ import annotations

import argparse
from typing import Any

from lmdbfolder.cli.common import add_output_flags, nothing_to_do, print_json, show_progress
from lmdbfolder.text import plural, printable

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``import`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "import",
        help="convert an LMDB made by a blog recipe (pickled samples, BasicSR arrays) into a pack",
        description="Convert OLD (folder2lmdb-style pickled (image_bytes, label) values with __len__/__keys__, "
        "or BasicSR-style images with meta_info.txt/.pkl) into the new pack NEW. Pickles are read "
        "with a restricted unpickler: nothing in OLD can run code.",
    )
    p.add_argument("old", metavar="OLD", help="the recipe's LMDB directory")
    p.add_argument("new", metavar="NEW", help="pack directory to create")
    p.add_argument(
        "--channel-order",
        choices=("bgr", "rgb"),
        default="bgr",
        help="channel order of raw arrays in OLD (default bgr, as OpenCV writes them); packs are RGB",
    )
    p.add_argument(
        "--classes",
        metavar="FILE",
        help="the class names, one per line in label order (line 1 names label 0); without it the classes "
        "are named 0, 1, ... (the recipe's LMDB stores only the labels)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing pack at NEW")
    p.add_argument("--restart", action="store_true", help="discard an unfinished import instead of resuming it")
    add_output_flags(p, "print the summary as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder import``: convert, then say what was imported and skipped."""
    from lmdbfolder.tools.importing import import_legacy

    result = import_legacy(
        args.old,
        args.new,
        channel_order=args.channel_order,
        classes=None if args.classes is None else _read_classes(args.classes),
        overwrite=args.overwrite,
        restart=args.restart,
        progress=show_progress(args),
    )
    if args.json:
        print_json(result.as_dict())
    else:
        if result.already_packed:
            print(nothing_to_do(result.path, plural(result.count, "sample")))
            return 0
        print(
            f"imported {plural(result.count, 'sample')} ({result.store}) into {result.path} in {result.seconds:.1f} s"
        )
        for path, reason in result.skipped[:20]:
            print(f"  skipped {printable(path, 1000)}: {printable(reason)}")  # keys of anyone's LMDB: escaped
    return 0


def _read_classes(path: str) -> list[str]:
    """``--classes FILE``: one class name a line (blank lines at the end ignored)."""
    from lmdbfolder.errors import SourceError

    try:
        with open(path, encoding="utf-8") as f:
            names = f.read().splitlines()
    except OSError as exc:
        raise SourceError(
            path, f"cannot read the class list ({exc.strerror})", "pass a text file, one name a line"
        ) from None
    except UnicodeDecodeError:
        raise SourceError(path, "the class list is not UTF-8 text", "pass a text file, one name a line") from None
    while names and not names[-1].strip():
        names.pop()
    return names
