"""What this process can do, each question answered once: the one capabilities snapshot.

The read path depends on facts about the machine that cost time to find out
and never change while a process runs: which JPEG decoders are installed and
give Pillow's pixels, whether the compiled ``lmdbfolder.read._crops`` is built
and its region decode and resize reproduce the installed Pillow, which of its
two passes Pillow's resize runs first, whether OpenCV is there, what
``LMDBFOLDER_REGIONS`` says. ``Capabilities`` answers each of those questions
the first time it is asked (so opening a pack pays for none of them) and then
from memory; ``current()`` is this process's snapshot. As py-lmdb picks its
implementation once at import, the read plan (``lmdbfolder.read.plan``) takes
its answers from here once per dataset and process, and the per-image path
asks nothing (``questions`` counts the questions asked, for the test that says
so).

A forked child inherits the parent's snapshot (the same libraries, the same
environment); a spawned one makes its own. The layers above ask their own
once-per-process questions through ``answer(key, probe)`` (the torch layer's
"do our random draws equal torchvision's").

Tests replace the snapshot with ``install(Capabilities(...))``, giving answers
up front (``Capabilities(compiled=None)``: as if the module were not built);
``tests/conftest.py`` has the fixture.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from lmdbfolder.errors import DecoderUnavailableError
from lmdbfolder.read import crops, decoders, regions
from lmdbfolder.read.decoders import FAST_ORDER, Decoder

__all__ = [
    "Capabilities",
    "current",
    "install",
    "get_decoder",
    "resolve_decoder_name",
    "matches_pillow",
    "available_decoders",
]

T = TypeVar("T")
_MISSING = object()


class Capabilities:
    """One process's answers: each question asked at most once, then remembered.

    Args:
        environ: where ``LMDBFOLDER_REGIONS`` is read (default ``os.environ``), once, here.
        **answers: answers given up front instead of found out (tests): keys are
            the method names below (``compiled``, ``region_decoder``,
            ``exact_resize``, ``pillow_pass_order``, ``cv2``, ``probe_jpegs``)
            and ``"decoder:NAME"`` / ``"matches:NAME"`` for one decoder.
    """

    def __init__(self, environ: Mapping[str, str] | None = None, **answers: Any) -> None:
        env = os.environ if environ is None else environ
        #: Whether ``LMDBFOLDER_REGIONS`` leaves region decoding on.
        self.regions_switch = env.get(regions.ENV_SWITCH, "1") != "0"
        self._answers: dict[str, Any] = dict(answers)
        #: How many questions were asked (answered from memory or not).
        self.questions = 0

    def answer(self, key: str, probe: Callable[[], T]) -> T:
        """The answer to ``key``, found by ``probe()`` the first time it is asked."""
        self.questions += 1
        found = self._answers.get(key, _MISSING)
        if found is _MISSING:
            found = self._answers[key] = probe()
        return found  # type: ignore[return-value]

    # -- the compiled module -------------------------------------------------------------
    def compiled(self) -> ModuleType | None:
        """``lmdbfolder.read._crops``, or None where it was not built."""
        return self.answer("compiled", _import_compiled)

    def probe_jpegs(self) -> list[tuple[bytes, np.ndarray]]:
        """The probe JPEGs and Pillow's pixels of each (``decoders.probe_jpegs``)."""
        return self.answer("probe_jpegs", decoders.probe_jpegs)

    def region_decoder(self) -> Callable[..., tuple[int, int]] | None:
        """The compiled region decoder where it may be used here: built, not switched
        off, and its regions of every probe JPEG are Pillow's (``regions``)."""
        return self.answer("region_decoder", self._find_region_decoder)

    def _find_region_decoder(self) -> Callable[..., tuple[int, int]] | None:
        module = self.compiled()
        if not self.regions_switch or module is None:
            return None
        helper = module.decode_region
        return helper if regions.matches_pillow(helper, self.probe_jpegs()) else None

    def why_no_regions(self) -> str | None:
        """None when crops are decoded by region here, else why not (one line)."""
        if not self.regions_switch:
            return f"{regions.ENV_SWITCH}=0 in the environment"
        if self.compiled() is None:
            return (
                "the compiled helper lmdbfolder.read._crops is not built (it needs a C compiler and the "
                "libjpeg headers at install time: apt-get install libjpeg-dev, then reinstall lmdbfolder)"
            )
        if self.region_decoder() is None:
            return "the helper's regions differ from Pillow's full decode here (checked on probe JPEGs)"
        return None

    def pillow_pass_order(self) -> int | None:
        """The installed Pillow's resize pass order (``crops.pillow_pass_order``)."""
        return self.answer("pillow_pass_order", crops.pillow_pass_order)

    def exact_resize(self) -> tuple[Callable[..., None], int] | None:
        """``(compiled resize, pass order)`` where they reproduce the installed Pillow's
        bilinear resize here (``crops.native_matches_pillow``), else None."""
        return self.answer("exact_resize", self._find_exact_resize)

    def _find_exact_resize(self) -> tuple[Callable[..., None], int] | None:
        module = self.compiled()
        order = self.pillow_pass_order()
        if module is None or order is None:
            return None
        fn = module.resize_bilinear
        return (fn, order) if crops.native_matches_pillow(fn, order) else None

    def exact_bicubic(self) -> tuple[Callable[..., None], int] | None:
        """``(compiled resize, pass order)`` where its ``cubic`` mode reproduces the
        installed Pillow's bicubic resize here (``crops.native_matches_pillow``), else None."""
        return self.answer("exact_bicubic", self._find_exact_bicubic)

    def _find_exact_bicubic(self) -> tuple[Callable[..., None], int] | None:
        module = self.compiled()
        order = self.pillow_pass_order()
        if module is None or order is None:
            return None
        fn = module.resize_bilinear
        return (fn, order) if crops.native_matches_pillow(fn, order, cubic=True) else None

    def native_resize(self) -> ModuleType | None:
        """The compiled module where ``resize="native"`` can run (built, with its
        batch maker), else None."""
        module = self.compiled()
        return module if module is not None and hasattr(module, "Batch") else None

    def cv2(self) -> Any:
        """OpenCV, limited to one thread, or None where it is not installed."""
        return self.answer("cv2", _import_cv2)

    # -- JPEG decoders ----------------------------------------------------------------------
    def decoder(self, name: str) -> Decoder:
        """The decoder called ``name`` (``"auto"``: see ``auto_decoder``), made once.

        Raises ValueError for an unknown name and DecoderUnavailableError (with
        the install command as its hint) when the library is not installed.
        """
        name = self.decoder_name(name)
        found = self.answer(f"decoder:{name}", lambda: _made(name))
        if isinstance(found, DecoderUnavailableError):
            raise found
        return found

    def decodes_like_pillow(self, decoder: Decoder) -> bool:
        """Whether ``decoder`` gives exactly Pillow's pixels on the probe JPEGs."""
        return self.answer(f"matches:{decoder.name}", lambda: decoders.decodes_like_pillow(decoder, self.probe_jpegs()))

    def auto_decoder(self) -> str:
        """The first decoder of ``FAST_ORDER`` that is installed and gives Pillow's pixels."""
        return self.answer("auto", self._find_auto)

    def _find_auto(self) -> str:
        for candidate in FAST_ORDER:
            try:
                dec = self.decoder(candidate)
            except DecoderUnavailableError:
                continue
            if candidate == "pillow" or self.decodes_like_pillow(dec):
                return candidate
        return "pillow"

    def decoder_name(self, name: str) -> str:
        """``name`` itself (checked), or for ``"auto"`` the ``auto_decoder``."""
        decoders.check_decoder_name(name)
        return self.auto_decoder() if name == "auto" else name


