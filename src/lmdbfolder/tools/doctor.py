"""``lmdbfolder doctor``: which accelerations are active in this installation, and what to install.

Every answer comes from the process's capabilities snapshot
(``lmdbfolder.read.capabilities``), the same one the read path decides with:
the compiled crop decoder (region decoding and the exact resize), each JPEG
decoder and whether it gives Pillow's pixels, which one ``decoder="auto"``
picks; then the checksum implementation and the optional libraries. Nothing
is changed; ``advice`` lists what would make reading faster here, each with
the command that installs it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
from typing import Any

from lmdbfolder._version import __version__
from lmdbfolder.errors import DecoderUnavailableError
from lmdbfolder.format import CRC32_IMPLEMENTATION
from lmdbfolder.read import decoders
from lmdbfolder.read.capabilities import Capabilities, current

__all__ = ["system_report", "format_report", "BUILD_HINT"]

#: How to get the compiled crop decoder built (it is compiled when lmdbfolder is installed).
BUILD_HINT = (
    "install a C compiler and the libjpeg headers (Debian/Ubuntu: `sudo apt-get install build-essential "
    "libjpeg-dev`, or `make system-deps` in the source folder), then install lmdbfolder again from its "
    "source folder (`pip install --force-reinstall --no-deps .`, or `make clean test`)"
)

#: The optional libraries reported: name -> the distributions that provide it.
_LIBRARIES = {
    "torch": ("torch",),
    "torchvision": ("torchvision",),
    "simplejpeg": ("simplejpeg",),
    "opencv": ("opencv-python-headless", "opencv-python", "opencv-contrib-python", "opencv-contrib-python-headless"),
    "PyTurboJPEG": ("PyTurboJPEG",),
    "zlib-ng": ("zlib-ng",),
    "matplotlib": ("matplotlib",),
    "ray": ("ray",),
    "torchdata": ("torchdata",),
}


def _version(dists: tuple[str, ...]) -> str | None:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _exact_simd(module: Any) -> str | None:
    """The vectors the compiled exact resize uses here (None from a build that cannot say)."""
    ask = getattr(module, "exact_simd", None)
    return str(ask()) if ask is not None else None


def system_report(caps: Capabilities | None = None) -> dict[str, Any]:
    """What this installation can do (``lmdbfolder doctor --json``).

    Keys: ``lmdbfolder``, ``python``, ``platform``; ``compiled`` (the crop
    decoder: ``built``, ``region_decoding``, ``exact_resize``, ``exact_resize_simd``
    (the vectors its passes use: ``avx512-vbmi``, ``avx2``, ``sse4.1``, ``none``) and why
    region decoding is off); ``decoders`` (name -> ``available``, ``matches_pillow``,
    ``why_not``); ``auto_decoder``; ``checksums``; ``libraries`` (name ->
    version or None); ``cuda`` (None without torch); ``advice`` (what to
    install, one line each; empty when everything that speeds up reading is
    active).
    """
    caps = caps or current()
    module = caps.compiled()
    regions_off = caps.why_no_regions()
    exact = caps.exact_resize()
    compiled = {
        "built": module is not None,
        "path": getattr(module, "__file__", None),
        "region_decoding": regions_off is None,
        "region_decoding_off_because": regions_off,
        "exact_resize": exact is not None,
        "exact_resize_simd": _exact_simd(module) if exact is not None else None,
    }
    found: dict[str, dict[str, Any]] = {}
    for name in decoders.DECODER_NAMES:
        try:
            dec = caps.decoder(name)
        except DecoderUnavailableError as exc:
            found[name] = {"available": False, "matches_pillow": False, "why_not": exc.why}
            continue
        same = name == "pillow" or caps.decodes_like_pillow(dec)
        found[name] = {"available": True, "matches_pillow": same, "why_not": None}
    report: dict[str, Any] = {
        "lmdbfolder": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "compiled": compiled,
        "decoders": found,
        "auto_decoder": caps.auto_decoder(),
        "checksums": CRC32_IMPLEMENTATION,
        "libraries": {name: _version(dists) for name, dists in _LIBRARIES.items()},
        "cuda": _cuda(),
    }
    report["advice"] = _advice(report, caps)
    return report


def _cuda() -> dict[str, Any] | None:
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch

        available = bool(torch.cuda.is_available())
        name = torch.cuda.get_device_name(0) if available else None
    except Exception as exc:  # a broken CUDA install: say so, it is what the user asked about
        return {"available": False, "device": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"available": available, "device": name}


def _advice(report: dict[str, Any], caps: Capabilities) -> list[str]:
    out = []
    compiled = report["compiled"]
    if not compiled["built"]:
        out.append(
            "the compiled crop decoder is not built, so crops are decoded whole and resized by Pillow (the same "
            f"pixels, about 20% slower): {BUILD_HINT}"
        )
    elif not caps.regions_switch:
        out.append("region decoding is switched off by LMDBFOLDER_REGIONS=0 in the environment: unset it")
    if report["auto_decoder"] == "pillow":
        out.append(
            "no JPEG decoder faster than Pillow is installed (or none gives Pillow's pixels here): "
            '`pip install simplejpeg` (or `pip install ".[fast]"` in the source folder)'
        )
    if report["checksums"] != "zlib-ng":
        out.append("checksums use zlib, 5-10x slower than zlib-ng: `pip install zlib-ng`")
    libs = report["libraries"]
    if libs["torch"] is None or libs["torchvision"] is None:
        out.append('PyTorch is not installed, so LMDBFolder is unavailable: `pip install ".[torch]"`')
    return out


def format_report(report: dict[str, Any]) -> str:
    """The text of ``lmdbfolder doctor``."""
    c = report["compiled"]
    lines = [
        f"lmdbfolder {report['lmdbfolder']}, Python {report['python']}, {report['platform']}",
        "compiled crop decoder (lmdbfolder.read._crops): " + ("built" if c["built"] else "NOT built"),
        "  region decoding (only the crop's rows and columns): "
        + ("on" if c["region_decoding"] else f"off ({c['region_decoding_off_because']})"),
        "  exact resize into the batch (Pillow's bilinear, compiled): "
        + (
            ("on" + (f" ({c['exact_resize_simd']})" if c.get("exact_resize_simd") else ""))
            if c["exact_resize"]
            else "off (Pillow resizes)"
        ),
    ]
    parts = []
    for name, d in report["decoders"].items():
        if not d["available"]:
            parts.append(f"{name}: no ({d['why_not']})")
        else:
            parts.append(f"{name}: yes" + ("" if d["matches_pillow"] else " (pixels differ from Pillow's: not used)"))
    lines.append("JPEG decoders: " + "; ".join(parts))
    lines.append(f"  decoder='auto' (LMDBFolder's default) uses: {report['auto_decoder']}")
    lines.append(f"checksums: {report['checksums']}")
    libs = report["libraries"]
    lines.append(
        "libraries: " + ", ".join(f"{name} {v}" if v else f"{name} (not installed)" for name, v in libs.items())
    )
    cuda = report["cuda"]
    if cuda is not None:
        lines.append(
            "CUDA: "
            + (f"available ({cuda['device']})" if cuda["available"] else "not available")
            + (f" ({cuda['error']})" if cuda.get("error") else "")
        )
    if report["advice"]:
        lines.append("to read faster here:")
        lines += [f"  - {a}" for a in report["advice"]]
    else:
        lines.append("everything that speeds up reading is active here")
    return "\n".join(lines)
