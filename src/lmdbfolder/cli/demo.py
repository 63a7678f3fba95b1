"""``lmdbfolder demo``: generate a small image dataset, pack it, verify it and compare it with plain files."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

from lmdbfolder.cli.common import count, positive_int, usage

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``demo`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "demo",
        help="generate a small image dataset, pack it, verify it and compare it with plain files",
        description="The whole job on a generated dataset: make an ImageFolder tree of JPEGs, pack it, verify "
        "it, check that LMDBFolder returns what ImageFolder returns, and end with the `lmdbfolder bench` table. "
        "Everything goes to a temporary folder that is deleted at the end, unless --dir keeps it.",
    )
    p.add_argument(
        "--dir",
        help="work folder to keep: a new or empty folder, or one an earlier demo used "
        "(default: a temporary folder, removed afterwards)",
    )
    p.add_argument("--classes", type=positive_int, default=10, help="number of classes (default 10)")
    p.add_argument("--per-class", type=positive_int, default=100, help="images per class (default 100)")
    p.add_argument("--workers", type=count, nargs="+", default=[0, 2], help="DataLoader worker counts (default 0 2)")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.set_defaults(run=run)


#: What the demo writes into its work folder.
DEMO_NAMES = ("images", "images.lmdb", "bench")
#: Marks a --dir folder as the demo's own (a later run may use it again).
DEMO_MARKER = ".lmdbfolder-demo"


def _demo_names_in(workdir: str) -> list[str]:
    return [name for name in DEMO_NAMES if os.path.lexists(os.path.join(workdir, name))]


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder demo``: the demo in a work folder (a temporary one unless --dir)."""
    from lmdbfolder.bench.demo import run_demo

    out = sys.stderr if args.json else sys.stdout
    if args.dir is not None:
        workdir = os.path.abspath(args.dir)
        try:
            os.makedirs(workdir, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=workdir, prefix=".lmdbfolder-write-test-"):
                pass  # the folder is writable
        except OSError as exc:
            return usage("demo", f"cannot use --dir {args.dir} as a work folder: {exc.strerror or exc}")
        # The demo writes (and repacks with overwrite) these: never over what it did not make.
        theirs = [] if os.path.exists(os.path.join(workdir, DEMO_MARKER)) else _demo_names_in(workdir)
        if theirs:
            return usage(
                "demo",
                f"--dir {args.dir} already holds {', '.join(theirs)}, not made by the demo; pass a new or empty "
                f"folder (the demo writes {', '.join(DEMO_NAMES)} there)",
            )
        try:
            with open(os.path.join(workdir, DEMO_MARKER), "a"):
                pass
        except OSError as exc:
            return usage("demo", f"cannot use --dir {args.dir} as a work folder: {exc.strerror or exc}")
        print(f"work folder: {workdir} (kept: the images, the pack and the bench's packs stay there)", file=out)
    else:
        workdir = tempfile.mkdtemp(prefix="lmdbfolder-demo-")
        print(f"work folder: {workdir} (temporary, deleted at the end; --dir DIR keeps everything)", file=out)
    try:
        return run_demo(
            workdir,
            classes=args.classes,
            per_class=args.per_class,
            workers=args.workers,
            as_json=args.json,
        )
    finally:
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
            print(f"deleted the work folder {workdir}", file=out, flush=True)
