"""The two dataset classes: ``LMDBFolder``, a drop-in for ``torchvision.datasets.ImageFolder``,
and ``LMDBDatasetFolder``, the same with ``DatasetFolder``'s argument order.

They subclass torchvision's dataset classes. They are safe with DataLoader workers under fork,
spawn and forkserver, with ``persistent_workers`` and over many epochs: the
pack is opened lazily in each worker process (see
``lmdbfolder.read.reader``), and the dataset pickles without any open handle.
A worker that finds another pack at the path than the one the dataset was
made from (replaced by ``pack --overwrite``) raises instead of mixing them.

How each of ImageFolder's attributes and arguments maps onto a pack is in
docs/switching-from-imagefolder.md.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from lmdbfolder.errors import DecodeError, MissingDependencyError, NoSamplesError, OptionError, SlowPathWarning

try:
    import torch
    from torchvision.datasets import DatasetFolder, ImageFolder, VisionDataset
    from torchvision.datasets.folder import IMG_EXTENSIONS, accimage_loader, default_loader, pil_loader
except ImportError as exc:  # a core-only install: say what to install
    raise MissingDependencyError("lmdbfolder.torch (LMDBFolder)", "torch", "torch and torchvision") from exc

from lmdbfolder.encodings import decode_hint, encoding_of
from lmdbfolder.format import Manifest, ShardIndex
from lmdbfolder.read.capabilities import current
from lmdbfolder.read.class_order import ordered_classes
from lmdbfolder.read.opening import AnyReader, open_pack
from lmdbfolder.read.plan import BatchItemError
from lmdbfolder.read.reader import Record
from lmdbfolder.read.selection import (
    PathIndex,
    Selection,
    normalize_extensions,
    sample_path,
    select,
    source_root_of,
)
from lmdbfolder.read.stored_file import StoredFile, lend
from lmdbfolder.torch.batches import BatchSamples
from lmdbfolder.torch.loader import _RAW_LOADER, _RAW_LOADER_HINT, PackLoader, _decodes_itself
from lmdbfolder.torch.options import ReadOptions, read_options, shows_settings
from lmdbfolder.torch.plan import TransformPlan, fast_path, plan_key
from lmdbfolder.torch.replay import Replay

__all__ = ["LMDBFolder", "LMDBDatasetFolder"]


class _Setting:
    """A dataset attribute that is a field of its ``options``: reading it reads the
    field, assigning it replaces ``options`` by a copy with the new value (checked as
    ``ReadOptions`` checks it; the transform plan sees the change at the next sample)."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.options, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.options = obj.options.replace(**{self.name: value})


