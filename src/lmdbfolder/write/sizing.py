"""How many bytes LMDB will use for a pack: the map size and the free-space check.

``plan`` makes the whole decision for one pack, once: it samples the record
sizes, models LMDB's pages and returns a ``Plan`` (page size, map size, the
estimate and the mean record size) that the writer uses as it is.

LMDB stores data in pages (the OS page size, 4096 bytes here; at most 32 KB).
The rules below are LMDB 0.9's (``mdb.c``), for our keys (8 bytes) and
values (the 32-byte record header plus the payload):

* A leaf node is an 8-byte node header, the key and the value, rounded up to
  an even size, plus a 2-byte slot in the page's index: ``EVEN(8 + 8 + v) + 2``.
* A value whose node would exceed ``me_nodemax``
  (``((psize - PAGEHDRSZ) / MDB_MINKEYS) & -2``, minus the 2-byte slot:
  2038 bytes for 4 KB pages, so values over 2022 bytes) goes to its own run
  of overflow pages, ``(PAGEHDRSZ - 1 + v) / psize + 1`` of them (a 16-byte
  page header, then the value); the leaf keeps a node of 8 + 8 + 8 (the page
  number) bytes, 26 with its slot.
* The writer appends (``MDB_APPEND``), so a full leaf page stays full: the
  split starts the next page with the new key alone. Branch pages (18 bytes
  a child) are split in the middle, so they end about half full.

A pack of small files pays for the page rounding: a 3 KB JPEG takes a whole
4 KB page, a 4.1 KB one two. So the estimate is built from the sampled file
sizes themselves (their distribution, not only their mean), record by record,
plus the leaf and branch pages, the label and path tables, the manifest and
the checkpoint. Its margin is the sampling error: the sizes come from up to
5000 evenly spaced ``stat`` calls (``SourceList.sample_file_sizes``), and the
estimate of the total is ``N * mean`` of the sampled per-record pages, with
a standard error of ``N * sd / sqrt(n) * sqrt(1 - n / N)``; four standard
errors are added. Packs that store something else than the file bytes
(``store="raw"``, pack-time resize) sample the records themselves: a few
hundred evenly spaced files go through the real record builder.
"""

from __future__ import annotations

import json
import math
import mmap
from dataclasses import dataclass
from typing import Sequence

from PIL import Image

from lmdbfolder.format import KEY, RECORD_HEADER
from lmdbfolder.write.options import PackOptions
from lmdbfolder.write.records import Loaded, load_sample
from lmdbfolder.write.sources import SourceList

__all__ = [
    "Plan",
    "plan",
    "RAW_EXPANSION",
    "estimate_pack_bytes",
    "PAGE_HEADER",
    "page_size",
    "node_max",
    "overflow_pages",
    "leaf_node_bytes",
    "RecordSizes",
    "Estimate",
    "estimate_pack",
    "sample_records",
    "tables_bytes",
    "MAX_STAT",
]

#: LMDB's PAGEHDRSZ: page number, padding, flags, lower and upper bounds.
PAGE_HEADER = 16
_NODE_HEADER = 8  # NODESIZE
_SLOT = 2  # sizeof(indx_t)
_PGNO = 8  # sizeof(pgno_t): what a leaf keeps of a value on overflow pages
_MIN_KEYS = 2  # MDB_MINKEYS
_MAX_PAGE = 0x8000  # MAX_PAGESIZE: LMDB never uses larger pages
#: Pages that are not records, the B-tree or the tables: the two meta pages,
#: the free-page list, and the pages a commit copies before the old copies
#: become reusable two transactions later (the rightmost leaf and branch path).
_FIXED_PAGES = 64
#: Standard errors of the sampled mean added to the estimate.
_Z = 4.0
#: The least spread assumed for the per-record pages (see RecordSizes.record_pages).
_MIN_CV = 0.25
#: Files ``stat``-ed to learn the file sizes (evenly spaced; all of them below twice this).
MAX_STAT = 5000
#: Files put through the record builder to learn the record sizes of raw or resized packs.
_RECORD_SAMPLE = 256
#: Room added to every map on top of the estimate. The map is sparse on Linux:
#: unused room costs address space, not disk.
_MIN_MAP = 64 << 20
#: Decoded RGB pixels vs JPEG bytes, for planning ``--store raw`` packs only.
RAW_EXPANSION = 8


