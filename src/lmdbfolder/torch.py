"""PyTorch integration: ``LMDBFolder``, a drop-in for ``torchvision.datasets.ImageFolder``
(and ``LMDBDatasetFolder``, the same with ``DatasetFolder``'s argument order).

This is the only module that imports torch (and torchvision, whose dataset
classes these subclass). It is safe with DataLoader workers under fork,
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
from typing import Any, Callable, Sequence

import numpy as np

from lmdbfolder.errors import DecodeError, MissingDependencyError, OptionError

try:
    import torch
    import torch.utils.data
    from torchvision import get_image_backend
    from torchvision.datasets import DatasetFolder, ImageFolder, VisionDataset
    from torchvision.datasets.folder import IMG_EXTENSIONS, accimage_loader, default_loader, pil_loader
except ImportError as exc:  # a core-only install: say what to install
    raise MissingDependencyError("lmdbfolder.torch (LMDBFolder)", "torch", "torch and torchvision") from exc

from lmdbfolder import fused
from lmdbfolder.codecs import decode_rgb
from lmdbfolder.read.batching import BatchDecoder, BatchItemError, CropJob
from lmdbfolder.read.decoders import (
    Decoder,
    decode_payload,
    get_decoder,
    resolve_decoder_name,
    size_hint_scale,
    to_pil,
)
from lmdbfolder.read.opening import AnyReader, open_pack
from lmdbfolder.read.reader import Record
from lmdbfolder.read.regions import regions_apply
from lmdbfolder.read.selection import (
    PathIndex,
    normalize_extensions,
    sample_path,
    select,
    source_root_of,
)
from lmdbfolder.read.stored_file import stored_file

__all__ = ["LMDBFolder", "LMDBDatasetFolder", "BatchSamples", "collate"]


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
        loader: ``None`` (default), torchvision's ``default_loader`` or
            ``pil_loader``: the stored image is decoded to RGB by lmdbfolder,
            exactly as ``pil_loader`` does (and with ``decoder``, ``size_hint``
            and the fused crop). Any other callable is called as ImageFolder
            calls it, with a path: a ``str`` naming a file that holds exactly
            the packed bytes of the sample (in memory on Linux), whose
            ``.source`` is the sample's path in ``samples``. So loaders that
            open a path work unchanged (``accimage_loader``,
            ``torchvision.io.decode_image``/``read_image``, ``cv2.imread``,
            ``Image.open``, ``np.load``, copies of ``pil_loader``); one that
            parses the name should read ``path.source``. Needs a pack that
            stores the files (not ``--store raw``).
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
        root: the pack directory. ``source_root``: see above.
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

    def __init__(
        self,
        root: str | os.PathLike[str],
        loader: Callable[[str], Any] | None = None,
        extensions: str | tuple[str, ...] | None = None,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        *,
        source_root: str | os.PathLike[str] | None = None,
        readahead: bool = True,
        verify_checksums: bool = True,
        decoder: str = "auto",
        size_hint: int | None = None,
        prefetch: bool = False,
        threads: int = 1,
        torch_threads: int | None = 1,
    ) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise OptionError(f"threads must be a whole number of at least 1, got {threads!r}")
        if torch_threads is not None and (isinstance(torch_threads, bool) or torch_threads < 1):
            raise OptionError(f"torch_threads must be None or at least 1, got {torch_threads!r}")
        self.threads = threads
        self.torch_threads = torch_threads
        self._batcher: BatchDecoder | None = None
        self._decoder_name: str | None = None
        self.decoder = decoder
        if size_hint is not None and size_hint < 1:
            raise ValueError(f"size_hint must be a positive number of pixels, got {size_hint}")
        if extensions is not None and is_valid_file is not None:
            raise ValueError("Both extensions and is_valid_file cannot be not None at the same time")
        self.size_hint = size_hint
        self.prefetch = prefetch
        self._decoder: Decoder | None = None
        self._split: tuple[Any, Any, Any] | None = None
        self._indices: np.ndarray | None = None
        self._labels: Any = None
        self._targets: list[Any] | None = None
        self._samples: list[tuple[str, Any]] | None = None
        self._assigned_targets: Any = None
        self.reader: AnyReader = open_pack(root, readahead=readahead, verify_checksums=verify_checksums)
        VisionDataset.__init__(self, self.reader.path, transform=transform, target_transform=target_transform)
        self.recorded_root = source_root_of(self.reader.meta)
        self.source_root = self.recorded_root
        if source_root is not None:
            self.source_root = os.path.abspath(os.path.expanduser(os.fspath(source_root)))
        self.loader = default_loader if loader is None else loader
        if not _decodes_itself(self.loader) and self.reader.store == "raw":
            raise OptionError(_RAW_LOADER, _RAW_LOADER_HINT)
        source = self.reader.meta.get("source") or {}
        if extensions is not None:
            self.extensions: tuple[str, ...] | None = normalize_extensions(extensions)
        elif is_valid_file is not None or source.get("is_valid_file"):
            self.extensions = None  # a callable chose the files, as ImageFolder's None says
        else:
            self.extensions = tuple(source.get("extensions") or IMG_EXTENSIONS)

        classes, class_to_idx = self.find_classes(self.root)
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
            chosen = select(
                self.reader,
                self.source_root,
                class_to_idx,
                extensions=extensions,
                is_valid_file=is_valid_file,
                allow_empty=allow_empty,
            )
            self._indices, self._labels = chosen.indices, chosen.labels
        self.classes: list[str] = classes
        self.class_to_idx: dict[str, int] = class_to_idx

    # -- ImageFolder's overridable steps ------------------------------------------------------
    def find_classes(self, directory: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
        """The classes of the pack at ``directory`` and their indices, as packed.

        Override it (as for ImageFolder) to use a subset of the classes or
        other indices: the samples of the classes it leaves out are dropped,
        the others get its indices.
        """
        if _same_path(directory, self.root):
            return list(self.reader.classes), dict(self.reader.class_to_idx)
        with open_pack(directory) as other:
            return list(other.classes), dict(other.class_to_idx)

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
        return len(self.reader) if self._indices is None else len(self._indices)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        with self._torch_threads():
            if self._indices is None and self._labels is None:
                return self._sample(self.reader.get(index), None)
            position = self._position(index)
            return self._sample(self.reader.get(self._pack_index(position)), position)

    def _torch_threads(self) -> Any:
        """One torch thread while a sample is made in the main process, like a DataLoader worker."""
        if self.torch_threads is None or torch.utils.data.get_worker_info() is not None:
            return contextlib.nullcontext()
        return _torch_threads(self.torch_threads)

    # -- the batch fast path ------------------------------------------------------------------
    def _batch_recipe(self) -> Any:
        """``fused.BatchRecipe`` if this dataset's batches can take the fast path, else None."""
        if not _decodes_itself(self.loader):
            return None
        crop, rest = self._fused_split()
        if crop is None:
            return None
        return fused.batch_recipe(crop, rest)

    def _target(self, rec: Record, position: int | None) -> Any:
        target: Any = rec.label
        if position is not None and self._labels is not None:
            target = self._labels[position]
            if isinstance(target, np.integer):
                target = int(target)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return target

    def _fast_batch(self, records: list[Record], positions: list[int | None], flip: float | None) -> BatchSamples:
        """Plan every box and flip (the per-sample random numbers, in the per-sample
        order: a sample's box, then its flip), then make the whole batch into one
        tensor (``read.batching``)."""
        crop, _rest = self._fused_split()
        decoder = self._get_decoder()
        jobs = []
        targets = []
        for rec, position in zip(records, positions):
            box, denom = crop.plan(rec.width, rec.height, decoder)
            if rec.encoding == "raw":
                denom = 1
            flipped = flip is not None and bool(torch.rand(1) < flip)
            jobs.append(CropJob(rec.payload, rec.encoding, rec.width, rec.height, rec.channels, box, denom, flipped))
            targets.append(self._target(rec, position))
        out_h, out_w = crop.size
        nbytes = len(jobs) * out_h * out_w * 3
        # In a DataLoader worker the batch goes to the main process through shared
        # memory: allocate it there, so sending it copies nothing.
        in_worker = torch.utils.data.get_worker_info() is not None
        storage = torch.UntypedStorage._new_shared(nbytes) if in_worker else torch.UntypedStorage(nbytes)
        images = torch.empty(0, dtype=torch.uint8).set_(storage).view(len(jobs), 3, out_h, out_w)
        if self._batcher is None:
            resample = int(pil_modes_mapping_of(crop))
            self._batcher = BatchDecoder(decoder, threads=self.threads, resize=crop.resize, resample=resample)
        try:
            self._batcher.run(jobs, images.numpy())
        except BatchItemError as exc:
            rec = records[exc.position]
            raise DecodeError(
                rec.index, self.reader.path_of(rec.index), f"{type(exc.cause).__name__}: {exc.cause}"
            ) from exc.cause
        return BatchSamples(images, targets)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A whole batch (the DataLoader calls this): the records are fetched
        together, prefetched from disk at once, then decoded one by one.

        If a subclass overrides ``__getitem__``, this calls it for each index
        instead, so a batched DataLoader gives what ``ds[i]`` gives.
        """
        if type(self).__getitem__ is not LMDBDatasetFolder.__getitem__:
            return [self[i] for i in indices]
        with self._torch_threads():
            if self._indices is None and self._labels is None:
                records = self.reader.get_many(indices, prefetch=self.prefetch)
                positions: list[int | None] = [None] * len(records)
            else:
                chosen = [self._position(i) for i in indices]
                records = self.reader.get_many([self._pack_index(p) for p in chosen], prefetch=self.prefetch)
                positions = list(chosen)
            recipe = self._batch_recipe()
            if recipe is not None and records and all(r.width > 0 and r.height > 0 for r in records):
                return self._fast_batch(records, positions, recipe.flip)
            return [self._sample(rec, p) for rec, p in zip(records, positions)]

    def _position(self, index: int) -> int:
        try:
            i = index.__index__()
        except AttributeError:
            raise TypeError(f"sample index must be an integer, got {type(index).__name__}") from None
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for {self.root} ({n} samples)")
        return i

    def _pack_index(self, position: int) -> int:
        return position if self._indices is None else int(self._indices[position])

    def _sample(self, rec: Record, position: int | None) -> tuple[Any, Any]:
        sample = self._decode(rec) if _decodes_itself(self.loader) else self._load_with_loader(rec)
        return sample, self._target(rec, position)

    def _decode(self, rec: Record) -> Any:
        crop, rest = self._fused_split()
        try:
            if crop is not None:
                sample: Any = crop.decode_record(
                    rec.payload, rec.encoding, rec.width, rec.height, rec.channels, self._get_decoder()
                )
            elif self.decoder == "pillow" and self.size_hint is None:
                sample = decode_rgb(rec.payload, rec.encoding, rec.width, rec.height)
            else:
                decoder = self._get_decoder()
                denom = 1
                if self.size_hint is not None:
                    denom = size_hint_scale(rec.width, rec.height, self.size_hint, decoder.scales)
                sample = to_pil(
                    decode_payload(rec.payload, rec.encoding, rec.width, rec.height, rec.channels, decoder, denom=denom)
                )
        except Exception as exc:  # decoders raise many exception types for bad data
            raise DecodeError(rec.index, self.reader.path_of(rec.index), f"{type(exc).__name__}: {exc}") from exc
        if rest is not None:
            sample = rest(sample)
        return sample

    def _load_with_loader(self, rec: Record) -> Any:
        # ImageFolder calls loader(path): give it a path to the stored bytes (read.stored_file).
        if rec.encoding == "raw":
            raise OptionError(_RAW_LOADER, _RAW_LOADER_HINT)
        source = sample_path(self.source_root, self.reader.path_of(rec.index))
        with stored_file(rec.payload, source, rec.index) as path:
            try:
                sample = self.loader(path)
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"lmdbfolder: loader {self.loader!r} failed on record {rec.index} ({source})")
                raise
            if self.transform is not None:
                sample = self.transform(sample)  # inside the block: a lazy loader may still read the file
        return sample

    def _get_decoder(self) -> Decoder:
        if self._decoder is None:
            self._decoder = get_decoder(self.decoder)
        return self._decoder

    @property
    def decoder(self) -> str:
        """The JPEG decoder's name; ``"auto"`` is resolved at first use, once per
        dataset (the probe decode costs ~10 ms, more than opening a pack)."""
        if self._decoder_name is None:
            self._decoder_name = resolve_decoder_name("auto")
        return self._decoder_name

    @decoder.setter
    def decoder(self, name: str) -> None:
        if name == "auto":
            self._decoder_name = None  # nothing can fail: Pillow is the fallback
        else:
            self._decoder_name = resolve_decoder_name(name)  # unknown names fail here
            get_decoder(self._decoder_name)  # so does a missing library (with its install hint), not in a worker
        self._decoder = None
        self._batcher = None

    def _fused_split(self) -> tuple[Any, Any]:
        # (fused crop or None, the transforms after it); recomputed only when
        # ``transform`` is replaced. torchvision's own RandomResizedCrop at the
        # front is replaced by its exact fused twin (``fused.split_exact``).
        split = self._split
        if split is None or split[0] is not self.transform:
            crop, rest = None, self.transform
            if self.transform is not None:
                # size_hint asks for the DCT-scaled full image: no exact twin then.
                splitter = fused.split_exact if self.size_hint is None else fused.split_fused
                crop, rest = splitter(self.transform)
            split = self._split = (self.transform, crop, rest)
        return split[1], split[2]

    # -- ImageFolder's lists --------------------------------------------------------------------
    def _current_labels(self) -> list[Any]:
        if self._labels is not None:
            return self._labels.tolist() if isinstance(self._labels, np.ndarray) else list(self._labels)
        stored = self.reader.labels
        if self._indices is None:
            return stored.tolist()
        return np.frombuffer(stored, dtype=np.int32)[self._indices].tolist()

    @property
    def targets(self) -> Any:
        """Class index of every sample, in index order (or the list last assigned to it)."""
        if self._assigned_targets is not None:
            return self._assigned_targets
        if self._targets is None:
            self._targets = self._current_labels()
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
            paths = self.reader.paths()
            if self._indices is not None:
                paths = [paths[i] for i in self._indices.tolist()]
            root = self.source_root
            self._samples = _SampleList(zip([sample_path(root, p) for p in paths], self._current_labels()))
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
            indices = _match_in_order([p for p, _ in items], current_paths, self._pack_index, lookup)
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
        self._indices = None if every else indices
        self._labels = labels
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
        paths = self.reader.paths()
        if self._indices is not None:
            paths = [paths[i] for i in self._indices.tolist()]
        if basename:
            return [os.path.basename(p) for p in paths]
        if absolute:
            return [sample_path(self.source_root, p) for p in paths]
        return paths

    def filename(self, index: int, basename: bool = False, absolute: bool = False) -> str:
        """The file name of sample ``index`` (see ``filenames``)."""
        rel = self.reader.path_of(self._pack_index(self._position(index)))
        if basename:
            return os.path.basename(rel)
        return sample_path(self.source_root, rel) if absolute else rel

    @property
    def shard_offsets(self) -> list[int] | None:
        """First index of each shard, then ``len(self)`` (sharded packs only; for the
        shard-aware sampler). A selection out of pack order counts as one shard."""
        offsets = getattr(self.reader, "shard_offsets", None)
        if offsets is None or self._indices is None:
            return offsets
        idx = self._indices
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
        state["_decoder"] = None  # decoders hold library handles; made again per process
        state["_split"] = None
        state["_batcher"] = None  # a thread pool: made again per process
        return state

    def extra_repr(self) -> str:
        """The pack-specific lines of ``repr`` (after VisionDataset's count and root)."""
        regions = "on" if regions_apply(self.decoder) else "off"
        lines = [
            f"Source root: {self.source_root}",
            f"Store: {self.reader.store}, decoder: {self.decoder}, crop regions: {regions}",
        ]
        if self._indices is not None:
            lines.append(f"Selected: {len(self)} of {len(self.reader)} packed samples")
        if not _decodes_itself(self.loader):
            lines.append(f"Loader: {self.loader!r}")
        return "\n".join(lines)


class LMDBFolder(LMDBDatasetFolder, ImageFolder):
    """A packed image dataset with the interface of ``torchvision.datasets.ImageFolder``.

    ``LMDBFolder(root, transform, target_transform, loader, is_valid_file,
    allow_empty)``: ImageFolder's arguments, in its order, with its meaning
    (see ``LMDBDatasetFolder`` for each, and for ``extensions``,
    ``source_root``, ``decoder``, ``size_hint``, ``readahead``,
    ``verify_checksums`` and ``prefetch``, which are keyword-only here). Code
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

    def __init__(
        self,
        root: str | os.PathLike[str],
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
        loader: Callable[[str], Any] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        *,
        extensions: str | tuple[str, ...] | None = None,
        source_root: str | os.PathLike[str] | None = None,
        readahead: bool = True,
        verify_checksums: bool = True,
        decoder: str = "auto",
        size_hint: int | None = None,
        prefetch: bool = False,
        threads: int = 1,
        torch_threads: int | None = 1,
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
            source_root=source_root,
            readahead=readahead,
            verify_checksums=verify_checksums,
            decoder=decoder,
            size_hint=size_hint,
            prefetch=prefetch,
            threads=threads,
            torch_threads=torch_threads,
        )


class BatchSamples(list):  # type: ignore[type-arg]
    """A batch made by the fast path: a list of ``(image, target)`` like any other
    (each image a view of one batch tensor), which ``collate`` turns into
    ``[images, targets]`` without copying ``images``."""

    images: Any
    targets: list[Any]

    def __init__(self, images: Any, targets: list[Any]) -> None:
        super().__init__(zip(images, targets))
        self.images = images
        self.targets = targets

    @classmethod
    def of(cls, samples: list[tuple[Any, Any]]) -> BatchSamples:
        """A batch of samples made one by one (stacked here once)."""
        return cls(torch.stack([x for x, _ in samples]), [t for _, t in samples])


def collate(batch: Any) -> Any:
    """``collate_fn`` for a DataLoader over an ``LMDBFolder``: a batch from the fast
    path becomes ``[images, targets]`` as is (no copy); anything else goes
    through torch's ``default_collate``.

    Example:
        >>> loader = DataLoader(ds, batch_size=256, shuffle=True, collate_fn=collate)  # doctest: +SKIP
    """
    if isinstance(batch, BatchSamples):
        targets = batch.targets
        if all(type(t) is int for t in targets):
            return [batch.images, torch.tensor(targets, dtype=torch.int64)]
        return [batch.images, torch.utils.data.default_collate(targets)]
    return torch.utils.data.default_collate(batch)


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


def pil_modes_mapping_of(crop: Any) -> int:
    """Pillow's resampling constant for a torchvision crop's ``interpolation``."""
    from torchvision.transforms.functional import pil_modes_mapping

    return int(pil_modes_mapping[crop.interpolation])


_RAW_LOADER = "loader= needs a pack that stores the image files, and this pack stores decoded pixels (--store raw)"
_RAW_LOADER_HINT = (
    "leave loader unset (the pixels need no loading) and do the rest in transform, or repack with --store encoded"
)


def _decodes_itself(loader: Any) -> bool:
    # torchvision's own loaders are pil_loader underneath (with the PIL backend): the
    # stored image is decoded here instead, to the same pixels, without a file.
    return loader is None or loader is pil_loader or (loader is default_loader and get_image_backend() == "PIL")


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