class LMDBDatasetFolder(DatasetFolder):
    """A pack read as ``torchvision.datasets.DatasetFolder``: the same arguments, in its order.

    ``LMDBDatasetFolder(root, loader, extensions, transform, target_transform,
    is_valid_file, allow_empty)``; ``LMDBFolder`` is the same dataset with
    ImageFolder's order. Both are ``VisionDataset`` s (and ``DatasetFolder`` /
    ``ImageFolder`` s, for ``isinstance`` and
    ``torchvision.datasets.wrap_dataset_for_transforms_v2``).

    Args:
        root: the pack directory written by ``lmdbfolder pack`` (a single
            pack, or a sharded pack: its shards are opened lazily in each
            process). ``~`` is expanded. A missing path raises
            ``PackNotFoundError`` (a ``FileNotFoundError``, as ImageFolder).
            Or the URL of a sharded pack in object storage (``s3://bucket/train``,
            uploaded with ``lmdbfolder copy PACK URL``), with ``cache_dir``: its
            shards are staged there as they are needed (in the order
            ``ExactDistributedSampler`` will read them; ``root`` is then the
            cache folder of the pack).
        loader: required, as in DatasetFolder (``LMDBFolder`` defaults it to
            ``default_loader``, as ImageFolder). torchvision's ``default_loader``
            or ``pil_loader`` (or None): the stored image is decoded to RGB by lmdbfolder,
            exactly as ``pil_loader`` does (and with ``decoder``, ``size_hint``
            and the fused crop). Any other callable is called as ImageFolder
            calls it, with a path: a ``str`` naming a file that holds exactly
            the packed bytes of the sample, ending in the original file's
            extension, whose ``.source`` is the sample's path in ``samples``.
            It stays valid while the loader's result (or what the transform
            made of it) lives, so a lazy ``Image.open``'s ``.filename`` can be
            read again later (``lmdbfolder.read.stored_file``). So loaders that
            open a path work unchanged (``accimage_loader``,
            ``torchvision.io.decode_image``/``read_image``, ``cv2.imread``,
            ``Image.open``, ``np.load``, copies of ``pil_loader``); one that
            parses the folder names should read ``path.source``. Needs a pack
            that stores the files (not ``--store raw``).
        extensions: keep only the packed samples whose path ends with one of
            these (case-insensitive; a string or a tuple). Default: every
            packed sample (the pack applied its own extensions when it was
            made: ``lmdbfolder pack --extensions``).
        transform: applied to the image (a PIL image, or what ``loader`` returns).
        target_transform: applied to the integer target.
        is_valid_file: keep only the samples for whose path (as in
            ``samples``) it returns True. Not together with ``extensions``.
        allow_empty: with a filter (``extensions``, ``is_valid_file``, a
            ``find_classes`` override), a class left without samples raises
            ``NoSamplesError`` (a ``FileNotFoundError``, as ImageFolder) unless
            this is True; the same for a pack of an ImageFolder tree that kept
            empty class folders (``pack --allow-empty``).
        options: lmdbfolder's own settings, as one ``ReadOptions`` (below).
        **settings: the same settings as keywords (``threads=2``), which
            replace those of ``options``. An unknown keyword is a TypeError.

    lmdbfolder's settings (the fields of ``lmdbfolder.torch.ReadOptions``, checked
    when it is made; ``ds.options`` is the dataset's, and ``ds.threads``,
    ``ds.torch_threads``, ``ds.size_hint``, ``ds.prefetch`` read and assign its
    fields, checked the same way):
        source_root: the folder that ``samples`` paths start with. Default:
            the folder the pack was made from, as recorded in its manifest
            (``lmdbfolder info`` shows it); pass another to re-root them (the
            dataset's files were moved, or the pack was made on another machine).
        readahead: kernel readahead on the memory map (see ``Reader``).
        verify_checksums: check each record's CRC-32 as it is read (default:
            about 0.3 % of a JPEG decode; format-2 packs also bind it to the
            index, so no record is ever returned in another's place).
        decoder: JPEG decoder (``lmdbfolder.read.decoders``): ``"auto"``
            (default: the fastest installed one whose pixels are identical to
            Pillow's, checked on probe JPEGs at first use; Pillow if none
            is), ``"pillow"`` (Pillow itself, exactly ImageFolder's loader),
            ``"simplejpeg"``, ``"turbojpeg"``, ``"opencv"``, ``"torchvision"``.
            Non-JPEG images (and CMYK JPEGs) always go through Pillow.
        size_hint: the training resolution. JPEGs are decoded at the smallest
            DCT scale (1/2, 1/4, 1/8) that keeps the shorter side at least
            ``size_hint`` pixels. Put ``lmdbfolder.fused.RandomResizedCrop``
            first in ``transform`` (a ``transforms.Compose`` or
            ``transforms.v2.Compose``) instead to choose the scale per sampled crop.
        prefetch: when the DataLoader asks for a whole batch (``__getitems__``),
            ask the kernel to start reading all of its records before decoding
            (``Reader.get_many``; ``madvise(WILLNEED)``). Off by default: on
            the development VM it cost ~4-8 us per record with a warm page cache
            and gained nothing cold (``benchmarks/bench_scale.py``, "read");
            try it on storage with deep queues (NVMe, network block devices).
        threads: threads that make one batch on the batch fast path (below):
            the decoders and OpenCV release the GIL, so with
            ``DataLoader(num_workers=0)`` and ``threads=N`` one process uses
            N cores and no batch is copied between processes (FFCV's model).
            Default 1 (DataLoader workers are the parallelism).
        torch_threads: torch's intra-op threads while a sample is made in the
            main process (``num_workers=0``), as DataLoader workers set them
            (1), restored afterwards; several threads made small tensor ops
            such as a flip hundreds of times slower on a busy machine. None:
            leave torch's setting alone.
        cache_dir: for a URL ``root``: the local folder (fast disk) shards are
            staged into, the same for every worker and rank of a node (one
            download per shard per node; ``lmdbfolder.read.staging``).
        cache_limit: for a URL ``root``: bytes of staged shards to keep at
            most; shards no rank of the node needs any more are evicted first.
        class_order: how classes are numbered: ``"sorted"`` (default: the
            pack's numbering, torchvision's sorted class names) or ``"timm"``
            (timm's folder dataset's natural order, ``cat, class2, class10,
            Dog``; ``lmdbfolder.read.class_order``), for a model trained
            through ``timm.data.ImageDataset``. ``classes``, ``class_to_idx``,
            ``targets``, ``samples`` and every label returned follow it.
        seed: replayable augmentation (``lmdbfolder.replay``): sample ``i`` of
            epoch ``e`` draws its random numbers (torchvision's transforms, the
            fused crop, the batch path) from ``(seed, e, i)`` only, so the same
            sample of the same epoch gets the same pixels whatever the workers,
            threads, batch size, resume point or number of ranks. The epoch comes
            from ``ExactDistributedSampler.set_epoch``/``load_state_dict``, or
            ``set_epoch(e)``. Default None: torchvision's own random numbers, as
            ImageFolder's.

    The batch fast path: when ``transform`` is
    ``lmdbfolder.fused.RandomResizedCrop(..., output="tensor")`` followed by at
    most a ``RandomHorizontalFlip`` (torchvision's v1 or v2; with
    ``output="pil"``, followed by a ``PILToTensor``/``ToImage``), a batch
    (``__getitems__``) is decoded, cropped, resized and flipped straight into one
    contiguous uint8 ``N x 3 x H x W`` tensor, with the same
    boxes, flips and random numbers as the per-sample path and the same
    pixels. Pass ``collate_fn=lmdbfolder.torch.collate`` to the DataLoader to
    take that tensor as the batch (the default collate copies it once more).

    Attributes (as ImageFolder's):
        classes, class_to_idx: from the pack (or a ``find_classes`` override).
        samples: ``(path, class index)`` per sample, the path under
            ``source_root``; ``imgs`` is the same. Assigning a list of such
            pairs (``ds.samples = [s for s in ds.samples if ...]``) restricts
            and relabels the dataset as it does ImageFolder's; the list is
            read-only in place (assign a new one).
        targets: the class index of every sample (-1 for unlabelled packs).
            Assigning a list replaces what ``targets`` returns and, as in
            ImageFolder, not the targets the samples are loaded with.
        root: the pack directory (a ``pathlib.Path`` if one was given). Sample
            paths are *not* under it: ``os.path.relpath(path, ds.root)`` gives
            ``../..``-paths; use ``ds.source_root`` or ``ds.filenames()``.
            ``source_root``: see above.
        loader, extensions, transform, target_transform, transforms.

    Subclasses: override ``__getitem__`` to change what a sample is; the
    batched path the DataLoader takes (``__getitems__``) then calls it for
    every index (the faster batch read is used only when ``__getitem__`` is
    this class's). ``find_classes(directory)`` and the static
    ``make_dataset(directory, class_to_idx, extensions, is_valid_file,
    allow_empty)`` have ImageFolder's signatures (``directory`` is the pack)
    and are called the same way, once, at construction.

    ``len()`` and the attributes come from the pack's metadata: nothing is
    scanned. ``targets``/``samples`` are built on first access and are not
    sent to worker processes; a selection is, as one number per sample.
    """

    @shows_settings
    def __init__(
        self,
        root: str | os.PathLike[str],
        loader: Callable[[str], Any] | None,
        extensions: str | tuple[str, ...] | None = None,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        *,
        options: ReadOptions | None = None,
        **settings: Any,
    ) -> None:
        self.options: ReadOptions = read_options(options, settings, f"{type(self).__name__}.__init__")
        self.replay: Replay | None = None if self.options.seed is None else Replay(self.options.seed)
        if extensions is not None and is_valid_file is not None:
            raise ValueError("Both extensions and is_valid_file cannot be not None at the same time")
        self._plan_cache: TransformPlan | None = None
        self._plan_key: tuple[Any, ...] = ()
        self._decoder_name: str | None = None
        self.decoder = self.options.decoder  # a missing decoder library fails here, not in a worker
        self._targets: list[Any] | None = None
        self._samples: list[tuple[str, Any]] | None = None
        self._assigned_targets: Any = None
        self.reader: AnyReader = self._open(root)
        _refuse_fields(self.reader)
        self._selection = Selection.of(None, None, len(self.reader))
        VisionDataset.__init__(
            self, _root_as_given(root, self.reader.path), transform=transform, target_transform=target_transform
        )
        self.recorded_root = source_root_of(self.reader.meta)
        self.source_root = _source_root(self.options.source_root, self.recorded_root)
        self.loader = default_loader if loader is None else loader
        if not _decodes_itself(self._loader) and self.reader.store == "raw":
            raise OptionError(_RAW_LOADER, _RAW_LOADER_HINT)
        self.extensions: tuple[str, ...] | None = _extensions_shown(extensions, is_valid_file, self.reader.meta)
        self._choose_samples(extensions, is_valid_file, allow_empty)
        if self.options.decoder != "pillow":
            _warn_if_slow()

    def _open(self, root: str | os.PathLike[str]) -> AnyReader:
        """The pack at ``root`` (a URL: staged into ``cache_dir``), opened as the options say."""
        opts = self.options
        return open_pack(
            root,
            readahead=opts.readahead,
            verify_checksums=opts.verify_checksums,
            cache_dir=opts.cache_dir,
            cache_limit=opts.cache_limit,
        )

    def _choose_samples(
        self,
        extensions: str | tuple[str, ...] | None,
        is_valid_file: Callable[[str], bool] | None,
        allow_empty: bool,
    ) -> None:
        """ImageFolder's steps, once: ``find_classes``, then the samples: the list a
        ``make_dataset`` override returns, else a ``Selection`` of the pack."""
        classes, class_to_idx = self.find_classes(self.root)
        if not classes and self.reader.classes:
            raise _no_classes_found(self.root, self.source_root)
        if type(self).make_dataset is not LMDBDatasetFolder.make_dataset:
            # A subclass builds the sample list: take it as the samples (paths -> records).
            self.samples = self.make_dataset(
                self.root,
                class_to_idx=class_to_idx,
                extensions=extensions,
                is_valid_file=is_valid_file,
                allow_empty=allow_empty,
            )
        else:
            self._selection = select(
                self.reader,
                self.source_root,
                class_to_idx,
                extensions=extensions,
                is_valid_file=is_valid_file,
                allow_empty=allow_empty,
            )
        self.classes: list[str] = classes
        self.class_to_idx: dict[str, int] = class_to_idx

    # -- lmdbfolder's settings: fields of ``options`` -------------------------------------------
    threads = _Setting("threads that make one batch on the batch fast path (``ReadOptions.threads``)")
    torch_threads = _Setting("torch's intra-op threads while a sample is made in the main process")
    size_hint = _Setting("the training resolution for DCT-scaled decodes (``ReadOptions.size_hint``)")
    prefetch = _Setting("whether a batch's records are asked of the kernel at once (``ReadOptions.prefetch``)")

    @property
    def class_order(self) -> str:
        """How classes are numbered: ``"sorted"`` (torchvision's) or ``"timm"`` (``ReadOptions.class_order``)."""
        options = self.__dict__.get("options")  # a subclass's find_classes may run before __init__ sets it
        return "sorted" if options is None else options.class_order

    # -- ImageFolder's overridable steps ------------------------------------------------------
    def find_classes(self, directory: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
        """The classes of the pack at ``directory`` and their indices, as packed.

        ``directory`` is the pack (``self.root``), not the image folder it was
        made from (that is ``self.source_root``, which may no longer exist):
        a pack directory holds no class folders. Override it (as for
        ImageFolder) to use a subset of the classes or other indices, starting
        from ``super().find_classes(directory)``: the samples of the classes
        it leaves out are dropped, the others get its indices. An override
        that returns no class raises ``NoSamplesError`` (a
        ``FileNotFoundError``, as ImageFolder's "Couldn't find any class folder").
        """
        if _same_path(directory, self.root):
            classes, class_to_idx = self.reader.classes, self.reader.class_to_idx
        else:
            with open_pack(directory) as other:
                classes, class_to_idx = other.classes, other.class_to_idx
        return ordered_classes(list(classes), class_to_idx, self.class_order)

    @staticmethod
    def make_dataset(  # type: ignore[override]
        directory: str | os.PathLike[str],
        class_to_idx: dict[str, int],
        extensions: str | tuple[str, ...] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
    ) -> list[tuple[str, int]]:
        """The ``(path, class index)`` samples of the pack at ``directory``: those of the
        classes in ``class_to_idx`` (with its indices) that pass ``extensions`` or
        ``is_valid_file``, in the pack's order, paths under the recorded source root.

        As ImageFolder's: raises ValueError for a missing ``class_to_idx`` or both
        filters, and ``NoSamplesError`` (a FileNotFoundError) for a class without
        samples unless ``allow_empty``. A subclass may override it; whatever
        list it returns becomes ``samples`` (each path must be a packed sample).
        """
        if class_to_idx is None:
            raise ValueError("The class_to_idx parameter cannot be None.")
        with open_pack(directory) as reader:
            root = source_root_of(reader.meta)
            chosen = select(
                reader, root, class_to_idx, extensions=extensions, is_valid_file=is_valid_file, allow_empty=allow_empty
            )
            paths = reader.paths()
            stored = np.frombuffer(reader.labels, dtype=np.int32) if len(reader) else np.zeros(0, np.int32)
        index = np.arange(len(paths)) if chosen.indices is None else chosen.indices
        labels = stored[index] if chosen.labels is None else chosen.labels
        return [(sample_path(root, paths[i]), int(t)) for i, t in zip(index.tolist(), labels.tolist())]

    # -- samples ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._selection)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        plan = self._plan()
        with self._torch_threads(plan):
            rec, position = self._selection.fetch(self.reader, index)
            with self._seeded(index):
                return self._sample(plan, rec, position)

    # -- replayable augmentation (``seed``: lmdbfolder.replay) ------------------------------------
    def _seeded(self, index: int) -> Any:
        """Sample ``index``'s own random stream with ``seed``; nothing without."""
        return contextlib.nullcontext() if self.replay is None else self.replay.seeded(index)

    @property
    def seed(self) -> int | None:
        """The augmentation seed (``ReadOptions.seed``), or None."""
        return self.options.seed

    @property
    def epoch(self) -> int:
        """The epoch whose random numbers the samples draw (with ``seed``; 0 until set)."""
        return 0 if self.replay is None else self.replay.epoch.get()

    def set_epoch(self, epoch: int) -> None:
        """Make the samples draw epoch ``epoch``'s random numbers (with ``seed``; else nothing).

        ``ExactDistributedSampler.set_epoch`` calls it; with another sampler call
        it before each epoch. DataLoader workers, persistent ones included, see it.
        """
        if self.replay is not None:
            self.replay.epoch.set(epoch)

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch": e}`` with ``seed`` (``StatefulDataLoader`` saves and restores it), else ``{}``."""
        return {} if self.replay is None else {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved."""
        if self.replay is not None and isinstance(state, dict) and "epoch" in state:
            self.set_epoch(state["epoch"])

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A whole batch (the DataLoader calls this): the records are fetched
        together (``prefetch``: the kernel is asked to read them all at once), then
        made into one batch tensor where the transform allows it (see the class
        docstring), else one by one.

        If a subclass overrides ``__getitem__``, this calls it for each index
        instead, so a batched DataLoader gives what ``ds[i]`` gives.
        """
        if type(self).__getitem__ is not LMDBDatasetFolder.__getitem__:
            return [self[i] for i in indices]
        plan = self._plan()
        with self._torch_threads(plan):
            records, positions = self._selection.fetch_many(self.reader, indices, self.prefetch)
            if plan.batches and records and all(r.width > 0 and r.height > 0 for r in records):
                seeds = None if self.replay is None else [self.replay.sample_seed(i) for i in indices]
                return self._fast_batch(plan, records, positions, seeds)
            if plan.multicrop is not None and records and all(r.width > 0 and r.height > 0 for r in records):
                return self._multicrop_batch(plan, records, positions, indices)
            if self.replay is not None:
                out = []
                for index, rec, p in zip(indices, records, positions):
                    with self.replay.seeded(index):
                        out.append(self._sample(plan, rec, p))
                return out
            return [self._sample(plan, rec, p) for rec, p in zip(records, positions)]

    def _plan(self) -> TransformPlan:
        """How samples are made in this process (``TransformPlan``), resolved once
        per transform, loader, decoder, size hint and thread count, and per process."""
        # The transform's steps and settings too (plan_key): a change in place takes effect.
        transform_key = plan_key(self.transform)
        key = (transform_key, self._loader, self._decoder_name, self.size_hint, self.threads, os.getpid())
        plan = self._plan_cache
        if plan is None or key != self._plan_key:
            decoder = current().decoder(self.decoder)  # resolves "auto": part of the key from now on
            key = (transform_key, self._loader, self._decoder_name, self.size_hint, self.threads, os.getpid())
            transform = self.transform if _decodes_itself(self._loader) else None
            plan = TransformPlan(transform, decoder=decoder, size_hint=self.size_hint, threads=self.threads)
            if not _decodes_itself(self._loader):
                plan.batches = False  # the user's loader makes every sample
            self._plan_cache, self._plan_key = plan, key
        return plan

    def _torch_threads(self, plan: TransformPlan) -> Any:
        """One torch thread while a sample is made in the main process, like a DataLoader worker."""
        if self.torch_threads is None or plan.in_worker:
            return contextlib.nullcontext()
        return _torch_threads(self.torch_threads)

    def _target(self, rec: Record, position: int | None) -> Any:
        target = self._selection.target(rec.label, position)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return target

    def _fast_batch(
        self,
        plan: TransformPlan,
        records: list[Record],
        positions: list[int | None],
        seeds: list[int] | None = None,
    ) -> BatchSamples:
        """The batch fast path: one tensor for the whole batch (``TransformPlan.batch``)."""
        try:
            images = plan.batch(records, seeds)
        except BatchItemError as exc:
            raise self._decode_error(records[exc.position], exc.cause) from exc.cause
        return BatchSamples(images, [self._target(rec, p) for rec, p in zip(records, positions)])

    def _multicrop_batch(
        self, plan: TransformPlan, records: list[Record], positions: list[int | None], indices: Sequence[int]
    ) -> BatchSamples:
        """A batch of multi-crop samples made by the dataset's ``threads``, each view
        position one batch tensor (``TransformPlan.views_many``), which ``collate`` (and
        torch's default collate) hand on as they are: ``[views, targets]``."""
        replay = self.replay
        seeded = None if replay is None else (lambda k: replay.seeded(indices[k]))
        try:
            views = plan.views_many(records, seeded)
        except BatchItemError as exc:
            raise self._decode_error(records[exc.position], exc.cause) from exc.cause
        return BatchSamples(views, [self._target(rec, p) for rec, p in zip(records, positions)])

    def _decode_error(self, rec: Record, exc: BaseException) -> DecodeError:
        hint = decode_hint(exc)
        return DecodeError(rec.index, self.reader.path_of(rec.index), f"{type(exc).__name__}: {exc}", hint)

    def _sample(self, plan: TransformPlan, rec: Record, position: int | None) -> tuple[Any, Any]:
        if not _decodes_itself(self._loader):
            return self._load_with_loader(rec), self._target(rec, position)
        try:
            sample = plan.decode(rec.payload, rec.encoding, rec.width, rec.height, rec.channels)
        except BatchItemError as exc:
            raise self._decode_error(rec, exc.cause) from exc.cause
        except Exception as exc:  # decoders raise many exception types for bad data
            raise self._decode_error(rec, exc) from exc
        if plan.rest is not None:
            sample = plan.rest(sample)
        return sample, self._target(rec, position)

    def _load_with_loader(self, rec: Record) -> Any:
        # ImageFolder calls loader(path): give it a path to the stored bytes (read.stored_file).
        if encoding_of(rec.encoding).stores_pixels:
            raise OptionError(_RAW_LOADER, _RAW_LOADER_HINT)
        source = sample_path(self.source_root, self.reader.path_of(rec.index))
        with lend(rec.payload, source, rec.index) as lease:
            try:
                sample = self._loader(lease.path)
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"lmdbfolder: loader {self._loader!r} failed on record {rec.index} ({source})")
                raise
            lease.hold(sample)  # a lazy image reads the file (and its .filename names it) as long as it lives
            if self.transform is not None:
                sample = self.transform(sample)
                lease.hold(sample)
        return sample

    @property
    def loader(self) -> PackLoader:
        """The loader, bound to the pack: ``ds.loader(path)`` with a path from ``samples``
        loads that sample's image from the pack, never from the image folder.

        So a ``__getitem__`` override written for ImageFolder (``path, target =
        self.samples[index]; sample = self.loader(path)``) reads the pack, and
        keeps working after the folder is gone. The usual way is shorter and
        takes the fast path: ``sample, target = super().__getitem__(index)``.
        A path that is no sample of the pack is passed to the loader as it is
        when the file exists, else it is a FileNotFoundError that says so.
        ``ds.loader.__wrapped__`` is the loader that was given.
        """
        return PackLoader(self, self._loader)

    @loader.setter
    def loader(self, value: Callable[[str], Any]) -> None:
        if isinstance(value, PackLoader):
            value = value.__wrapped__
        self._loader = value
        self._plan_cache = None

    def _pack_index_of(self, path: Any) -> int | None:
        """The pack index of the sample at ``path`` (as in ``samples``), or None."""
        if isinstance(path, StoredFile):
            return path.pack_index
        index = self.__dict__.get("_path_index")
        if index is None:
            index = self._path_index = PathIndex(self.reader, [self.source_root, self.recorded_root])
        try:
            return index(path)
        except (ValueError, TypeError):
            return None

    @property
    def decoder(self) -> str:
        """The JPEG decoder's name; ``"auto"`` is resolved at first use, once per
        dataset (the probe decode costs ~10 ms, more than opening a pack)."""
        if self._decoder_name is None:
            self._decoder_name = current().decoder_name("auto")
        return self._decoder_name

    @decoder.setter
    def decoder(self, name: str) -> None:
        caps = current()
        if name == "auto":
            self._decoder_name = None  # nothing can fail: Pillow is the fallback
        else:
            self._decoder_name = caps.decoder_name(name)  # unknown names fail here
            caps.decoder(self._decoder_name)  # so does a missing library (with its install hint), not in a worker
        if name != self.options.decoder:
            self.options = self.options.replace(decoder=name)
        self._plan_cache = None

    # -- ImageFolder's lists --------------------------------------------------------------------
    @property
    def targets(self) -> Any:
        """Class index of every sample, in index order (or the list last assigned to it)."""
        if self._assigned_targets is not None:
            return self._assigned_targets
        if self._targets is None:
            self._targets = self._selection.stored_labels(self.reader)
        return self._targets

    @targets.setter
    def targets(self, value: Any) -> None:
        # ImageFolder keeps ``targets`` as a plain attribute next to ``samples``, and
        # loads each sample's target from ``samples``: so does this.
        self._assigned_targets = value

    @property
    def samples(self) -> list[tuple[str, Any]]:
        """``(path, class index)`` of every sample, in index order; paths under ``source_root``."""
        if self._samples is None:
            root = self.source_root
            labels = self._selection.stored_labels(self.reader)
            self._samples = _SampleList(zip([sample_path(root, p) for p in self._paths()], labels))
        return self._samples

    @samples.setter
    def samples(self, value: Any) -> None:
        """Show exactly these ``(path, target)`` samples, in this order (ImageFolder's
        ``ds.samples = [...]``): each path must name a packed sample."""
        items = [(os.fspath(p), t) for p, t in value]
        current = self._samples
        lookup = PathIndex(self.reader, [self.source_root, self.recorded_root])
        if current is not None:
            current_paths = [p for p, _ in current]
            indices = _match_in_order([p for p, _ in items], current_paths, self._selection.pack_index, lookup)
        else:
            indices = np.array([lookup(p) for p, _ in items], dtype=np.int64)
        targets = [t for _, t in items]
        stored = np.frombuffer(self.reader.labels, dtype=np.int32) if len(self.reader) else np.zeros(0, np.int32)
        labels: Any = None
        if all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in targets):
            wanted = np.array(targets, dtype=np.int64)
            if not np.array_equal(wanted, stored[indices].astype(np.int64)):
                labels = wanted
        else:
            labels = targets  # targets of any kind, as ImageFolder allows
        every = len(indices) == len(self.reader) and bool(np.array_equal(indices, np.arange(len(self.reader))))
        self._selection = Selection.of(None if every else indices, labels, len(self.reader))
        self._samples = _SampleList(items)
        self._targets = None
        self._assigned_targets = None

    @property
    def imgs(self) -> list[tuple[str, Any]]:
        """Alias of ``samples``, as in ImageFolder (assigning it assigns ``samples``)."""
        return self.samples

    @imgs.setter
    def imgs(self, value: Any) -> None:
        self.samples = value

    def filenames(self, basename: bool = False, absolute: bool = False) -> list[str]:
        """The file name of every sample, as timm's datasets give them: relative to the
        source root (default), just the ``basename``, or the ``absolute`` path (as in ``samples``)."""
        paths = self._paths()
        if basename:
            return [os.path.basename(p) for p in paths]
        if absolute:
            return [sample_path(self.source_root, p) for p in paths]
        return paths

    def filename(self, index: int, basename: bool = False, absolute: bool = False) -> str:
        """The file name of sample ``index`` (see ``filenames``)."""
        selection = self._selection
        rel = self.reader.path_of(selection.pack_index(selection.position(index, self.root)))
        if basename:
            return os.path.basename(rel)
        return sample_path(self.source_root, rel) if absolute else rel

    @property
    def shard_offsets(self) -> list[int] | None:
        """First index of each shard, then ``len(self)`` (sharded packs only; for the
        shard-aware sampler). A selection out of pack order counts as one shard."""
        offsets = getattr(self.reader, "shard_offsets", None)
        idx = self._selection.indices
        if offsets is None or idx is None:
            return offsets
        if len(idx) > 1 and bool(np.any(idx[1:] < idx[:-1])):
            return [0, len(idx)]
        return [int(x) for x in np.searchsorted(idx, offsets)]

    # -- pickling, printing -------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # Workers need neither list; rebuilding them on demand keeps a
        # million-entry list out of every worker's memory.
        state = self.__dict__.copy()
        state["_targets"] = None
        state["_samples"] = None
        state["_plan_cache"] = None  # libraries, buffers and threads of this process: made again in each
        state["_plan_key"] = ()
        state.pop("_path_index", None)  # path -> index, built where it is used
        return state

    def _paths(self) -> list[str]:
        paths = self.reader.paths()
        indices = self._selection.indices
        return paths if indices is None else [paths[i] for i in indices.tolist()]

    def extra_repr(self) -> str:
        """The pack-specific lines of ``repr`` (after VisionDataset's count and root)."""
        regions = "on" if self.decoder != "pillow" and current().region_decoder() is not None else "off"
        lines = [
            f"Source root: {self.source_root}",
            f"Store: {self.reader.store}, decoder: {self.decoder}, crop regions: {regions}",
        ]
        if self._selection.indices is not None:
            lines.append(f"Selected: {len(self)} of {len(self.reader)} packed samples")
        if self.class_order != "sorted":
            lines.append(f"Class order: {self.class_order}")
        if not _decodes_itself(self._loader):
            lines.append(f"Loader: {self._loader!r}")
        elif self.transform is not None:
            lines.append(f"Fast path: {fast_path(self.transform, size_hint=self.size_hint)[1]}")
        return "\n".join(lines)