@dataclass(frozen=True)
class Plan:
    """The sizes one pack is written with, decided by ``plan``.

    ``records`` are the sampled record sizes of its ``count`` sources; pages
    are ``page_size`` bytes; ``tables`` bounds the label and path tables and
    the manifest. ``estimate`` is what the whole pack will take on disk and
    ``map_size`` the map it is opened with (the estimate with its margin, plus
    room; the map still grows if a batch does not fit).
    """

    records: RecordSizes
    count: int
    page_size: int
    tables: int
    estimate: Estimate
    map_size: int

    @property
    def mean_value_size(self) -> float:
        """Mean record value size in bytes, at least 1 (it sizes the batches and the read-ahead)."""
        return max(1.0, self.records.mean_value)

    def remaining(self, done: int) -> Estimate:
        """Bytes still to be written once the first ``done`` sources are (a resumed pack)."""
        return estimate_pack(self.records, self.count - done, self.page_size, tables=self.tables)

    def with_page_size(self, psize: int) -> Plan:
        """This plan for an environment whose pages are ``psize`` bytes (a partial pack
        started on a system with another page size); the samples are reused."""
        return _plan(self.records, self.count, psize, self.tables)


def plan(sources: SourceList, options: PackOptions, *, mean_size: float | None = None) -> Plan:
    """Decide the sizes of a pack of ``sources`` written with ``options``.

    The record sizes are sampled (``sample_records``), or, when the samples
    come from elsewhere than files (``pack_sources(loader=...)``), known only
    by their mean payload ``mean_size``. The map and the free-space check come
    from this one model of LMDB's page use: with a map sized from the mean,
    records of 2-6 KB (whole pages each) overran it at ImageNet size.
    """
    records = sample_records(sources, options) if mean_size is None else RecordSizes.of_mean(mean_size, len(sources))
    return _plan(records, len(sources), page_size(), tables_bytes(sources))


def _plan(records: RecordSizes, count: int, psize: int, tables: int) -> Plan:
    estimate = estimate_pack(records, count, psize, tables=tables)
    return Plan(records, count, psize, tables, estimate, _map_size(estimate))