def _import_compiled() -> ModuleType | None:
    try:
        from lmdbfolder.read import _crops  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _crops  # type: ignore[no-any-return]


def _import_cv2() -> Any:
    try:
        import cv2
    except ImportError:
        return None
    # OpenCV's own thread pool costs more than it gains on crop-sized images and
    # fights the DataLoader's worker processes for the cores: one thread.
    cv2.setNumThreads(1)
    return cv2


def _made(name: str) -> Decoder | DecoderUnavailableError:
    try:
        return decoders.make_decoder(name)
    except DecoderUnavailableError as exc:
        return exc  # remembered too: a missing library stays missing


_CURRENT: Capabilities | None = None


def current() -> Capabilities:
    """This process's capabilities (made at the first call)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Capabilities()
    return _CURRENT


def install(caps: Capabilities | None) -> Capabilities | None:
    """Make ``caps`` this process's snapshot (None: a fresh one at the next ``current()``);
    returns the one it replaces. For tests and tools that change the environment."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, caps
    return previous


def get_decoder(name: str = "pillow") -> Decoder:
    """Return the decoder called ``name`` (or the fastest installed one for ``"auto"``).

    Raises ValueError for an unknown name and DecoderUnavailableError (with
    the install command as its hint) when the library is not installed.
    """
    return current().decoder(name)


def resolve_decoder_name(name: str) -> str:
    """``name`` itself, or for ``"auto"`` the first decoder of ``FAST_ORDER`` that is
    installed and gives Pillow's pixels on the probe JPEGs (else ``"pillow"``)."""
    return current().decoder_name(name)


def matches_pillow(decoder: Decoder) -> bool:
    """Whether ``decoder`` gives exactly Pillow's RGB pixels on the probe JPEGs
    (checked once per process and decoder name)."""
    return current().decodes_like_pillow(decoder)


def available_decoders() -> dict[str, str | None]:
    """Every registered decoder -> None if it works here, else why not (one line)."""
    out: dict[str, str | None] = {}
    for name in decoders.DECODER_NAMES:
        try:
            get_decoder(name)
            out[name] = None
        except DecoderUnavailableError as exc:
            out[name] = exc.why
    return out
