"""``lmdbfolder import``: convert an LMDB made by a blog recipe (pickled samples, BasicSR arrays) into a pack.

(The module is not named ``import``: that is a Python keyword.)
"""

from __future__ import annotations

import argparse
from typing import Any

from lmdbfolder.cli.common import add_output_flags, nothing_to_do, positive_int, print_json, show_progress, usage
from lmdbfolder.text import plural, printable

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``import`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "import",
        help="convert an LMDB made by a blog recipe (pickled samples, BasicSR arrays) into a pack",
        description="Convert OLD (folder2lmdb-style pickled (image_bytes, label) values with __len__/__keys__, "
        "or BasicSR-style images with meta_info.txt/.pkl) into the new pack NEW. Pickles are read "
        "with a restricted unpickler: nothing in OLD can run code. With --gt GT: OLD and GT are the LQ and GT "
        "LMDBs of a BasicSR pair (meta_info.txt beside each data.mdb), imported as one pack of (lq, gt) samples.",
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
    p.add_argument(
        "--gt",
        metavar="GT_LMDB",
        help="OLD is the LQ LMDB of a BasicSR pair and GT_LMDB its ground truth (the same keys): "
        "import the pairs as samples with fields lq and gt, in PairedImageDataset's order",
    )
    p.add_argument(
        "--scale",
        type=positive_int,
        metavar="N",
        help="with --gt: GT size = N x LQ size (default: what the meta_info shapes say)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing pack at NEW")
    p.add_argument("--restart", action="store_true", help="discard an unfinished import instead of resuming it")
    add_output_flags(p, "print the summary as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder import``: convert, then say what was imported and skipped."""
    from lmdbfolder.tools.importing import import_legacy

    if args.gt is not None:
        return _run_pair(args)
    if args.scale is not None:
        return usage("import", "--scale goes with --gt (a BasicSR LMDB pair)")
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


def _run_pair(args: argparse.Namespace) -> int:
    """``import LQ NEW --gt GT``: a BasicSR LMDB pair into one pack of (lq, gt) samples."""
    import warnings

    from lmdbfolder.errors import SkippedFilesWarning
    from lmdbfolder.tools.importing import import_basicsr_pair

    if args.classes is not None:
        return usage("import", "--classes does not go with --gt: a BasicSR pair has no classes")
    if args.channel_order != "bgr":
        return usage("import", "--channel-order does not go with --gt: the pair's encoded images are kept as they are")
    with warnings.catch_warnings():  # the skipped pairs are listed below instead
        warnings.simplefilter("ignore", SkippedFilesWarning)
        result = import_basicsr_pair(
            args.old,
            args.gt,
            args.new,
            scale=args.scale,
            overwrite=args.overwrite,
            restart=args.restart,
            progress=show_progress(args),
        )
    if args.json:
        print_json(
            {
                **result.as_dict(),
                "layout": "pairs",
                "fields": [{"name": "lq", "kind": "image"}, {"name": "gt", "kind": "image"}],
            }
        )
        return 0
    if result.already_packed:
        print(nothing_to_do(result.path, plural(result.count, "pair")))
        return 0
    print(f"imported {plural(result.count, 'pair')} (fields lq, gt) into {result.path} in {result.seconds:.1f} s")
    for path, reason in result.skipped[:20]:
        print(f"  skipped {printable(path, 1000)}: {printable(reason)}")
    if len(result.skipped) > 20:
        print(f"  ... and {len(result.skipped) - 20:,} more (listed in {result.path}/skipped.txt)")
    return 0
