"""``lmdbfolder bench``: plain files against the pack on this machine (raw reads and the training pipeline)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from lmdbfolder.cli.common import EXIT_CODES, MAX_MESSAGE, count, positive_int, print_json, quality, usage
from lmdbfolder.errors import install_hint
from lmdbfolder.text import printable

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``bench`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "bench",
        help="measure plain files against the pack on this machine (raw reads and the training pipeline)",
        description="Compare torchvision's ImageFolder on SRC with LMDBFolder on PACKED (packed to a temporary "
        "folder if not given): raw reads and the training pipeline, page cache cold and warm, for several "
        "DataLoader worker counts, contestants alternated in one run. Prints a table, the ratios, and a "
        "recommendation; --json for the numbers, --chart for a PNG.",
    )
    p.add_argument("src", metavar="SRC", help="the ImageFolder tree (the plain files)")
    p.add_argument(
        "packed", metavar="PACKED", nargs="?", help="its pack (default: pack SRC into a temporary folder first)"
    )
    p.add_argument(
        "--workers", type=count, nargs="+", default=None, metavar="N", help="worker counts (default 0 1 .. CPUs)"
    )
    p.add_argument(
        "--limit",
        type=count,
        default=2000,
        metavar="N",
        help="images per training-pipeline run (default 2000; 0 = all)",
    )
    p.add_argument("--raw-limit", type=count, default=0, metavar="N", help="images per raw-read run (default 0 = all)")
    p.add_argument(
        "--repeat", type=positive_int, default=2, metavar="N", help="alternated runs per contestant (default 2)"
    )
    p.add_argument("--warm-only", action="store_true", help="skip the cold page-cache runs")
    p.add_argument(
        "--max-size", type=positive_int, default=None, metavar="N", help="also measure a pack resized to N px"
    )
    p.add_argument("--quality", type=quality, default=90, metavar="Q", help="JPEG quality of that pack (default 90)")
    p.add_argument("--raw", action="store_true", help="with --max-size: also measure a --store raw pack of that size")
    p.add_argument("--size", type=positive_int, default=224, metavar="PX", help="training resolution (default 224)")
    p.add_argument(
        "--batch-size", type=positive_int, default=64, metavar="N", help="DataLoader batch size (default 64)"
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
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder bench``: measure, then print the report (or JSON) and draw the chart."""
    from lmdbfolder.bench.chart import chart_available, chart_problem, write_chart
    from lmdbfolder.bench.run import BenchConfig, format_report, run_bench

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    problem = _device_problem(args.device)
    if problem:
        print(f"lmdbfolder bench: error: {problem}", file=sys.stderr)
        return 2
    draw = not args.no_chart and chart_available()
    # matplotlib adds .png to a name without a type: say the name it writes.
    png = os.path.abspath(os.path.expanduser(args.chart if os.path.splitext(args.chart)[1] else args.chart + ".png"))
    if draw:
        problem = chart_problem(args.chart) or chart_problem(png)  # a folder named as given, then the file
        if problem:
            return usage("bench", f"--chart {args.chart}: {problem} (or pass --no-chart)")
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
    chart = chart_error = None
    if draw:
        try:
            write_chart(result, png)
            chart = png
        # Whatever stops the drawing (a full disk, matplotlib), the measurements are
        # minutes of work: they are still printed below, and the exit code says it.
        except Exception as exc:  # noqa: BLE001
            chart_error = f"{type(exc).__name__}: {exc}"
    elif not args.no_chart:
        say("chart skipped: matplotlib is not installed (`pip install matplotlib`)")
    if args.json:
        print_json(dict(result.as_dict(), chart=chart))
    else:
        print()
        print(format_report(result))
        if chart:
            print(f"chart: {chart}")
    if chart_error is not None:
        text = printable(f"the chart {png} was not written ({chart_error})", MAX_MESSAGE)
        print(
            f"lmdbfolder bench: error: {text}\n  hint: the measurements above are complete; "
            "pass another --chart (or --no-chart) next time",
            file=sys.stderr,
        )
        return EXIT_CODES["other error"]
    return 0


def _device_problem(device: str | None) -> str | None:
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
