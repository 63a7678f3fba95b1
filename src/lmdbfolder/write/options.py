"""How a pack is written: ``PackOptions`` (and ``Resize``), one object for every pack function.

``pack``, ``pack_sources``, ``pack_shard``, ``pack_sharded``, ``pack_ray`` and
the CLI all take their writing options as one ``PackOptions`` (or as the
same names given as keywords: ``pack(src, dst, store="raw")``). The object
owns what follows from the options, so each rule is written once:

* validation (``__post_init__``: a bad value fails before any work starts);
* the part of the resume fingerprint that the options decide
  (``fingerprint``: a rerun with other options must not resume);
* the ``params`` recorded in the manifest, and reading them back
  (``params``, ``Resize.from_params``, ``differences``: whether a finished
  pack or shard was made with these options).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from lmdbfolder.encodings import DEFAULT_RESIZE_FORMAT, RESIZE_FORMATS
from lmdbfolder.errors import OptionError

if TYPE_CHECKING:
    from lmdbfolder.format import Manifest

__all__ = [
    "PackOptions",
    "Resize",
    "STORES",
    "CHECKS",
    "CONTENT_CHECK",
    "RESIZE_SIDES",
    "RESIZE_FORMATS",
    "DEFAULT_COMMIT_EVERY",
    "pack_options",
    "RESIZE_KEYWORDS",
]

STORES = ("encoded", "raw")
CHECKS = ("none", "header", "decode")
#: ``check`` of ``pack --update`` that compares every file's bytes with the pack
#: (the files are still checked as the pack's own ``check`` says).
CONTENT_CHECK = "content"
RESIZE_SIDES = ("longer", "shorter")
DEFAULT_COMMIT_EVERY = 2000


@dataclass(frozen=True)
class Resize:
    """Pack-time resize (``pack --max-size N --quality Q``).

    Images whose ``side`` (``"longer"``, like FFCV's ``max_resolution``, or
    ``"shorter"``) is above ``max_size`` pixels are shrunk to it, keeping the
    aspect ratio (Pillow's antialiased bilinear filter, as torchvision's Resize;
    JPEGs are first DCT-scaled while decoding
    when that still leaves at least the target size) and stored as a JPEG of
    ``quality``, or as RGB pixels with ``store="raw"``. Smaller images keep
    their original bytes (``store="encoded"``).
    """

    max_size: int
    quality: int = 90
    side: str = "longer"
    #: ``"jpeg"`` or ``"webp"`` (``RESIZE_FORMATS``): how a resized image is re-encoded
    #: (WebP is smaller at the same quality; see docs/design.md for its decode cost).
    format: str = DEFAULT_RESIZE_FORMAT

    def __post_init__(self) -> None:
        if isinstance(self.max_size, bool) or not isinstance(self.max_size, int) or self.max_size < 1:
            raise OptionError(f"max_size must be a positive number of pixels, got {self.max_size!r}")
        if isinstance(self.quality, bool) or not isinstance(self.quality, int) or not 1 <= self.quality <= 100:
            raise OptionError(f"quality must be a whole number in 1..100, got {self.quality!r}")
        if self.side not in RESIZE_SIDES:
            raise OptionError(f"side must be one of {RESIZE_SIDES}, got {self.side!r}")
        if self.format not in RESIZE_FORMATS:
            raise OptionError(f"format must be one of {RESIZE_FORMATS}, got {self.format!r}")

    def target(self, width: int, height: int) -> tuple[int, int] | None:
        """The new (width, height), or None when the image is small enough."""
        edge = max(width, height) if self.side == "longer" else min(width, height)
        if edge <= self.max_size:
            return None
        scale = self.max_size / edge
        return max(1, round(width * scale)), max(1, round(height * scale))

    def params(self) -> dict[str, Any]:
        """The manifest ``params`` entries of this resize (``resize_format`` only when not JPEG)."""
        out: dict[str, Any] = {"max_size": self.max_size, "quality": self.quality, "resize_side": self.side}
        if self.format != DEFAULT_RESIZE_FORMAT:
            out["resize_format"] = self.format
        return out

    def fingerprint(self) -> list[Any]:
        """This resize in the resume fingerprint (the format only when not JPEG, so
        packs started before the format option existed still resume)."""
        out: list[Any] = [self.max_size, self.quality, self.side]
        return out + [self.format] if self.format != DEFAULT_RESIZE_FORMAT else out

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Resize | None:
        """The resize a manifest's ``params`` record, or None for a pack that was not resized."""
        if params.get("max_size") is None:
            return None
        return cls(
            int(params["max_size"]),
            int(params.get("quality", 90)),
            str(params.get("resize_side", "longer")),
            str(params.get("resize_format", DEFAULT_RESIZE_FORMAT)),
        )


