"""The ``lmdbfolder`` command line: pack, info, verify, show, export, import, index, copy, bench, warm, demo.

``main(argv) -> int`` is the whole interface: it parses, runs one subcommand
and turns every lmdbfolder error into one message on stderr and an exit code
(see EXIT_CODES). Usage errors (bad arguments, bad option values) are one
line and a hint, exit code 2. Errors name options by their flags
(``LmdbFolderError.text(cli=True)``). Subcommands import what they need when
they run, so ``lmdbfolder info`` never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from typing import Any, Callable, Sequence

from lmdbfolder._version import __version__
from lmdbfolder.errors import (
    LmdbFolderError,
    MissingDependencyError,
    NotAPackError,
    OptionError,
    OutputExistsError,
    PackError,
    SourceError,
    install_hint,
)
from lmdbfolder.format import SKIPPED_REPORT
from lmdbfolder.text import megabytes, plural

__all__ = ["main", "EXIT_CODES"]

#: Exit status of each outcome; documented in the README.
EXIT_CODES = {
    "ok": 0,
    "problems found": 1,
    "usage": 2,
    "not a pack": 3,
    "output exists": 4,
    "source error": 5,
    "pack failed": 6,
    "other error": 7,
    "missing dependency": 8,
    "interrupted": 130,
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and a hint (not the whole usage), exit code 2."""

    def error(self, message: str) -> Any:  # argparse's signature says NoReturn
        self.exit(EXIT_CODES["usage"], f"{self.prog}: error: {message}\n  hint: see `{self.prog} --help`\n")


def _exit_code(exc: LmdbFolderError) -> int:
    if isinstance(exc, MissingDependencyError):
        return EXIT_CODES["missing dependency"]
    if isinstance(exc, OptionError):
        return EXIT_CODES["usage"]
    if isinstance(exc, NotAPackError):
        return EXIT_CODES["not a pack"]
    if isinstance(exc, OutputExistsError):
        return EXIT_CODES["output exists"]
    if isinstance(exc, SourceError):
        return EXIT_CODES["source error"]
    if isinstance(exc, PackError):
        return EXIT_CODES["pack failed"]
    return EXIT_CODES["other error"]


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, ensure_ascii=False, default=str)
    sys.stdout.write("\n")


def _add_output_flags(p: argparse.ArgumentParser, json_help: str) -> None:
    p.add_argument("--no-progress", action="store_true", help="do not draw a progress bar")
    p.add_argument("--json", action="store_true", help=json_help)


def _progress(args: argparse.Namespace) -> bool | None:
    """No bar with --no-progress or --json; otherwise a bar on a terminal."""
    return False if args.no_progress or args.json else None


def _print_skipped(skipped: Sequence[tuple[str, str]], listed_in: str, shown: int = 20) -> None:
    """The first ``shown`` skipped files and why, after a pack."""
    if not skipped:
        return
    print(f"skipped {plural(len(skipped), 'file')} (listed in {listed_in}):")
    for path, reason in skipped[:shown]:
        print(f"  {path}: {reason}")
    if len(skipped) > shown:
        print(f"  ... and {len(skipped) - shown:,} more")


