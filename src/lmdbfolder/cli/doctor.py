"""``lmdbfolder doctor``: which accelerations are active in this installation, and what to install.

``lmdbfolder doctor [DST] --transform SPEC`` also says whether a training script's
transform gets a fast path from a pack, and why not when it does not (the same
sentence ``repr(dataset)`` prints), once, instead of a warning per sample.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from typing import Any

from lmdbfolder.cli.common import print_json

__all__ = ["add_parser", "run", "load_transform"]


def add_parser(sub: Any) -> None:
    """Add ``doctor`` and its flags to the subcommands ``sub``."""
    p = sub.add_parser(
        "doctor",
        help="say which accelerations are active here (compiled crop decoder, JPEG decoders) and what to install",
        description="Check this installation as the read path does: the compiled crop decoder (region decoding, "
        "the exact resize), each JPEG decoder and whether it gives Pillow's pixels, the one decoder='auto' picks, "
        "the checksum implementation and the optional libraries; then say what would make reading faster here. "
        "With --transform: whether that transform gets a fast path (on the pack DST, when given), or why not.",
    )
    p.add_argument("pack", nargs="?", metavar="DST", help="a pack to open with --transform (optional)")
    p.add_argument(
        "--transform",
        metavar="MODULE:NAME[(ARGS)]",
        help="a transform to check, imported from MODULE (the current folder is searched first): NAME an object, "
        "or a class or function called with ARGS (Python literals only), e.g. "
        "'main_dino:DataAugmentationDINO((0.4, 1.0), (0.05, 0.4), 8)' or "
        "'lmdbfolder.fused:MultiCrop.dino()'",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def load_transform(spec: str) -> Any:
    """The transform ``spec`` names: ``MODULE:NAME`` (an object; NAME may be dotted) or
    ``MODULE:NAME(ARGS)`` (NAME called with ARGS, which must be Python literals: nothing
    else is evaluated). Raises OptionError for a spec it cannot read or find."""
    from lmdbfolder.errors import OptionError

    module_name, sep, rest = spec.partition(":")
    if not sep or not module_name or not rest:
        raise OptionError(f"--transform {spec!r}: expected MODULE:NAME or MODULE:NAME(ARGS)")
    name, paren, tail = rest.partition("(")
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    if paren:
        if not tail.endswith(")"):
            raise OptionError(f"--transform {spec!r}: the arguments do not end with ')'")
        try:
            call = ast.parse(f"f({tail}", mode="eval").body
            if not isinstance(call, ast.Call):
                raise ValueError("not a call")
            args = tuple(ast.literal_eval(a) for a in call.args)
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
        except (SyntaxError, ValueError) as exc:
            raise OptionError(f"--transform {spec!r}: the arguments must be Python literals ({exc})") from exc
    if "" not in sys.path:
        sys.path.insert(0, "")  # the training script's folder, as `python -c` would see it
    try:
        obj: Any = importlib.import_module(module_name)
        for part in name.strip().split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise OptionError(f"--transform {spec!r}: {exc}", hint="run it from the folder of the training script") from exc
    return obj(*args, **kwargs) if paren else obj


def transform_report(spec: str, pack: str | None) -> dict[str, Any]:
    """What ``--transform`` reports: the transform, whether it gets a fast path and why."""
    from lmdbfolder.fused import fast_path

    transform = load_transform(spec)
    size_hint = None
    if pack is not None:
        from lmdbfolder.torch import LMDBFolder

        ds = LMDBFolder(pack, transform=transform)
        size_hint = ds.size_hint
    fast, why = fast_path(transform, size_hint=size_hint)
    return {"spec": spec, "pack": pack, "fast_path": fast, "why": why}


def run(args: argparse.Namespace) -> int:
    """``lmdbfolder doctor``: the report (exit code 0 whatever it finds)."""
    from lmdbfolder.tools.doctor import format_report, system_report

    report = system_report()
    checked = transform_report(args.transform, args.pack) if args.transform else None
    if args.json:
        if checked is not None:
            report["transform"] = checked
        print_json(report)
        return 0
    print(format_report(report))
    if checked is not None:
        print(f"\ntransform {checked['spec']}" + (f" on {checked['pack']}" if checked["pack"] else "") + ":")
        print(f"  {checked['why']}")
    return 0