class LMDBFolder(LMDBDatasetFolder, ImageFolder):
    """A packed image dataset with the interface of ``torchvision.datasets.ImageFolder``.

    ``LMDBFolder(root, transform, target_transform, loader, is_valid_file,
    allow_empty)``: ImageFolder's arguments, in its order, with its meaning
    (see ``LMDBDatasetFolder`` for each, and for ``extensions``, keyword-only
    here), then lmdbfolder's own settings as ``options=ReadOptions(...)`` or as
    keywords (``decoder``, ``size_hint``, ``threads``, ``source_root``, ...: the
    fields of ``ReadOptions``). Code
    written with DatasetFolder's order ``(root, loader, extensions, ...)``
    should use ``LMDBDatasetFolder``; a torchvision loader passed where the
    transform goes is refused with that advice.

    ``samples`` paths are under the folder the pack was made from
    (``source_root``); ``root`` is the pack.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> from torchvision import transforms as T
        >>> from lmdbfolder.torch import LMDBFolder
        >>> tf = T.Compose([T.RandomResizedCrop(224), T.ToTensor()])
        >>> ds = LMDBFolder("train.lmdb", transform=tf)  # doctest: +SKIP
        >>> loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=8)  # doctest: +SKIP
    """

    @shows_settings
    def __init__(
        self,
        root: str | os.PathLike[str],
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
        loader: Callable[[str], Any] = default_loader,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        *,
        extensions: str | tuple[str, ...] | None = None,
        options: ReadOptions | None = None,
        **settings: Any,
    ) -> None:
        _refuse_datasetfolder_order(transform, target_transform)
        super().__init__(
            root,
            loader,
            extensions,
            transform,
            target_transform,
            is_valid_file,
            allow_empty,
            options=options,
            **settings,
        )


