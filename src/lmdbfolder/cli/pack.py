"""``lmdbfolder pack``: an image folder (or a list file) into a pack; with the
shard flags a sharded pack, one shard of a Slurm array, or shards on Ray."""

from __future__ import annotations

import argparse
import os
import shlex
import warnings
from typing import Any, Sequence

from lmdbfolder.cli.common import (
    add_output_flags,
    count,
    nothing_to_do,
    positive_int,
    print_json,
    quality,
    show_progress,
    usage,
)
from lmdbfolder.cli.pack_layouts import LAYOUT_CHOICES, add_layout_options, refuse_layout_flags, run_layout
from lmdbfolder.encodings import DEFAULT_RESIZE_FORMAT, RESIZE_FORMATS
from lmdbfolder.errors import OptionError, SkippedFilesWarning
from lmdbfolder.format import SKIPPED_REPORT
from lmdbfolder.text import megabytes, plural, printable

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``pack`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "pack",
        help="pack an image folder (or a list file) into an LMDB",
        description="Pack SRC into a new pack directory DST. SRC is an ImageFolder tree "
        "(SRC/<class>/**/<image>) unless --flat, --list or --layout says otherwise.",
    )
    p.add_argument("src", metavar="SRC", help="source folder (for --list: the folder the list's paths start from)")
    p.add_argument("dst", metavar="DST", help="pack directory to create")
    layout = p.add_mutually_exclusive_group()
    layout.add_argument("--list", metavar="FILE", dest="list_file", help="read `relative/path label` lines from FILE")
    layout.add_argument("--flat", action="store_true", help="SRC is a folder of unlabelled images")
    layout.add_argument(
        "--layout",
        choices=LAYOUT_CHOICES,
        default=None,
        help="SRC is a dataset of several fields per sample: voc, ade20k, cityscapes (image + mask), coco "
        "(image + annotations, with --annotations FILE), pairs (BasicSR's LQ + GT folders, with --scale N), "
        "table (image + a JSON Lines/CSV row, with --annotations FILE)",
    )
    _add_content_options(p)
    _add_run_options(p)
    _add_source_filters(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="write nothing: scan SRC and check every file as the pack would, then say the classes, the counts, "
        "the files that would be skipped and the estimated size (with --check none: scan and estimate only)",
    )
    add_output_flags(p, "print the summary as JSON")
    _add_shard_options(p)
    add_layout_options(p)
    p.set_defaults(run=run)


def _add_content_options(p: argparse.ArgumentParser) -> None:
    """What each record holds and how the files are checked: --store, --check, --update, the resize flags."""
    p.add_argument(
        "--store",
        choices=("encoded", "raw"),
        default=None,
        help="encoded: keep the original file bytes (default); raw: decoded RGB pixels",
    )
    p.add_argument(
        "--check",
        choices=("header", "decode", "none", "content"),
        default=None,
        help="how to check each source file: header (the header is read as Pillow reads it; default), "
        "decode (decode every image once), none (trust the files); with --update, content: compare every "
        "file's bytes with the pack instead of its size and modification time",
    )
    p.add_argument(
        "--update",
        action="store_true",
        help="bring the pack at DST up to date with SRC in place: add new files and classes, drop files that "
        "are gone, read again the files whose size or modification time changed; nothing else is read. "
        "Keeps the pack's --store/--check/--max-size and its layout and extensions (--flat, --extensions; "
        "a --match pack needs the same --match, a --list pack its --list FILE): other values are refused, "
        "changing them needs --overwrite",
    )
    p.add_argument(
        "--max-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="shrink images whose longer side (see --resize-side) is above N pixels and re-encode them "
        "as JPEG (--format webp: WebP; or raw pixels with --store raw); smaller images keep their bytes",
    )
    p.add_argument(
        "--quality",
        type=quality,
        default=None,
        metavar="Q",
        help="JPEG (or WebP) quality of resized images, 1..100 (default 90)",
    )
    p.add_argument(
        "--format",
        choices=RESIZE_FORMATS,
        default=None,
        dest="resize_format",
        help="with --max-size: re-encode resized images as jpeg (default) or webp",
    )
    p.add_argument(
        "--resize-side",
        choices=("longer", "shorter"),
        default=None,
        help="which side --max-size limits (default: longer, like FFCV's max_resolution)",
    )
    p.add_argument("--strict", action="store_true", help="stop at the first bad file instead of skipping it")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """How the pack is written: transactions, readers, what happens to an existing DST, the space check."""
    p.add_argument(
        "--commit-every", type=positive_int, default=None, metavar="N", help="samples per transaction (default 2000)"
    )
    p.add_argument(
        "--commit-bytes",
        type=positive_int,
        default=None,
        metavar="N",
        help="bytes per transaction (default: 2 MB, more where the disk flushes slowly; at most 64 MB)",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        metavar="N",
        help="reader processes on Linux, else threads (default: 2x CPUs, at least 4; 1 reads in the writer)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing pack at DST")
    p.add_argument("--restart", action="store_true", help="discard an unfinished pack at DST instead of resuming it")


def _add_source_filters(p: argparse.ArgumentParser) -> None:
    """Which files of SRC are packed: --allow-empty, --extensions, --match; and --no-space-check."""
    p.add_argument("--allow-empty", action="store_true", help="keep class folders that hold no image")
    p.add_argument(
        "--extensions",
        type=_extension_list,
        default=None,
        metavar=".EXT,...",
        help="file endings to pack, case-insensitive (default: ImageFolder's .jpg,.jpeg,.png,.ppm,.bmp,.pgm,"
        ".tif,.tiff,.webp); recorded in the pack, and kept by --update",
    )
    p.add_argument(
        "--match",
        default=None,
        metavar="REGEX",
        help="pack only files whose path relative to SRC contains a match of REGEX (Python re.search, / "
        "separators; e.g. '^(?!.*/rejected/)' leaves out every rejected/ folder); recorded in the pack, and "
        "--update needs the same --match again",
    )
    p.add_argument("--no-space-check", action="store_true", help="do not refuse when the disk looks too small")


def _add_shard_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shards and clusters")
    g.add_argument(
        "--shards",
        type=positive_int,
        metavar="N",
        help="write N shards DST/<prefix>-00000-of-0000N.lmdb ... (a contiguous split) and DST/index.json",
    )
    g.add_argument(
        "--shard-size", metavar="SIZE", help="as many shards as needed for about SIZE each (4GB, 500MB, 2GiB)"
    )
    g.add_argument(
        "--shard-index",
        type=count,
        metavar="I",
        help="pack only shard I of --shards N (one job of a Slurm array); afterwards run `lmdbfolder index DST`",
    )
    g.add_argument("--shard-prefix", default="train", metavar="NAME", help="shard name prefix (default: train)")
    g.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="pack the shards in parallel on a Ray cluster, one task per shard. ADDRESS: `auto`, `ray://HOST:10001`; "
        "without it, the cluster in RAY_ADDRESS or a new local one. Put it after SRC DST (or write --ray=ADDRESS)",
    )
    g.add_argument(
        "--task-cpus", type=float, default=1.0, metavar="C", help="CPUs Ray reserves per shard task (default 1)"
    )
    g.add_argument(
        "--staging",
        metavar="DIR",
        help="build each shard in DIR (a node-local disk) and copy it into DST when finished; "
        "for a DST on a network file system, where LMDB must not be written",
    )