@dataclass(frozen=True)
class PackOptions:
    """How to write a pack: the options of ``lmdbfolder.pack`` and every other pack function.

    Fields (invalid values raise OptionError at once):
        store: ``"encoded"`` keeps each file's bytes unchanged; ``"raw"``
            stores decoded RGB pixels (no decode at training time, larger).
        check: ``"header"`` (each header read as Pillow reads it; default), ``"decode"``
            (decode every image once) or ``"none"``. Files that fail are
            skipped and reported.
        strict: stop at the first file that cannot be read or fails the check
            (the partial pack stays resumable) instead of skipping it.
        commit_every: samples per write transaction.
        commit_bytes: bytes per write transaction (whichever limit comes
            first). None (default): as small as the disk's flush latency
            allows, 2 MB on most disks, at most 64 MB (see ``batch_bytes``).
        workers: reader processes on Linux when no other Python thread runs,
            else reader threads (default: 2x CPUs, at least 4); 1 reads in
            the calling thread.
        overwrite: replace an existing pack (or unfinished pack) at ``dst``.
        update: bring the pack at ``dst`` up to date with ``src`` in place
            (``pack --update``): new files and classes are added, files gone
            are dropped, files whose size or modification time changed are
            read again (``check="content"``: every file's bytes are compared);
            the result is the dataset a fresh pack of ``src`` would be, and
            only the changed files are read and written. The pack's own
            store, check and resize are kept (other values are refused: they
            would change every record; repack with ``overwrite``), and so are
            its layout and file filters: ``layout`` and ``extensions`` not
            given are the pack's, others are refused (they select other
            files); a pack's ``match`` must be passed again (a pattern read
            from a pack is never run), and so must ``is_valid_file``
            (recorded by name only). A ``dst``
            that does not exist is packed. Interrupted, the same call finishes
            it; ``dst`` holds the old version until the update commits.
            Datasets that opened it before keep reading the old version until
            it is updated again; processes that open it anew see the new one.
        restart: discard an unfinished pack at ``dst`` instead of resuming it.
        space_check: refuse to start when the estimated output does not fit
            on the disk.
        progress: draw a progress bar (``None``: only on a terminal).
        resize: shrink images larger than ``resize.max_size`` and re-encode
            them (a ``Resize``; ``pack --max-size N --quality Q``).

    Example:
        >>> from lmdbfolder import PackOptions, Resize, pack
        >>> opts = PackOptions(store="raw", resize=Resize(256))
        >>> pack("imagenet/train", "train-256.lmdb", opts)  # doctest: +SKIP
    """

    store: str = "encoded"
    check: str = "header"
    strict: bool = False
    commit_every: int = DEFAULT_COMMIT_EVERY
    commit_bytes: int | None = None
    workers: int | None = None
    overwrite: bool = False
    restart: bool = False
    space_check: bool = True
    progress: bool | None = None
    resize: Resize | None = None
    update: bool = False

    def __post_init__(self) -> None:
        if self.store not in STORES:
            raise OptionError(f"store must be one of {STORES}, got {self.store!r}")
        if self.check == CONTENT_CHECK:
            if not self.update:
                raise OptionError(
                    "--check content compares the source files with an existing pack: it needs --update",
                    "pass --update, or another --check (header, decode or none) to pack",
                )
        elif self.check not in CHECKS:
            raise OptionError(f"check must be one of {CHECKS}, got {self.check!r}")
        if self.update and self.overwrite:
            raise OptionError(
                "--update changes the pack at DST in place and --overwrite replaces it: pass one of them",
                "--update reads only the files that changed; --overwrite packs everything again",
            )
        _whole_number("commit_every", self.commit_every)
        if self.commit_bytes is not None:
            _whole_number("commit_bytes", self.commit_bytes)
        if self.workers is not None:
            _whole_number("workers", self.workers)
        if self.resize is not None and not isinstance(self.resize, Resize):
            raise OptionError(f"resize must be a lmdbfolder Resize or None, got {type(self.resize).__name__}")

    def replace(self, **changes: Any) -> PackOptions:
        """A copy with ``changes`` (validated like the constructor)."""
        return dataclasses.replace(self, **changes) if changes else self

    def for_new_pack(self) -> PackOptions:
        """These options for a pack written anew where an update found nothing to update:
        ``update`` off, and ``check="content"`` (which compares with a pack) the default check."""
        return self.replace(update=False, check="header" if self.check == CONTENT_CHECK else self.check)

    def fingerprint(self) -> dict[str, Any]:
        """What a resumed pack must share with the run that started it, as far as options go.

        ``resize`` appears only when set, so packs started without it (and by
        versions that did not know it) still resume.
        """
        out: dict[str, Any] = {"store": self.store, "check": self.check}
        if self.resize is not None:
            out["resize"] = self.resize.fingerprint()
        return out

    def params(self) -> dict[str, Any]:
        """The manifest's ``params``: the options the pack was written with."""
        out: dict[str, Any] = {
            "store": self.store,
            "check": self.check,
            "strict": self.strict,
            "commit_every": self.commit_every,
            "commit_bytes": "auto" if self.commit_bytes is None else self.commit_bytes,
        }
        if self.resize is not None:
            out.update(self.resize.params())
        return out

    def differences(self, meta: Manifest) -> str | None:
        """How the finished pack with manifest ``meta`` differs from one made with these
        options (store, check, resize), or None when it does not."""
        params = meta.params or {}
        if meta.store != self.store or params.get("check") != self.check:
            return f"it was packed with --store {meta.store} and --check {params.get('check')}"
        try:
            found = Resize.from_params(params)
        except (OptionError, TypeError, ValueError):
            return "its recorded --max-size/--quality/--resize-side are invalid"
        if found != self.resize:

            def describe(r: Resize | None) -> str:
                return (
                    "no resize"
                    if r is None
                    else f"--max-size {r.max_size} --quality {r.quality} --resize-side {r.side} --format {r.format}"
                )

            return f"it was packed with {describe(found)}, not {describe(self.resize)}"
        return None