# -- pack ---------------------------------------------------------------------
def _add_pack(sub: Any) -> None:
    p = sub.add_parser(
        "pack",
        help="pack an image folder (or a list file) into an LMDB",
        description="Pack SRC into a new pack directory DST. SRC is an ImageFolder tree "
        "(SRC/<class>/**/<image>) unless --flat or --list says otherwise.",
    )
    p.add_argument("src", help="source folder (for --list: the folder the list's paths start from)")
    p.add_argument("dst", help="pack directory to create")
    layout = p.add_mutually_exclusive_group()
    layout.add_argument("--list", metavar="FILE", dest="list_file", help="read `relative/path label` lines from FILE")
    layout.add_argument("--flat", action="store_true", help="SRC is a folder of unlabelled images")
    p.add_argument(
        "--store",
        choices=("encoded", "raw"),
        default="encoded",
        help="encoded: keep the original file bytes (default); raw: decoded RGB pixels",
    )
    p.add_argument(
        "--check",
        choices=("header", "decode", "none"),
        default="header",
        help="how to check each source file: header (the header is read as Pillow reads it; default), "
        "decode (decode every image once), none (trust the files)",
    )
    p.add_argument(
        "--max-size",
        type=_positive_int,
        default=None,
        metavar="N",
        help="shrink images whose longer side (see --resize-side) is above N pixels and re-encode them "
        "as JPEG (--format webp: WebP; or raw pixels with --store raw); smaller images keep their bytes",
    )
    p.add_argument(
        "--quality",
        type=_quality,
        default=None,
        metavar="Q",
        help="JPEG (or WebP) quality of resized images, 1..100 (default 90)",
    )
    p.add_argument(
        "--format",
        choices=("jpeg", "webp"),
        default=None,
        dest="resize_format",
        help="with --max-size: re-encode resized images as jpeg (default) or webp",
    )
    p.add_argument(
        "--resize-side",
        choices=("longer", "shorter"),
        default="longer",
        help="which side --max-size limits (default: longer, like FFCV's max_resolution)",
    )
    p.add_argument("--strict", action="store_true", help="stop at the first bad file instead of skipping it")
    p.add_argument(
        "--commit-every", type=_positive_int, default=None, metavar="N", help="samples per transaction (default 2000)"
    )
    p.add_argument(
        "--commit-bytes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="bytes per transaction (default: 2 MB, more where the disk flushes slowly; at most 64 MB)",
    )
    p.add_argument(
        "--workers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="reader processes on Linux, else threads (default: 2x CPUs, at least 4; 1 reads in the writer)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing pack at DST")
    p.add_argument("--restart", action="store_true", help="discard an unfinished pack at DST instead of resuming it")
    p.add_argument("--allow-empty", action="store_true", help="keep class folders that hold no image")
    p.add_argument(
        "--extensions",
        type=_extension_list,
        default=None,
        metavar=".EXT,...",
        help="file endings to pack, case-insensitive (default: ImageFolder's .jpg,.jpeg,.png,.ppm,.bmp,.pgm,"
        ".tif,.tiff,.webp); recorded in the pack",
    )
    p.add_argument(
        "--match",
        default=None,
        metavar="REGEX",
        help="pack only files whose path relative to SRC contains a match of REGEX (Python re.search, / "
        "separators; e.g. '^(?!.*/rejected/)' leaves out every rejected/ folder); recorded in the pack",
    )
    p.add_argument("--no-space-check", action="store_true", help="do not refuse when the disk looks too small")
    _add_output_flags(p, "print the summary as JSON")
    _add_shard_options(p)
    p.set_defaults(run=_run_pack)


def _pack_options(args: argparse.Namespace) -> Any:
    """The PackOptions that ``pack``'s flags ask for (validated by PackOptions itself)."""
    from lmdbfolder.write.options import DEFAULT_COMMIT_EVERY, PackOptions, Resize

    resize = None
    if args.max_size is not None:
        quality = 90 if args.quality is None else args.quality
        resize = Resize(args.max_size, quality, args.resize_side, args.resize_format or "jpeg")
    elif args.quality is not None:
        raise OptionError("--quality needs --max-size")
    elif args.resize_format is not None:
        raise OptionError("--format needs --max-size (only resized images are re-encoded)")
    return PackOptions(
        store=args.store,
        check=args.check,
        strict=args.strict,
        commit_every=args.commit_every or DEFAULT_COMMIT_EVERY,
        commit_bytes=args.commit_bytes,
        workers=args.workers,
        overwrite=args.overwrite,
        restart=args.restart,
        space_check=not args.no_space_check,
        progress=_progress(args),
        resize=resize,
    )


def _source_args(args: argparse.Namespace) -> dict[str, Any]:
    """Where ``pack`` reads from: layout, list file, empty classes, file filters."""
    return dict(
        layout="flat" if args.flat else "imagefolder",
        list_file=args.list_file,
        allow_empty=args.allow_empty,
        extensions=args.extensions,
        match=args.match,
    )


def _extension_list(text: str) -> tuple[str, ...]:
    """``--extensions .jpg,.png`` (commas and/or spaces; the dot may be left out)."""
    names = [e.strip() for e in text.replace(",", " ").split()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one extension, e.g. --extensions .jpg,.png")
    return tuple(e if e.startswith(".") else "." + e for e in names)


def _run_pack(args: argparse.Namespace) -> int:
    from lmdbfolder.write.writer import pack

    options = _pack_options(args)
    if _wants_shards(args):
        return _run_pack_sharded(args, options)

    result = pack(args.src, args.dst, options, **_source_args(args))
    if args.json:
        _print_json(result.as_dict())
        return 0
    if result.already_packed:
        skipped = f", {plural(len(result.skipped), 'file')} skipped" if result.skipped else ""
        print(_nothing_to_do(result.path, plural(result.count, "image") + skipped))
        return 0
    resumed = f" (resumed after {plural(result.resumed_from, 'file')})" if result.resumed_from else ""
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
    return 0


def _nothing_to_do(path: str, what: str) -> str:
    return (
        f"{path} is already packed from this source with these options: nothing to do ({what}; "
        "--overwrite packs it again)"
    )


# -- pack: shards, a Slurm array, Ray ------------------------------------------------
def _add_shard_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shards and clusters")
    g.add_argument(
        "--shards",
        type=_positive_int,
        metavar="N",
        help="write N shards DST/<prefix>-00000-of-0000N.lmdb ... (a contiguous split) and DST/index.json",
    )
    g.add_argument(
        "--shard-size", metavar="SIZE", help="as many shards as needed for about SIZE each (4GB, 500MB, 2GiB)"
    )
    g.add_argument(
        "--shard-index",
        type=_count,
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


def _whole_number(text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    if high is not None and value > high:
        raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _whole_number(text, 1)


def _count(text: str) -> int:
    """A whole number of at least 0 (DataLoader workers, limits where 0 means all)."""
    return _whole_number(text, 0)


def _quality(text: str) -> int:
    return _whole_number(text, 1, 100)


def _wants_shards(args: argparse.Namespace) -> bool:
    return any(v is not None for v in (args.shards, args.shard_size, args.shard_index, args.ray, args.staging))


def _usage(command: str, message: str) -> int:
    print(f"lmdbfolder {command}: error: {message}\n  hint: see `lmdbfolder {command} --help`", file=sys.stderr)
    return EXIT_CODES["usage"]


def _run_pack_sharded(args: argparse.Namespace, options: Any) -> int:
    from lmdbfolder.write.shards import pack_sharded, parse_size

    if (args.shards is None) == (args.shard_size is None):
        return _usage("pack", "pass one of --shards N and --shard-size SIZE")
    if args.shard_index is not None and args.shards is None:
        return _usage("pack", "--shard-index needs --shards N (the same N for every job)")
    if args.shard_index is not None and args.ray is not None:
        return _usage("pack", "--ray packs every shard; do not combine it with --shard-index")
    if args.shard_index is not None and not 0 <= args.shard_index < args.shards:
        return _usage("pack", f"--shard-index must be in 0..{args.shards - 1}")
    if args.shards is not None and args.shards < 1:
        return _usage("pack", "--shards must be at least 1")
    if args.shard_size is not None:
        try:
            parse_size(args.shard_size)
        except ValueError as exc:
            return _usage("pack", str(exc))
    shard_args: dict[str, Any] = dict(
        shards=args.shards,
        shard_size=args.shard_size,
        prefix=args.shard_prefix,
        staging=args.staging,
        **_source_args(args),
    )
    if args.ray is not None:
        from lmdbfolder.write.ray import pack_ray

        result = pack_ray(args.src, args.dst, options, address=args.ray or None, task_cpus=args.task_cpus, **shard_args)
    else:
        result = pack_sharded(args.src, args.dst, options, shard_index=args.shard_index, **shard_args)
    if args.json:
        _print_json(result.as_dict())
        return 0
    if result.already_packed:
        shards = (
            f"shard {args.shard_index} of {result.path}"
            if args.shard_index is not None
            else f"{result.path} ({plural(len(result.shards), 'shard')})"
        )
        print(_nothing_to_do(shards, plural(result.count, "image")))
        return 0
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
    return 0


# -- index ----------------------------------------------------------------------
def _add_index(sub: Any) -> None:
    p = sub.add_parser(
        "index",
        help="write DST/index.json once every shard of a sharded pack is packed",
        description="Check the shards in DST (all present, finished, from one split) and write DST/index.json.",
    )
    p.add_argument("dst", help="the directory holding the shards")
    p.add_argument("--prefix", help="use the shards named PREFIX-* (when several splits share DST)")
    p.add_argument("--json", action="store_true", help="print the index as JSON")
    p.set_defaults(run=_run_index)


def _run_index(args: argparse.Namespace) -> int:
    from lmdbfolder.write.shards import write_index

    index = write_index(args.dst, prefix=args.prefix)
    if args.json:
        _print_json(index)
        return 0
    print(
        f"wrote {os.path.join(os.path.abspath(args.dst), 'index.json')}: {plural(index['count'], 'image')} "
        f"in {plural(index['num_shards'], 'shard')}, {plural(len(index['classes']), 'class', 'classes')}"
        + (f", {plural(index['skipped'], 'source file')} skipped" if index["skipped"] else "")
    )
    return 0


# -- copy -----------------------------------------------------------------------
def _add_copy(sub: Any) -> None:
    p = sub.add_parser(
        "copy",
        help="copy a pack (or sharded pack) safely: every page and record checked, compacted",
        description="Copy the pack SRC to the new path DST, compacted, reading every page and record "
        "checked (a damaged SRC is an error, never a crash); "
        "a sharded pack is copied shard by shard with its index. DST appears only when complete.",
    )
    p.add_argument("src", help="pack or sharded pack directory")
    p.add_argument("dst", help="path of the copy")
    p.add_argument("--overwrite", action="store_true", help="replace an existing pack at DST")
    p.add_argument("--verify", action="store_true", help="check every record of the copy before publishing it")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(run=_run_copy)


def _run_copy(args: argparse.Namespace) -> int:
    from lmdbfolder import packdir
    from lmdbfolder.tools.copy import copy_pack

    result = copy_pack(args.src, args.dst, overwrite=args.overwrite, verify=args.verify)
    if args.json:
        _print_json(result.as_dict())
        return 0
    shards = f" ({plural(result.shards, 'shard')})" if packdir.inspect(result.dst).kind is packdir.Kind.SHARDED else ""
    print(
        f"copied {plural(result.count, 'image')}{shards} to {result.dst} in {result.seconds:.1f} s: "
        f"{megabytes(result.bytes_before)} -> {megabytes(result.bytes_after)}" + (", verified" if args.verify else "")
    )
    return 0


# -- info ---------------------------------------------------------------------
def _add_info(sub: Any) -> None:
    p = sub.add_parser(
        "info",
        help="describe a pack (count, classes, size, encodings, version)",
        description="Describe the pack DST from its manifest: count, classes, store, encodings, size on disk, "
        "format version, source and skipped files.",
    )
    p.add_argument("pack", help="pack directory")
    p.add_argument(
        "--sizes",
        type=_count,
        default=None,
        metavar="N",
        help="read N evenly spaced record headers for the image sizes (default 10000; 0 = every record)",
    )
    p.add_argument("--no-sizes", action="store_true", help="leave out the image sizes (reads no record at all)")
    p.add_argument("--json", action="store_true", help="print JSON (every class's count included)")
    p.set_defaults(run=_run_info)


def _run_info(args: argparse.Namespace) -> int:
    from lmdbfolder.tools.info import DEFAULT_SIZE_SAMPLE, format_info, pack_info, pack_statistics

    info = pack_info(args.pack)
    sizes = -1 if args.no_sizes else (DEFAULT_SIZE_SAMPLE if args.sizes is None else args.sizes)
    stats = pack_statistics(info["path"], sizes=sizes)
    info.update({k: v for k, v in stats.items() if k not in ("path", "count", "encodings")})
    info["encoding_shares"] = {k: v["share"] for k, v in stats["encodings"].items()}
    if args.json:
        _print_json(info)
        return 0
    print(format_info(info))
    return 0


# -- verify -------------------------------------------------------------------
def _add_verify(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="check every record's checksum, the count and the keys",
        description="Check the pack DST: the manifest, the keys 0..count-1, every record's header, CRC-32 and "
        "label, and that every JPEG/PNG ends with its end marker; --decode also decodes every image, --against "
        "compares with the source files. Exit code 1 when a problem is found; each is named by record and path.",
    )
    p.add_argument("pack", help="pack directory")
    p.add_argument("--decode", action="store_true", help="also decode every image")
    p.add_argument("--against", metavar="SRC", help="compare with the source folder: same files, labels and bytes")
    p.add_argument("--list", metavar="FILE", dest="list_file", help="with --against: the list file to compare with")
    _add_output_flags(p, "print the report as JSON")
    p.set_defaults(run=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    from lmdbfolder.tools.verify import verify

    if args.list_file is not None and args.against is None:
        return _usage("verify", "--list FILE compares with a source and needs --against SRC")

    report = verify(
        args.pack,
        decode=args.decode,
        against=args.against,
        list_file=args.list_file,
        progress=_progress(args),
    )
    if args.json:
        _print_json(report.as_dict())
    else:
        for problem in report.problems:
            print(problem, file=sys.stderr)
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


# -- show -----------------------------------------------------------------------
def _add_show(sub: Any) -> None:
    p = sub.add_parser(
        "show",
        help="draw samples of a pack as a PNG contact sheet, to check it by eye",
        description="Write a PNG grid of samples of the pack DST, decoded as ImageFolder loads them, each "
        "captioned with its index and class: a few per class (default 4, a row per class), a random sample, "
        "or the given indices.",
    )
    p.add_argument("pack", help="pack directory")
    p.add_argument("-o", "--output", metavar="PNG", help="the sheet to write (default: <pack name>-sheet.png here)")
    choice = p.add_mutually_exclusive_group()
    choice.add_argument("--per-class", type=_positive_int, metavar="K", help="K samples of every class (default 4)")
    choice.add_argument("--random", type=_positive_int, metavar="N", help="N samples drawn at random")
    choice.add_argument("--indices", type=_count, nargs="+", metavar="I", help="these samples, in this order")
    p.add_argument("--size", type=_positive_int, default=128, metavar="PX", help="tile size in pixels (default 128)")
    p.add_argument("--seed", type=int, default=0, help="random seed for --random (default 0)")
    p.add_argument("--json", action="store_true", help="print where each tile is, as JSON")
    p.set_defaults(run=_run_show)


def _run_show(args: argparse.Namespace) -> int:
    from lmdbfolder import packdir
    from lmdbfolder.tools.show import contact_sheet

    found = packdir.require_pack(args.pack)
    output = args.output or f"{os.path.basename(found.path.rstrip(os.sep))}-sheet.png"
    result = contact_sheet(
        found.path,
        output,
        per_class=args.per_class,
        random=args.random,
        indices=args.indices,
        size=args.size,
        seed=args.seed,
    )
    if args.json:
        _print_json(result.as_dict())
        return 0
    print(
        f"wrote {result.path}: {plural(len(result.indices), 'sample')} of {found.path} in "
        f"{plural(result.rows, 'row')} of {plural(result.columns, 'tile')} ({result.size} px), "
        f"{result.width}x{result.height} px"
    )
    if result.undecodable:
        print(f"{plural(len(result.undecodable), 'sample')} did not decode (red tiles): {result.undecodable[:10]}")
    return 0


# -- export ---------------------------------------------------------------------
def _add_export(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a pack back out as files (byte for byte) or as WebDataset tar shards",
        description="Write the samples of the pack DST into the new directory OUT (it must not exist, or be "
        "empty). files: the tree the pack came from (ImageFolder tree, flat folder, or list file and files), "
        "each file byte for byte as packed, at its relative path (not for --store raw or --max-size packs). "
        "webdataset: tar shards of about --shard-size, members <key>.jpg/.png/... and <key>.cls, __key__ = "
        "the path without its extension, and classes.txt.",
    )
    p.add_argument("pack", help="pack directory")
    p.add_argument("out", help="new directory to write")
    p.add_argument("--format", choices=("files", "webdataset"), default="files", help="files (default) or webdataset")
    p.add_argument("--shard-size", default="1GB", metavar="SIZE", help="webdataset: bytes per tar shard (default 1GB)")
    _add_output_flags(p, "print the summary as JSON")
    p.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from lmdbfolder.tools.export import export
    from lmdbfolder.write.shards import parse_size

    try:
        parse_size(args.shard_size)
    except ValueError as exc:
        return _usage("export", f"--shard-size: {exc}")
    result = export(args.pack, args.out, format=args.format, shard_size=args.shard_size, progress=_progress(args))
    if args.json:
        _print_json(result.as_dict())
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


# -- import -------------------------------------------------------------------
def _add_import(sub: Any) -> None:
    p = sub.add_parser(
        "import",
        help="convert an LMDB made by a blog recipe (pickled samples, BasicSR arrays) into a pack",
        description="Convert OLD (folder2lmdb-style pickled (image_bytes, label) values with __len__/__keys__, "
        "or BasicSR-style images with meta_info.txt/.pkl) into the new pack NEW. Pickles are read "
        "with a restricted unpickler: nothing in OLD can run code.",
    )
    p.add_argument("old", help="the recipe's LMDB directory")
    p.add_argument("new", help="pack directory to create")
    p.add_argument(
        "--channel-order",
        choices=("bgr", "rgb"),
        default="bgr",
        help="channel order of raw arrays in OLD (default bgr, as OpenCV writes them); packs are RGB",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing pack at NEW")
    p.add_argument("--restart", action="store_true", help="discard an unfinished import instead of resuming it")
    _add_output_flags(p, "print the summary as JSON")
    p.set_defaults(run=_run_import)


def _run_import(args: argparse.Namespace) -> int:
    from lmdbfolder.tools.importing import import_legacy

    result = import_legacy(
        args.old,
        args.new,
        channel_order=args.channel_order,
        overwrite=args.overwrite,
        restart=args.restart,
        progress=_progress(args),
    )
    if args.json:
        _print_json(result.as_dict())
    else:
        if result.already_packed:
            print(_nothing_to_do(result.path, plural(result.count, "sample")))
            return 0
        print(
            f"imported {plural(result.count, 'sample')} ({result.store}) into {result.path} in {result.seconds:.1f} s"
        )
        for path, reason in result.skipped[:20]:
            print(f"  skipped {path}: {reason}")
    return 0


# -- demo ---------------------------------------------------------------------
def _add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="generate a small image dataset, pack it, verify it and compare it with plain files",
        description="The whole job on a generated dataset: make an ImageFolder tree of JPEGs, pack it, verify "
        "it, check that LMDBFolder returns what ImageFolder returns, and end with the `lmdbfolder bench` table. "
        "Everything goes to a temporary folder that is deleted at the end, unless --dir keeps it.",
    )
    p.add_argument("--dir", help="work folder to keep (default: a temporary folder, removed afterwards)")
    p.add_argument("--classes", type=_positive_int, default=10, help="number of classes (default 10)")
    p.add_argument("--per-class", type=_positive_int, default=100, help="images per class (default 100)")
    p.add_argument("--workers", type=_count, nargs="+", default=[0, 2], help="DataLoader worker counts (default 0 2)")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from lmdbfolder.bench.demo import run_demo

    out = sys.stderr if args.json else sys.stdout
    if args.dir is not None:
        workdir = os.path.abspath(args.dir)
        try:
            os.makedirs(workdir, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=workdir, prefix=".lmdbfolder-write-test-"):
                pass  # the folder is writable
        except OSError as exc:
            return _usage("demo", f"cannot use --dir {args.dir} as a work folder: {exc.strerror or exc}")
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


# -- bench --------------------------------------------------------------------
def _add_bench(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="measure plain files against the pack on this machine (raw reads and the training pipeline)",
        description="Compare torchvision's ImageFolder on SRC with LMDBFolder on PACKED (packed to a temporary "
        "folder if not given): raw reads and the training pipeline, page cache cold and warm, for several "
        "DataLoader worker counts, contestants alternated in one run. Prints a table, the ratios, and a "
        "recommendation; --json for the numbers, --chart for a PNG.",
    )
    p.add_argument("src", help="the ImageFolder tree (the plain files)")
    p.add_argument("packed", nargs="?", help="its pack (default: pack SRC into a temporary folder first)")
    p.add_argument(
        "--workers", type=_count, nargs="+", default=None, metavar="N", help="worker counts (default 0 1 .. CPUs)"
    )
    p.add_argument(
        "--limit",
        type=_count,
        default=2000,
        metavar="N",
        help="images per training-pipeline run (default 2000; 0 = all)",
    )
    p.add_argument("--raw-limit", type=_count, default=0, metavar="N", help="images per raw-read run (default 0 = all)")
    p.add_argument(
        "--repeat", type=_positive_int, default=2, metavar="N", help="alternated runs per contestant (default 2)"
    )
    p.add_argument("--warm-only", action="store_true", help="skip the cold page-cache runs")
    p.add_argument(
        "--max-size", type=_positive_int, default=None, metavar="N", help="also measure a pack resized to N px"
    )
    p.add_argument("--quality", type=_quality, default=90, metavar="Q", help="JPEG quality of that pack (default 90)")
    p.add_argument("--raw", action="store_true", help="with --max-size: also measure a --store raw pack of that size")
    p.add_argument("--size", type=_positive_int, default=224, metavar="PX", help="training resolution (default 224)")
    p.add_argument(
        "--batch-size", type=_positive_int, default=64, metavar="N", help="DataLoader batch size (default 64)"
    )
    p.add_argument(
        "--device",
        default=None,
        metavar="DEV",
        help="also measure the GPU batch path (workers ship bytes, DEV decodes + crops + flips): cuda, cuda:N, "
        "or cpu (the same code on the CPU)",
    )
    p.add_argument("--chart", default="lmdbfolder-bench.png", metavar="PNG", help="chart file (default %(default)s)")
    p.add_argument("--no-chart", action="store_true", help="do not draw the chart")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON (progress goes to stderr)")
    p.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from lmdbfolder.bench.chart import chart_available, write_chart
    from lmdbfolder.bench.run import BenchConfig, format_report, run_bench

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    problem = _bench_device_problem(args.device)
    if problem:
        print(f"lmdbfolder bench: error: {problem}", file=sys.stderr)
        return 2
    cpus = os.cpu_count() or 1
    cfg = BenchConfig(
        src=args.src,
        packed=args.packed,
        workers=args.workers or list(range(cpus + 1)),
        limit=args.limit,
        raw_limit=args.raw_limit,
        repeat=max(1, args.repeat),
        cold=not args.warm_only,
        max_size=args.max_size,
        max_size_raw=args.raw,
        quality=args.quality,
        size=args.size,
        batch_size=max(1, args.batch_size),
        device=args.device,
        progress=False if args.json else None,
        say=say,
    )
    result = run_bench(cfg)
    chart = None
    if not args.no_chart:
        if chart_available():
            write_chart(result, args.chart)
            chart = os.path.abspath(args.chart)
        else:
            say("chart skipped: matplotlib is not installed (`pip install matplotlib`)")
    if args.json:
        _print_json(dict(result.as_dict(), chart=chart))
    else:
        print()
        print(format_report(result))
        if chart:
            print(f"chart: {chart}")
    return 0


def _bench_device_problem(device: str | None) -> str | None:
    """Why ``bench --device`` cannot run here (None if it can)."""
    if device is None:
        return None
    try:
        import torch
        import torchvision  # noqa: F401
    except ImportError:
        return "--device needs torch and torchvision; " + install_hint("torch", "torch and torchvision")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"--device {device!r} is not a torch device; use cuda, cuda:N or cpu"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return "--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False); use --device cpu"
    if dev.type not in ("cuda", "cpu"):
        return f"--device {device!r}: the GPU path decodes on cuda (or cpu) only"
    return None


# -- warm ---------------------------------------------------------------------
def _add_warm(sub: Any) -> None:
    p = sub.add_parser(
        "warm",
        help="read a pack once so that it is in the page cache (before training)",
        description="Read data.mdb of the pack DST (every shard's, for a sharded pack) once, sequentially, so "
        "that training reads it from memory; says how much of it the page cache held before and after.",
    )
    p.add_argument("pack", help="pack directory")
    _add_output_flags(p, "print the summary as JSON")
    p.set_defaults(run=_run_warm)


def _run_warm(args: argparse.Namespace) -> int:
    from lmdbfolder.tools.cache import warm

    report = warm(args.pack, progress=_progress(args))
    if args.json:
        _print_json(report.as_dict())
        return 0

    def pct(x: float | None) -> str:
        return "unknown" if x is None else f"{x:.0%}"

    print(
        f"{report.path}: read {megabytes(report.nbytes)} in {report.seconds:.1f} s ({report.mb_per_second:,.0f} MB/s); "
        f"in the page cache before {pct(report.resident_before)}, after {pct(report.resident_after)}"
    )
    if report.mem_available is not None and report.nbytes > report.mem_available:
        print(
            f"warning: the pack ({megabytes(report.nbytes)}) is larger than the available memory "
            f"({megabytes(report.mem_available)}); only part of it can stay cached",
            file=sys.stderr,
        )
    return 0


# -- main -----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``lmdbfolder`` command."""
    parser = _Parser(
        prog="lmdbfolder",
        description="Pack image datasets into LMDB and read them from PyTorch as an ImageFolder.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"lmdbfolder {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (
        _add_pack,
        _add_info,
        _add_verify,
        _add_show,
        _add_export,
        _add_import,
        _add_index,
        _add_copy,
        _add_bench,
        _add_warm,
        _add_demo,
    ):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lmdbfolder`` command with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help, --version and usage errors
        return int(exc.code or 0)
    run: Callable[[argparse.Namespace], int] = args.run
    previous = _terminate_as_interrupt()
    try:
        return run(args)
    except LmdbFolderError as exc:
        text = exc.text(cli=True).replace("`lmdbfolder COMMAND ", f"`lmdbfolder {args.command} ")
        print(f"lmdbfolder {args.command}: error: {text}", file=sys.stderr)
        return _exit_code(exc)
    except KeyboardInterrupt:
        hint = "; run the same command again to resume" if args.command == "pack" else ""
        print(f"lmdbfolder {args.command}: interrupted{hint}", file=sys.stderr)
        return EXIT_CODES["interrupted"]
    except BrokenPipeError:
        # Output piped into `head` and the like: not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _terminate_as_interrupt() -> Any:
    """Treat SIGTERM like Ctrl-C (only possible in the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:
        return None