def _map_size(estimate: Estimate) -> int:
    """The map for a pack of ``estimate``: its upper bound plus _MIN_MAP, in whole MiB."""
    return -(-(estimate.upper + _MIN_MAP) // (1 << 20)) << 20


def estimate_pack_bytes(sources: SourceList, store: str = "encoded") -> float:
    """Expected size of a pack of ``sources`` from the mean file size alone (up to 5000
    evenly spaced ``stat`` calls): enough to choose a number of shards, not to size a map."""
    expansion = RAW_EXPANSION if store == "raw" else 1
    return len(sources) * (sources.mean_file_size() * expansion + RECORD_HEADER.size)


def page_size() -> int:
    """The page size LMDB gives a new environment here: the OS page size, at most 32 KB."""
    return min(mmap.PAGESIZE, _MAX_PAGE)


def node_max(psize: int) -> int:
    """LMDB's ``me_nodemax``: the largest leaf node; larger values go to overflow pages."""
    return (((psize - PAGE_HEADER) // _MIN_KEYS) & -2) - _SLOT


def _even(n: int) -> int:
    return (n + 1) & -2


def overflow_pages(value: int, psize: int) -> int:
    """Overflow pages a value of ``value`` bytes takes (0 when it fits in its leaf node)."""
    if _NODE_HEADER + KEY.size + value <= node_max(psize):
        return 0
    return (PAGE_HEADER - 1 + value) // psize + 1


def leaf_node_bytes(value: int, psize: int) -> int:
    """Bytes of a leaf page a record with a value of ``value`` bytes takes (node and slot)."""
    inline = _NODE_HEADER + KEY.size + value
    if inline > node_max(psize):
        inline = _NODE_HEADER + KEY.size + _PGNO
    return _even(inline) + _SLOT


@dataclass(frozen=True)
class Estimate:
    """Bytes a pack (or its remaining part) will take: ``expected`` and, to cover the
    sampling error, ``upper`` (what the map and the free-space check use)."""

    expected: int
    margin: int

    @property
    def upper(self) -> int:
        """``expected + margin``."""
        return self.expected + self.margin


@dataclass(frozen=True)
class RecordSizes:
    """What is known of the records' value sizes (header + payload).

    ``values`` are sampled value sizes; ``population`` is how many sources
    they were sampled from. ``mean_only``: only the mean is known
    (``values`` holds it once), so pages are bounded rather than counted.
    """

    values: tuple[int, ...]
    population: int
    mean_only: bool = False

    @classmethod
    def of_files(cls, file_sizes: Sequence[int], population: int) -> RecordSizes:
        """Records that store each file's bytes unchanged (``store="encoded"``)."""
        return cls(tuple(RECORD_HEADER.size + s for s in file_sizes), population)

    @classmethod
    def of_mean(cls, mean_payload: float, population: int) -> RecordSizes:
        """Only the mean payload size is known (``pack_sources(loader=..., mean_size=...)``)."""
        return cls((RECORD_HEADER.size + max(0, math.ceil(mean_payload)),), population, mean_only=True)

    @property
    def mean_value(self) -> float:
        """Mean value size in bytes (0 when nothing was sampled)."""
        return sum(self.values) / len(self.values) if self.values else 0.0

    def record_pages(self, count: int, psize: int) -> tuple[float, float]:
        """(expected pages, margin in pages) of ``count`` records: overflow pages plus
        their share of leaf pages."""
        if not self.values or count <= 0:
            return 0.0, 0.0
        usable = psize - PAGE_HEADER
        if self.mean_only:
            # E[ceil(x)] <= E[x] + 1: a bound from the mean alone, whatever the spread.
            v = self.values[0]
            bound = (PAGE_HEADER - 1 + v) / psize + 1 if overflow_pages(v, psize) else 0.0
            node = leaf_node_bytes(v, psize)
            # Inline values: at least one node of this size fits a page less than the ideal.
            bound += node / max(1, usable - node)
            return count * bound, 0.0
        pages = [overflow_pages(v, psize) for v in self.values]
        nodes = [leaf_node_bytes(v, psize) for v in self.values]
        n = len(pages)
        leaf_per_byte = _leaf_pages(nodes, usable) / _repeated_bytes(nodes)
        per = [p + nd * leaf_per_byte for p, nd in zip(pages, nodes)]
        mean = sum(per) / n
        var = sum((x - mean) ** 2 for x in per) / (n - 1) if n > 1 else 0.0
        # Finite population: a sample of every source has no sampling error.
        fpc = max(0.0, 1 - n / self.population) if self.population else 0.0
        # A few samples say little about the spread: assume a coefficient of
        # variation of at least _MIN_CV (it only matters for tiny samples or
        # files that all round to the same pages).
        var = max(var, (_MIN_CV * mean) ** 2)
        margin = _Z * count * math.sqrt(var / n * fpc)
        return count * mean, margin


def tables_bytes(sources: SourceList) -> int:
    """Bytes of the label table, the path table and the manifest of a pack of ``sources``
    (an upper bound: skipped files make them smaller)."""
    n = len(sources)
    paths = getattr(sources.relpaths, "nbytes", None)
    if paths is None:
        paths = 8 * (n + 1) + sum(len(p.encode("utf-8", "surrogateescape")) for p in sources.relpaths)
    classes = len(json.dumps(sources.classes, ensure_ascii=True))
    # The manifest holds the classes twice (list and class_to_idx) and a few KB of fields.
    manifest = 2 * classes + 8 * len(sources.classes) + (16 << 10)
    return 4 * n + int(paths) + manifest


def estimate_pack(sizes: RecordSizes, count: int, psize: int, *, tables: int, checkpoint: int = 4096) -> Estimate:
    """Bytes LMDB will use for ``count`` records of ``sizes``, plus the tables
    (``tables`` bytes) and the checkpoint (``checkpoint`` bytes, held twice while
    a commit replaces it): the file size of a finished pack, and its margin."""
    record_pages, margin_pages = sizes.record_pages(count, psize)
    leaf = count * _mean_leaf_pages(sizes, psize) if count > 0 else 0.0
    branch_slots = (psize - PAGE_HEADER) // (_even(_NODE_HEADER + KEY.size) + _SLOT)
    branch = 2 * leaf / max(1, branch_slots) + 4  # half-full branch pages, plus one per level
    extra = _pages(tables, psize) + 2 * _pages(checkpoint, psize) + _FIXED_PAGES
    expected = (record_pages + branch + extra) * psize
    return Estimate(int(math.ceil(expected)), int(math.ceil(margin_pages * psize)))


def _mean_leaf_pages(sizes: RecordSizes, psize: int) -> float:
    # Leaf pages per record (also inside record_pages); the branch count needs it apart.
    nodes = [leaf_node_bytes(v, psize) for v in sizes.values]
    if not nodes:
        return 0.0
    return _leaf_pages(nodes, psize - PAGE_HEADER) / _repeated_bytes(nodes) * (sum(nodes) / len(nodes))


#: Nodes placed when simulating leaf pages (the sample repeated up to this many).
_SIMULATED_NODES = 1 << 14


def _repeated_bytes(nodes: list[int]) -> int:
    reps = max(1, -(-_SIMULATED_NODES // len(nodes)))
    return sum(nodes) * reps


def _leaf_pages(nodes: list[int], usable: int) -> int:
    """Leaf pages that appending the sampled nodes (repeated) fills.

    With MDB_APPEND a node that does not fit starts a new page and the old one
    keeps its unused tail: that tail is what a page loses (nothing for 26-byte
    nodes of overflow records, half a page for 2 KB inline values).
    """
    reps = max(1, -(-_SIMULATED_NODES // len(nodes)))
    pages, fill = 1, 0
    for _ in range(reps):
        for nd in nodes:
            if fill + nd > usable:
                pages += 1
                fill = 0
            fill += nd
    return pages


def _pages(nbytes: int, psize: int) -> int:
    # Tables and the checkpoint are single large values: overflow runs.
    return (PAGE_HEADER - 1 + nbytes) // psize + 1


def sample_records(sources: SourceList, options: PackOptions, max_stat: int | None = None) -> RecordSizes:
    """The record sizes of ``sources`` packed with ``options``, sampled.

    Encoded packs: ``stat`` of up to ``max_stat`` (``MAX_STAT``) evenly spaced files (a record
    is the file plus its header). Raw or resized packs: up to 256 of those
    files (at most one in 16 of the sources) are turned into records by the
    writer's own ``load_sample``, without writing anything.
    """
    sampled = sources.sample_file_sizes(MAX_STAT if max_stat is None else max_stat)
    if options.store == "encoded" and options.resize is None:
        return RecordSizes.of_files([s for _, s in sampled], len(sources))
    k = max(1, min(_RECORD_SAMPLE, len(sampled), len(sources) // 16))
    picked = [sampled[int(j * len(sampled) / k)][0] for j in range(k)] if sampled else []
    values = []
    for i in picked:
        result = load_sample(
            sources.abspath(i),
            sources.labels[i],
            store=options.store,
            check="none",
            max_pixels=Image.MAX_IMAGE_PIXELS,
            resize=options.resize,
        )
        if isinstance(result, Loaded):
            values.append(len(result.value))
    return RecordSizes(tuple(values), len(sources))