def _whole_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{name} must be a whole number of at least 1, got {value!r}")


#: The command line's names of the resize fields (``pack --max-size N --quality Q
#: --resize-side S --format F``), accepted as keywords too: they build ``resize``.
RESIZE_KEYWORDS = {"max_size": "max_size", "quality": "quality", "resize_side": "side", "resize_format": "format"}


def pack_options(options: PackOptions | None, fields: Mapping[str, Any]) -> PackOptions:
    """``options`` (default: ``PackOptions()``) with ``fields`` replaced.

    This is how every pack function takes its options: as one object, as
    keywords, or both. The command line's resize names work as keywords too
    (``max_size=256, quality=85, resize_side="shorter", resize_format="webp"``
    mean ``resize=Resize(256, 85, "shorter", "webp")``). An unknown keyword
    is a TypeError naming it, the nearest field, and every field.
    """
    base = options if options is not None else PackOptions()
    if not isinstance(base, PackOptions):
        raise TypeError(f"options must be a PackOptions, got {type(base).__name__}")
    fields = dict(fields)
    resize_args = {RESIZE_KEYWORDS[k]: fields.pop(k) for k in list(fields) if k in RESIZE_KEYWORDS}
    names = [f.name for f in dataclasses.fields(PackOptions)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise TypeError(_unknown_options(unknown, names))
    if resize_args:
        if fields.get("resize") is not None:
            raise OptionError(
                "pass either resize=Resize(...) or max_size=... (with quality, resize_side, resize_format), not both"
            )
        if "max_size" not in resize_args:
            given = ", ".join(k for k, v in RESIZE_KEYWORDS.items() if v in resize_args)
            raise OptionError(
                f"{given} needs max_size (only resized images are re-encoded)",
                "pass max_size=N too, e.g. max_size=256 (or resize=Resize(256, quality=...))",
            )
        fields["resize"] = Resize(**resize_args)
    return base.replace(**fields)


def _unknown_options(unknown: list[str], names: list[str]) -> str:
    import difflib

    known = names + list(RESIZE_KEYWORDS)
    parts = []
    for name in unknown:
        plain = name.replace("-", "_").lstrip("_")
        if plain.startswith("no_") and plain[3:] in names:  # --no-space-check, --no-progress
            parts.append(f"{name!r} (the command line's --{plain.replace('_', '-')} is {plain[3:]}=False)")
            continue
        near = difflib.get_close_matches(plain, known, n=1, cutoff=0.6)
        parts.append(f"{name!r} (did you mean {near[0]}?)" if near else repr(name))
    return (
        f"unexpected pack option {', '.join(parts)}; the options are PackOptions' fields: {', '.join(names)} "
        f"(resize=Resize(max_size, quality, side, format), or the command line's names {', '.join(RESIZE_KEYWORDS)})"
    )
