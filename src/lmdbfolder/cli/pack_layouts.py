"""``lmdbfolder pack SRC DST --layout voc|ade20k|cityscapes|coco|pairs|table``: samples of several
fields (an image and its mask, an LQ/GT pair, an image and its annotations or table row) listed
by ``write.layouts.scan_layout`` and written by ``write.fields.pack_field_samples``.

``lmdbfolder.cli.pack`` owns the command; this module adds the layout flags and runs a pack
whose ``--layout`` is given."""

from __future__ import annotations

import argparse
import shlex
import warnings
from typing import Any, Callable

from lmdbfolder.cli.common import positive_int, print_json, usage
from lmdbfolder.errors import SkippedFilesWarning
from lmdbfolder.text import megabytes, plural, printable

__all__ = ["LAYOUT_CHOICES", "add_layout_options", "refuse_layout_flags", "run_layout"]

#: ``write.layouts.LAYOUTS`` (written out here: ``--help`` must not import the writer; a test pins them).
LAYOUT_CHOICES = ("voc", "ade20k", "cityscapes", "coco", "pairs", "table")
#: The flags of ``--layout`` packs: (flag, attribute).
LAYOUT_FLAGS = (
    ("--split", "split"),
    ("--annotations", "annotations"),
    ("--scale", "scale"),
    ("--gt-dir", "gt_dir"),
    ("--lq-dir", "lq_dir"),
    ("--filename-tmpl", "filename_tmpl"),
    ("--image-column", "image_column"),
)
#: ``pack`` flags that a ``--layout`` pack does not take (fields are stored as their files are;
#: the shards are written here, one after the other), with their defaults.
_NOT_WITH_LAYOUT = (
    ("--store raw", "store", (None, "encoded")),
    ("--max-size", "max_size", (None,)),
    ("--quality", "quality", (None,)),
    ("--format", "resize_format", (None,)),
    ("--resize-side", "resize_side", (None,)),
    ("--allow-empty", "allow_empty", (False,)),
    ("--extensions", "extensions", (None,)),
    ("--match", "match", (None,)),
    ("--shard-index", "shard_index", (None,)),
    ("--ray", "ray", (None,)),
    ("--staging", "staging", (None,)),
)


def add_layout_options(p: argparse.ArgumentParser) -> None:
    """The flags of ``--layout`` packs (the layout's split, annotation file, scale, folders)."""
    g = p.add_argument_group(
        "samples of several fields (--layout)",
        "voc, ade20k, cityscapes: image + mask; coco: image + image_info + annotations; "
        "pairs: lq + gt (BasicSR's folders); table: image + meta (a JSON Lines or CSV file). See docs/layouts.md",
    )
    g.add_argument(
        "--split",
        metavar="S",
        help="voc: the split file ImageSets/Segmentation/S.txt (train, val, trainval; default train); "
        "ade20k: training (default) or validation; cityscapes: train (default), val or test",
    )
    g.add_argument(
        "--annotations",
        metavar="FILE",
        help="coco: the instances JSON (its file_name entries are relative to SRC); "
        "table: the .jsonl or .csv file naming the images",
    )
    g.add_argument("--scale", type=positive_int, metavar="N", help="pairs: GT size = N x LQ size (required)")
    g.add_argument("--gt-dir", metavar="DIR", help="pairs: the GT folder, relative to SRC (default: GT, gt, HR or hr)")
    g.add_argument("--lq-dir", metavar="DIR", help="pairs: the LQ folder, relative to SRC (default: LQ, lq, LR or lr)")
    g.add_argument(
        "--filename-tmpl",
        metavar="TMPL",
        help="pairs: BasicSR's filename_tmpl, the LQ name made from the GT name without its ending "
        "(default '{}'; DIV2K's bicubic LQ files: '{}x4')",
    )
    g.add_argument(
        "--image-column",
        metavar="NAME",
        help="table: the column naming the image file (default: the first of image, file_name, filename, file, "
        "path, image_path, img)",
    )


def refuse_layout_flags(args: argparse.Namespace) -> int | None:
    """The usage error (exit code) of a layout flag given without --layout, or of a ``pack`` flag a
    --layout pack does not take; None: none."""
    if args.layout is None:
        given = [flag for flag, name in LAYOUT_FLAGS if getattr(args, name) is not None]
        if given:
            return usage("pack", f"{', '.join(given)} go{'es' if len(given) == 1 else ''} with --layout")
        return None
    refused = [flag for flag, name, defaults in _NOT_WITH_LAYOUT if getattr(args, name) not in defaults]
    if refused:
        return usage(
            "pack",
            f"--layout {args.layout} does not take {', '.join(refused)}: samples of several fields are stored as "
            "their files are, by this command (--shards N or --shard-size SIZE for a sharded pack)",
        )
    return None