def _source_root(given: str | os.PathLike[str] | None, recorded: str) -> str:
    """The folder ``samples`` paths start with: ``source_root`` when given, else the recorded one."""
    return recorded if given is None else os.path.abspath(os.path.expanduser(os.fspath(given)))


def _extensions_shown(
    extensions: str | tuple[str, ...] | None,
    is_valid_file: Callable[[str], bool] | None,
    meta: Manifest | ShardIndex,
) -> tuple[str, ...] | None:
    """``extensions`` as ImageFolder shows it: the ones given, None when a callable chose
    the files (here or when the pack was made), else those the pack was made with."""
    record = meta.source_record
    if extensions is not None:
        return normalize_extensions(extensions)
    if is_valid_file is not None or (record is not None and record.is_valid_file):
        return None  # a callable chose the files, as ImageFolder's None says
    return tuple((record.extensions if record is not None else None) or IMG_EXTENSIONS)


def _no_classes_found(root: str, source_root: str) -> NoSamplesError:
    # ImageFolder's find_classes raises for a root without class folders; an override
    # that scans ``directory`` finds none in a pack, and 0 classes would silently be 0 samples.
    return NoSamplesError(
        root,
        [],
        f"Couldn't find any class folder: find_classes({root!r}) returned no class. Its directory is "
        f"the pack, which holds no class folders (the image folder it was packed from is {source_root})",
        "start a find_classes override from the pack's classes: `classes, class_to_idx = "
        "super().find_classes(directory)`, then keep or renumber them",
    )


