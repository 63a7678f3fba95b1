"""Image pairs at an integer scale: BasicSR's GT and LQ folders (``PairedImageDataset``).

BasicSR pairs folders in ``basicsr/data/data_util.py`` ``paired_paths_from_folder`` (lines
200-233 at XPixelGroup/BasicSR 8d56e3a): ``scandir`` lists each folder's files, not recursively,
names starting with ``.`` left out (``basicsr/utils/misc.py`` lines 52-91, ``os.scandir`` order);
for each GT file ``basename, ext = splitext(name)``, its LQ partner is
``filename_tmpl.format(basename) + ext`` (``filename_tmpl`` defaults to ``'{}'``; DIV2K's bicubic
LQ files are ``'{}x4'``); the samples are in the GT folder's order. BasicSR asserts that both
folders hold as many files and that each partner exists; here a GT file without its LQ (or an LQ
file no GT file names) is skipped and listed instead, and so is a pair whose GT is not exactly
``scale`` times its LQ in both dimensions (``paired_random_crop`` refuses it at training time).

Fields: ``lq`` and ``gt`` (images, the files' bytes); ``layout_info["scale"]``.
"""

from __future__ import annotations

import os

from lmdbfolder.errors import OptionError, SourceNotFoundError
from lmdbfolder.format.fields import FieldSpec
from lmdbfolder.write.fields import FieldSamples
from lmdbfolder.write.layouts._common import file_samples, list_files, unsafe_name

__all__ = ["scan_pairs", "PAIR_FIELDS", "GT_DIRS", "LQ_DIRS", "check_scale", "check_filename_tmpl"]

PAIR_FIELDS = (FieldSpec("lq", "image"), FieldSpec("gt", "image"))
#: The folder names looked for under SRC when --gt-dir / --lq-dir are not given (first found).
GT_DIRS = ("GT", "gt", "HR", "hr")
LQ_DIRS = ("LQ", "lq", "LR", "lr")
#: The largest scale taken (BasicSR's models go to x8; x16 at most in practice).
MAX_SCALE = 64


def check_scale(scale: object) -> int:
    """``scale`` as a positive integer; OptionError otherwise (also when it is missing)."""
    if scale is None:
        raise OptionError("the pairs layout needs the scale of GT to LQ: --scale N (e.g. --scale 4)")
    if isinstance(scale, bool) or not isinstance(scale, int) or not 1 <= scale <= MAX_SCALE:
        raise OptionError(f"--scale must be a whole number in 1..{MAX_SCALE}, got {scale!r}")
    return scale


def check_filename_tmpl(tmpl: str) -> str:
    """BasicSR's ``filename_tmpl``: one ``{}`` (the GT file's name without its ending) and no
    folder separator; OptionError otherwise."""
    rest = tmpl.replace("{}", "", 1) if isinstance(tmpl, str) else "{"
    if "{" in rest or "}" in rest or "/" in rest or "\\" in rest or rest == tmpl:
        raise OptionError(
            f"--filename-tmpl must be a file name pattern with one {{}} (the GT name) and no folder, "
            f"like '{{}}x4'; got {str(tmpl)[:100]!r}"
        )
    return tmpl


def _pick(src: str, given: str | None, names: tuple[str, ...], flag: str) -> str:
    """The GT or LQ folder, relative to ``src``: ``given`` (checked) or the first of ``names`` there."""
    if given is not None:
        problem = unsafe_name(given)
        if problem is not None:
            raise OptionError(f"{flag} must be a folder inside SRC: {problem}")
        if not os.path.isdir(os.path.join(src, given)):
            raise SourceNotFoundError(
                os.path.join(src, given), f"no folder here (given as {flag})", f"pass {flag} relative to SRC"
            )
        return given.replace("\\", "/").strip("/")
    for name in names:
        if os.path.isdir(os.path.join(src, name)):
            return name
    raise SourceNotFoundError(
        src,
        f"no {'/'.join(names)} folder here",
        f"pass the folder with {flag} (relative to SRC), "
        "e.g. --gt-dir DIV2K_train_HR --lq-dir DIV2K_train_LR_bicubic/X4",
    )


def scan_pairs(
    src: str,
    scale: object,
    *,
    gt_dir: str | None = None,
    lq_dir: str | None = None,
    filename_tmpl: str = "{}",
) -> FieldSamples:
    """The (LQ, GT) pairs of ``src``'s GT and LQ folders, in BasicSR's order (module docstring)."""
    s = check_scale(scale)
    tmpl = check_filename_tmpl(filename_tmpl)
    root = os.path.abspath(src)
    if not os.path.isdir(root):
        raise SourceNotFoundError(root, "no folder here", "pass the folder holding the GT and LQ folders as SRC")
    gt = _pick(root, gt_dir, GT_DIRS, "--gt-dir")
    lq = _pick(root, lq_dir, LQ_DIRS, "--lq-dir")
    # basicsr.utils.scandir: files only, no names starting with '.', os.scandir order.
    gt_files = {n: size for n, size in list_files(os.path.join(root, gt)).items() if not n.startswith(".")}
    lq_files = {n: size for n, size in list_files(os.path.join(root, lq)).items() if not n.startswith(".")}
    field_paths: list[tuple[str, ...]] = []
    skipped: list[tuple[str, str]] = []
    used: set[str] = set()
    total = 0
    for name, size in gt_files.items():
        basename, ext = os.path.splitext(name)
        lq_name = f"{tmpl.format(basename)}{ext}"
        if lq_name not in lq_files:
            skipped.append((f"{gt}/{name}", f"a GT image without its LQ ({lq}/{lq_name} is missing)"))
            continue
        used.add(lq_name)
        field_paths.append((f"{lq}/{lq_name}", f"{gt}/{name}"))
        total += size + lq_files[lq_name]
    for name in lq_files:
        if name not in used:
            skipped.append((f"{lq}/{name}", "an LQ image that no GT image names"))
    return file_samples(
        "pairs",
        root,
        PAIR_FIELDS,
        field_paths,
        skipped,
        {"scale": s, "gt_dir": gt, "lq_dir": lq, "filename_tmpl": tmpl},
        total,
        scale=s,
    )