def run_layout(args: argparse.Namespace, pack_options: Callable[[argparse.Namespace], Any]) -> int:
    """``pack --layout L``: list the samples (``scan_layout``), then pack them (or, with --dry-run,
    say what would be packed)."""
    from lmdbfolder.write.fields import pack_field_samples
    from lmdbfolder.write.layouts import scan_layout
    from lmdbfolder.write.shards import ShardedPackResult

    refused = refuse_layout_flags(args)
    if refused is not None:
        return refused
    if args.shards is not None and args.shard_size is not None:
        return usage("pack", "pass one of --shards N and --shard-size SIZE")
    if args.dry_run and args.update:
        return usage(
            "pack", "--dry-run describes a new pack; it cannot preview --update (run --update itself: it is atomic)"
        )
    options = pack_options(args)
    samples = scan_layout(
        args.src,
        args.layout,
        split=args.split,
        annotations=args.annotations,
        scale=args.scale,
        gt_dir=args.gt_dir,
        lq_dir=args.lq_dir,
        filename_tmpl=args.filename_tmpl,
        image_column=args.image_column,
    )
    fields = [f.to_json() for f in samples.fields]
    if args.dry_run:
        return _report_dry(args, samples, fields)
    with warnings.catch_warnings():  # the skipped samples are listed below instead
        warnings.simplefilter("ignore", SkippedFilesWarning)
        result = pack_field_samples(
            samples, args.dst, options, shards=args.shards, shard_size=args.shard_size, prefix=args.shard_prefix
        )
    if args.json:
        print_json({**result.as_dict(), "layout": args.layout, "layout_info": samples.layout_info, "fields": fields})
        return 0
    what = f"{args.layout} ({_info(samples.layout_info)})" if _info(samples.layout_info) else args.layout
    names = ", ".join(f["name"] for f in fields)
    sharded = isinstance(result, ShardedPackResult)
    listed_in = "each shard's skipped.txt" if sharded else f"{result.path}/skipped.txt"
    changes = result.changes
    if changes is not None:
        compared = f", {plural(changes.unchanged, 'sample')} compared and unchanged" if changes.unchanged else ""
        if isinstance(result, ShardedPackResult):
            rewritten = sum(not s.kept for s in result.shards)
            compared += f", {rewritten} of {plural(len(result.shards), 'shard')} rewritten"
        print(
            f"updated {result.path}: {changes.summary()} -> {plural(result.count, 'sample')} of {what}; "
            f"{plural(changes.read, 'sample')} read ({megabytes(result.input_bytes)}){compared} "
            f"in {result.seconds:.1f} s"
        )
        _print_skipped(result.skipped, listed_in)
        return 0
    if result.already_packed and args.update:
        print(f"{result.path} is up to date with {samples.root}: nothing changed ({plural(result.count, 'sample')})")
        return 0
    if result.already_packed:
        print(
            f"{result.path} is already packed from this source with these options: nothing to do "
            f"({plural(result.count, 'sample')}; --overwrite packs it again)"
        )
        return 0
    if isinstance(result, ShardedPackResult):
        resumed = f" ({plural(len(result.shards), 'shard')})"
    else:
        resumed = f" (resumed after {plural(result.resumed_from, 'sample')})" if result.resumed_from else ""
    print(
        f"packed {plural(result.count, 'sample')} of {what}, fields {names}, into {result.path}{resumed}: "
        f"{megabytes(result.input_bytes)} read in {result.seconds:.1f} s"
    )
    _print_skipped(result.skipped, listed_in)
    shell = shlex.quote(result.path)
    print(
        f"next: `lmdbfolder verify {shell}` checks every record;\n"
        f"      in Python: `from lmdbfolder.torch import LMDBDataset; ds = LMDBDataset({result.path!r})`"
    )
    return 0


def _info(info: dict[str, Any]) -> str:
    """The split / scale / annotation file of a layout, for the summary line."""
    keys = ("split", "scale", "annotations", "table")
    return ", ".join(f"{k} {printable(str(info[k]), 200)}" for k in keys if k in info)


def _report_dry(args: argparse.Namespace, samples: Any, fields: list[dict[str, Any]]) -> int:
    """``pack --layout L --dry-run``: the samples listed and those left out; nothing read or written."""
    if args.json:
        print_json(
            {
                "dry_run": True,
                "layout": args.layout,
                "layout_info": samples.layout_info,
                "fields": fields,
                "root": samples.root,
                "samples": len(samples.relpaths),
                "skipped": [{"path": p, "reason": r} for p, r in samples.skipped],
                "estimated_bytes": int(samples.mean_size * len(samples.relpaths)),
            }
        )
        return 0
    names = ", ".join(f["name"] for f in fields)
    print(
        f"dry run, nothing written: {samples.root} as {args.layout} ({_info(samples.layout_info)}) holds "
        f"{plural(len(samples.relpaths), 'sample')} of fields {names}, about "
        f"{megabytes(samples.mean_size * len(samples.relpaths))}"
    )
    _print_skipped(samples.skipped, "the pack's skipped.txt once packed")
    print(
        f"to pack: lmdbfolder pack {shlex.quote(args.src)} {shlex.quote(args.dst)} --layout {args.layout} "
        "(the same options)"
    )
    return 0


def _print_skipped(skipped: list[tuple[str, str]], listed_in: str, shown: int = 20) -> None:
    if not skipped:
        return
    print(f"skipped {plural(len(skipped), 'sample')} (listed in {listed_in}):")
    for path, reason in skipped[:shown]:
        print(f"  {printable(path, 1000)}: {printable(reason)}")
    if len(skipped) > shown:
        print(f"  ... and {len(skipped) - shown:,} more")