def _warn_if_slow() -> None:
    # Once per process (per capabilities snapshot): the compiled crop decoder is missing.
    caps = current()
    first: list[bool] = []

    def asked() -> bool:
        first.append(True)
        return True

    caps.answer("warned:compiled", asked)
    if first and caps.regions_switch and caps.compiled() is None:
        frame, level = sys._getframe(0), 1
        while frame is not None and frame.f_globals.get("__name__") == __name__:
            frame, level = frame.f_back, level + 1  # type: ignore[assignment]
        warnings.warn(
            "lmdbfolder's compiled crop decoder (lmdbfolder.read._crops) is not built in this installation, "
            "so JPEG crops are decoded whole and resized by Pillow: the same pixels, about 20% slower. "
            "`lmdbfolder doctor` says what to install (usually: apt-get install libjpeg-dev, then reinstall)",
            SlowPathWarning,
            stacklevel=level,  # the user's line that made the dataset
        )


def _refuse_fields(reader: AnyReader) -> None:
    """OptionError for a pack of several fields (format 4): its samples are not images."""
    from lmdbfolder.read.fields import samples_manifest

    meta = samples_manifest(reader)
    specs = meta.field_specs if meta is not None else None
    if specs is not None:
        raise OptionError(
            f"{reader.path}: its samples hold several fields ({', '.join(f.name for f in specs)}), "
            "not an image and a label",
            "read it with lmdbfolder.torch.LMDBDataset",
        )