def _extension_list(text: str) -> tuple[str, ...]:
    """``--extensions .jpg,.png`` (commas and/or spaces; the dot may be left out)."""
    names = [e.strip() for e in text.replace(",", " ").split()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one extension, e.g. --extensions .jpg,.png")
    return tuple(e if e.startswith(".") else "." + e for e in names)


def _pack_options(args: argparse.Namespace) -> Any:
    """The PackOptions that ``pack``'s flags ask for (validated by PackOptions itself)."""
    from lmdbfolder.write.options import DEFAULT_COMMIT_EVERY, PackOptions, Resize

    resize = None
    if args.max_size is not None:
        level = 90 if args.quality is None else args.quality
        resize = Resize(args.max_size, level, args.resize_side or "longer", args.resize_format or DEFAULT_RESIZE_FORMAT)
    elif args.quality is not None:
        raise OptionError("--quality needs --max-size")
    elif args.resize_format is not None:
        raise OptionError("--format needs --max-size (only resized images are re-encoded)")
    elif args.resize_side is not None:
        raise OptionError("--resize-side needs --max-size")
    store, check = args.store, args.check
    if args.update:
        # Options not given are the pack's own: an update keeps them.
        from lmdbfolder.write.update import recorded_options

        recorded = recorded_options(args.dst)
        if recorded is not None:
            if store is None:
                store = recorded.store
            if check is None:
                check = recorded.check
            if args.max_size is None:
                resize = recorded.resize
    return PackOptions(
        store=store or "encoded",
        check=check or "header",
        update=args.update,
        strict=args.strict,
        commit_every=args.commit_every or DEFAULT_COMMIT_EVERY,
        commit_bytes=args.commit_bytes,
        workers=args.workers,
        overwrite=args.overwrite,
        restart=args.restart,
        space_check=not args.no_space_check,
        progress=show_progress(args),
        resize=resize,
    )


def _source_args(args: argparse.Namespace) -> dict[str, Any]:
    """Where ``pack`` reads from: layout, list file, empty classes, file filters."""
    return dict(
        # Neither --flat nor --list: an ImageFolder tree, or for --update the pack's layout.
        layout="flat" if args.flat else None,
        list_file=args.list_file,
        allow_empty=args.allow_empty,
        extensions=args.extensions,
        match=args.match,
    )


def _kept_filters(args: argparse.Namespace) -> str:
    """For ``--update``: "; kept the pack's --extensions .png ..." for the layout and file
    filters the update takes from the pack without being given them ("" when none)."""
    if not args.update:
        return ""
    from lmdbfolder.write.sources import IMG_EXTENSIONS, SourceSpec
    from lmdbfolder.write.update import update_spec

    given = SourceSpec(**_source_args(args))
    used = update_spec(given, args.dst)  # what pack() does: refusals are raised here first
    words = []
    if used.layout == "flat" and given.layout is None:
        words.append("--flat")
    if given.extensions is None and used.extensions is not None and tuple(used.extensions) != IMG_EXTENSIONS:
        words.append("--extensions " + ",".join(used.extensions))
    return f"; kept the pack's {printable(' '.join(words), 300)}" if words else ""


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder pack``: one pack, a sharded pack when a shard flag is given, an update, or
    a dry run: the flags make one request, which the planner plans and its executor runs.
    With ``--layout``: samples of several fields (``cli.pack_layouts``)."""
    from lmdbfolder.write.executors import execute
    from lmdbfolder.write.planner import Kind

    if args.layout is not None:
        return run_layout(args, _pack_options)
    refused = refuse_layout_flags(args)
    if refused is not None:
        return refused
    refused = _refuse_flags(args)
    if refused is not None:
        return refused
    options = _pack_options(args)
    kept = "" if args.dry_run else _kept_filters(args)
    with warnings.catch_warnings():  # the skipped files are listed below instead
        warnings.simplefilter("ignore", SkippedFilesWarning)
        planned, result = execute(_request(args, options))
    if args.json:
        print_json(result.as_dict())
        return 0
    if planned.kind is Kind.DRY_RUN:
        _report_dry(args, result)
    elif planned.kind in (Kind.SINGLE, Kind.UPDATE):
        _report_single(args, options, result, kept)
    else:
        _report_sharded(args, planned.kind is Kind.UPDATE_SHARDED, result, kept)
    return 0


def _request(args: argparse.Namespace, options: Any) -> Any:
    """The ``PackRequest`` that ``pack``'s flags make."""
    from lmdbfolder.write.planner import OnRay, PackRequest, Sharding
    from lmdbfolder.write.sources import SourceSpec

    sharding = None
    if _wants_shards(args):
        sharding = Sharding(args.shards, args.shard_size, args.shard_index, args.shard_prefix, args.staging)
    on_ray = None if args.ray is None else OnRay(address=args.ray or None, task_cpus=args.task_cpus)
    return PackRequest(
        args.src,
        args.dst,
        SourceSpec(**_source_args(args)),
        options,
        sharding,
        on_ray,
        dry_run=args.dry_run,
        update_as_packed=True,  # `pack --update` updates a sharded DST as it is split
    )


def _refuse_flags(args: argparse.Namespace) -> int | None:
    """The usage error (exit code) of flags that do not go together, before anything is read; None: none."""
    if args.dry_run and args.update:
        raise OptionError(
            "--dry-run describes a new pack; it cannot preview --update (run --update itself: it is atomic)"
        )
    if args.dry_run:
        if args.ray is not None or args.shard_index is not None:
            return usage("pack", "--dry-run describes the whole pack: leave out --ray and --shard-index")
        return None
    if not _wants_shards(args):
        return None
    from lmdbfolder.write.shards import parse_size

    updating = args.update and _is_sharded(args.dst)  # the split is the pack's
    if (args.shards is None) == (args.shard_size is None) and not updating:
        return usage("pack", "pass one of --shards N and --shard-size SIZE")
    if args.shard_index is not None and args.shards is None:
        return usage("pack", "--shard-index needs --shards N (the same N for every job)")
    if args.shard_index is not None and args.ray is not None:
        return usage("pack", "--ray packs every shard; do not combine it with --shard-index")
    if args.shard_index is not None and not 0 <= args.shard_index < args.shards:
        return usage("pack", f"--shard-index must be in 0..{args.shards - 1}")
    if args.shards is not None and args.shards < 1:
        return usage("pack", "--shards must be at least 1")
    if args.shard_size is not None:
        try:
            parse_size(args.shard_size)
        except ValueError as exc:
            return usage("pack", str(exc))
    return None


def _report_single(args: argparse.Namespace, options: Any, result: Any, kept: str) -> None:
    """What a single pack (or its update) did."""
    if result.already_packed:
        skipped = f", {plural(len(result.skipped), 'file')} skipped" if result.skipped else ""
        if options.update:
            print(
                f"{result.path} is up to date with {args.src}: nothing to do "
                f"({plural(result.count, 'image')}{skipped}){kept}"
            )
        else:
            print(nothing_to_do(result.path, plural(result.count, "image") + skipped))
        return
    resumed = f" (resumed after {plural(result.resumed_from, 'file')})" if result.resumed_from else ""
    if result.changes is not None:
        changes = result.changes
        compared = f", {plural(changes.unchanged, 'file')} compared and unchanged" if changes.unchanged else ""
        print(
            f"updated {result.path}: {changes.summary()} -> {plural(result.count, 'image')}{resumed}; "
            f"{plural(changes.read, 'file')} read ({megabytes(result.input_bytes)}){compared} in {result.seconds:.1f} s"
            f"{kept}"
        )
        _print_skipped(result.skipped, os.path.join(result.path, SKIPPED_REPORT))
        return
    print(
        f"packed {plural(result.count, 'image')} into {result.path}{resumed}: {megabytes(result.input_bytes)} read "
        f"in {result.seconds:.1f} s, {result.images_per_second:,.0f} img/s, {result.mb_per_second:,.0f} MB/s"
    )
    resize = options.resize
    if resize is not None:
        print(
            f"resized to {resize.side} side <= {resize.max_size} px "
            f"({'JPEG' if resize.format == 'jpeg' else 'WebP'} quality {resize.quality} unless raw): "
            f"{megabytes(result.payload_bytes)} stored "
            f"({result.payload_bytes / max(1, result.input_bytes):.0%} of the input)"
        )
    _print_skipped(result.skipped, os.path.join(result.path, SKIPPED_REPORT))
    _print_next_steps(result.path)


def _print_next_steps(path: str) -> None:
    """What to do with a new pack: check it, look at it, train from it."""
    shell = shlex.quote(path)
    print(
        f"next: `lmdbfolder verify {shell}` checks every record, `lmdbfolder show {shell}` draws samples per class;\n"
        f"      in Python: `from lmdbfolder.torch import LMDBFolder; ds = LMDBFolder({path!r}, transform=...)`"
    )


def _report_dry(args: argparse.Namespace, found: Any) -> None:
    """``pack --dry-run``: what the pack would hold; nothing was written."""
    classes = ""
    if found.classes:
        counts = found.class_counts
        shown = ", ".join(f"{printable(name, 60)} {n:,}" for name, n in list(counts.items())[:20])
        more = f", ... ({len(counts) - 20:,} more)" if len(counts) > 20 else ""
        classes = f" in {plural(len(found.classes), 'class', 'classes')} ({shown}{more})"
    print(f"dry run, nothing written: {found.src} ({found.layout}) holds {plural(found.files, 'file')}{classes}")
    if not found.checked:
        print("files not checked (--check none): every file would be packed as it is")
    elif found.would_skip:
        print(f"the check (--check {found.check}) would skip {plural(len(found.would_skip), 'file')}:")
        for path, reason in found.would_skip[:20]:
            print(_skipped_line(path, reason))
        if len(found.would_skip) > 20:
            print(f"  ... and {len(found.would_skip) - 20:,} more")
    else:
        print(f"the check (--check {found.check}) would skip no file")
    room = "" if found.estimated_upper_bytes < found.free_bytes else " (NOT enough: pack to another disk)"
    print(
        f"would pack {plural(found.would_pack, 'image')} into {found.dst}: about {megabytes(found.estimated_bytes)} "
        f"(at most {megabytes(found.estimated_upper_bytes)}); {megabytes(found.free_bytes)} free there{room}"
    )
    if found.dst_exists:
        print(f"note: {found.dst} {found.dst_note}")
    print(f"to pack: lmdbfolder pack {shlex.quote(args.src)} {shlex.quote(args.dst)} (the same options)")


def _is_sharded(path: str) -> bool:
    from lmdbfolder import packdir

    return packdir.inspect(path).kind is packdir.Kind.SHARDED


def _wants_shards(args: argparse.Namespace) -> bool:
    return any(v is not None for v in (args.shards, args.shard_size, args.shard_index, args.ray, args.staging))


def _report_sharded(args: argparse.Namespace, updating: bool, result: Any, kept_filters: str) -> None:
    """What a sharded pack (one shard of it, or its update) did."""
    if updating and result.already_packed:
        print(
            f"{result.path} is up to date with {args.src}: nothing to do "
            f"({plural(result.count, 'image')}){kept_filters}"
        )
        return
    if updating and result.changes is not None:
        rewritten = [s.name for s in result.shards if not s.kept]
        print(
            f"updated {result.path}: {result.changes.summary()} -> {plural(result.count, 'image')}; "
            f"{plural(len(rewritten), 'shard')} of {len(result.shards)} changed, "
            f"{plural(result.changes.read, 'file')} read ({megabytes(result.input_bytes)}) in {result.seconds:.1f} s"
            f"{kept_filters}"
        )
        _print_skipped(result.skipped, "each shard's skipped.txt")
        return
    if result.already_packed:
        shards = (
            f"shard {args.shard_index} of {result.path}"
            if args.shard_index is not None
            else f"{result.path} ({plural(len(result.shards), 'shard')})"
        )
        print(nothing_to_do(shards, plural(result.count, "image")))
        return
    _report_packed_shards(args, result)


def _report_packed_shards(args: argparse.Namespace, result: Any) -> None:
    """What a sharded pack (or one shard of it) wrote."""
    kept = sum(s.kept for s in result.shards)
    resumed = sum(1 for s in result.shards if s.resumed_from)
    notes = [f"{kept} already packed"] if kept else []
    notes += [f"{resumed} resumed"] if resumed else []
    note = f" ({', '.join(notes)})" if notes else ""
    speed = f"{result.images_per_second:,.0f} img/s, {result.mb_per_second:,.0f} MB/s"
    if args.shard_index is not None:
        shard = result.shards[0]
        print(
            f"packed shard {shard.index} of {args.shards}: {plural(shard.count, 'image')} into {shard.path}{note} "
            f"in {result.seconds:.1f} s, {speed}\n"
            f"when every shard is packed, run: lmdbfolder index {result.path}"
        )
    else:
        print(
            f"packed {plural(result.count, 'image')} into {result.path} as "
            f"{plural(len(result.shards), 'shard')}{note}: "
            f"{megabytes(result.input_bytes)} read in {result.seconds:.1f} s, {speed}"
        )
    _print_skipped(result.skipped, "each shard's skipped.txt")
    if args.shard_index is None:
        _print_next_steps(result.path)


def _print_skipped(skipped: Sequence[tuple[str, str]], listed_in: str, shown: int = 20) -> None:
    """The first ``shown`` skipped files and why, after a pack."""
    if not skipped:
        return
    print(f"skipped {plural(len(skipped), 'file')} (listed in {listed_in}):")
    for path, reason in skipped[:shown]:
        print(_skipped_line(path, reason))
    if len(skipped) > shown:
        print(f"  ... and {len(skipped) - shown:,} more")


def _skipped_line(path: str, reason: str) -> str:
    """One skipped file and why: file names are anyone's (escape sequences, newlines), so escaped."""
    return f"  {printable(path, 1000)}: {printable(reason)}"