@contextlib.contextmanager
def _torch_threads(n: int) -> Any:
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _torchvision_readers() -> tuple[Any, ...]:
    import torchvision.io as tio

    return (pil_loader, default_loader, accimage_loader, tio.decode_image, tio.read_image, tio.read_file)


def _refuse_datasetfolder_order(transform: Any, target_transform: Any) -> None:
    # DatasetFolder's order is (root, loader, extensions, ...): a loader there lands in
    # ``transform`` and would fail at the first sample, far from the cause.
    if transform is not None and any(transform is f for f in _torchvision_readers()):
        raise TypeError(
            f"LMDBFolder takes ImageFolder's arguments (root, transform, target_transform, loader, ...), "
            f"but transform is the loader {getattr(transform, '__name__', transform)!r}: pass loader=..., or use "
            "LMDBDatasetFolder for DatasetFolder's order (root, loader, extensions, ...)"
        )
    if target_transform is not None and not callable(target_transform):
        raise TypeError(
            f"target_transform must be callable, got {target_transform!r}; for DatasetFolder's order "
            "(root, loader, extensions, ...) use LMDBDatasetFolder"
        )


def _root_as_given(given: Any, path: str) -> Any:
    # ``root`` keeps the type it was given (a ``pathlib.Path`` stays one, as in
    # ImageFolder); its value is the pack's directory.
    return type(given)(path) if isinstance(given, pathlib.PurePath) else path


def _same_path(a: Any, b: Any) -> bool:
    return os.path.abspath(os.path.expanduser(os.fspath(a))) == os.path.abspath(os.fspath(b))


def _match_in_order(
    paths: list[str], current: list[str], pack_index: Callable[[int], int], lookup: Callable[[str], int]
) -> np.ndarray:
    # The usual new list is the old one filtered (``[s for s in ds.samples if ...]``):
    # find each path by walking the old list once; a path out of order is looked up.
    out = np.empty(len(paths), dtype=np.int64)
    j, n = 0, len(current)
    for k, p in enumerate(paths):
        while j < n and current[j] is not p and current[j] != p:
            j += 1
        if j < n:
            out[k] = pack_index(j)
            j += 1
        else:
            out[k] = lookup(p)
    return out


class _SampleList(list):  # type: ignore[type-arg]
    """``samples`` as a list that refuses changes in place: the dataset would not see
    them (ImageFolder's would), so say how to change it instead."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "LMDBFolder.samples cannot be changed in place; assign a new list instead, "
            "e.g. ds.samples = [s for s in ds.samples if ...]"
        )

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (list(self),))
