"""Read an LMDB data file in a way that no damage to the file can crash: ``PageFile``.

Every read of a finished pack (readers, ``verify``, ``info``, ``copy``,
``import`` of a recipe LMDB, the write side looking into a finished shard)
goes through this module; py-lmdb is used only to write. Why (docs/design.md,
"Integrity"; the evidence is in docs/integrity-research.md):

* py-lmdb touches one byte of every 4 KB page of a value before it returns
  it (``preload()``, in ``Transaction.get`` and every cursor call, with
  ``buffers=True`` too), and LMDB takes a large value's size from its leaf
  node without checking it against the overflow page or the file. One flipped
  bit in that size kills the process with SIGBUS inside ``txn.get``.
* LMDB accepts any overflow page number below the last page, so a flipped
  page number returns another record's bytes.
* LMDB ``assert``s (SIGABRT) on some damaged pages, and one ``MDB_CORRUPTED``
  makes its read transaction refuse every later read (``MDB_BAD_TXN``).

``PageFile`` does the lookup that ``mdb_get`` does (the same binary search
over the same pages, so it finds what LMDB finds in an intact file) over its
own read-only ``mmap`` of exactly the file's size, and checks every page
number, page type, node offset and size before it uses it: damage becomes
``PageDamage``, never a signal, and a damaged page affects only the lookups
that pass through it. Values are zero-copy ``memoryview`` slices of that map;
they stay valid after ``close`` (the map goes with the last view). A map of a
regular file is fork-safe; readers still open their own in each process (see
``lmdbfolder.read.reader``) so that a worker notices a replaced pack.

``audit`` walks the whole file (both B-trees, overflow extents, the free
list) for ``verify`` and ``copy``.

Only regular files are opened (``open_regular``, which every file a pack or a
source names goes through): a FIFO named ``data.mdb`` would block the open
until some writer came, and a device never ends.

Format read: LMDB 0.9 (data version 1, 16-byte page header, 64-bit,
little-endian), which py-lmdb writes by default (also 3.0's default engine);
anything else is ``PageDamage(kind="format")``. Layout (``lib/mdb.c``):
every page starts with ``pgno u64, pad u16, flags u16, lower u16, upper u16``
(overflow pages: ``pages u32`` instead of lower and upper); branch and leaf
pages hold ``(lower - 16) / 2`` u16 node offsets after the header; a node is
``lo u16, hi u16, flags u16, ksize u16, key, data``, where a leaf's data
size is ``lo | hi << 16`` and a branch's child page is
``lo | hi << 16 | flags << 32``; an ``F_BIGDATA`` leaf's data is the u64
number of the first of ``OVPAGES(size)`` overflow pages, whose data starts 16
bytes into the first one. Pages 0 and 1 are meta pages; the one with the
higher txnid is current (``mdb_env_pick_meta``).

Limits: nothing can prevent SIGBUS when the file is truncated *in place*
after it was mapped, or on an I/O error of the disk (LMDB has the same
limits); lmdbfolder never truncates a pack in place (``pack --update``
changes one in place by LMDB transactions, which only grow the file; see
``committed_txnid``).
"""

from __future__ import annotations

import bisect
import errno
import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from lmdbfolder.errors import LmdbFolderError

__all__ = ["PageDamage", "PageFile", "ovpages", "Audit", "NotRegularFileError", "open_regular", "read_regular"]

PAGEHDRSZ = 16
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_DIRTY, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
CURSOR_STACK = 32  # LMDB's maximum tree depth
NUM_METAS = 2
NO_ROOT = (1 << 64) - 1  # md_root of an empty database
#: Parsed pages kept per file (then the cache starts over): bounds memory for
#: packs of small records, where leaves are many.
_CACHE_PAGES = 1 << 16
MDB_REVERSEKEY, MDB_DUPSORT, MDB_INTEGERKEY = 0x02, 0x04, 0x08

#: Page header: pgno, pad, flags, lower, upper.
PAGE_HEADER = struct.Struct("<QHHHH")
_OVERFLOW_HEADER = struct.Struct("<QHHI")
_NODE = struct.Struct("<HHHH")
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_U16_AT, _NODE_AT, _U64_AT, _OVERFLOW_AT = (
    _U16.unpack_from,
    _NODE.unpack_from,
    _U64.unpack_from,
    _OVERFLOW_HEADER.unpack_from,
)
#: MDB_meta after the page header: magic, version, address, mapsize, then two
#: MDB_db (pad, flags, depth, branch, leaf, overflow, entries, root), last_pg, txnid.
_META = struct.Struct("<IIQQ" + "IHHQQQQQ" * 2 + "QQ")

_UNEXPECTED = (struct.error, IndexError, ValueError, OverflowError)


class PageDamage(LmdbFolderError):
    """An LMDB data file is damaged where a read needed it.

    ``kind``: ``"format"`` (not a file this reader understands), ``"truncated"``
    or ``"page"``; ``pgno`` is the damaged page (None when not one page);
    ``why`` says what is wrong, without the file name.
    """

    hint = "run `lmdbfolder verify` on the pack to list what is damaged, then copy it from a good copy or repack it"

    def __init__(self, file: str, why: str, *, pgno: int | None = None, kind: str = "page") -> None:
        self.file = file
        self.why = why
        self.pgno = pgno
        self.kind = kind
        where = file if pgno is None else f"{file}, page {pgno}"
        super().__init__(f"{where} is damaged: {why}")


class NotRegularFileError(OSError):
    """A path that names a FIFO, a socket or a device where a regular file is read
    (an ``OSError`` with ``filename`` and a ``strerror`` that says what it is)."""


def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY) -> int:
    """A file descriptor of ``path``, opened for reading (``flags``), if it is a regular
    file; else ``IsADirectoryError`` for a directory and ``NotRegularFileError`` for a
    FIFO, socket or device, raised without blocking (a FIFO's open waits for a writer,
    ``/dev/zero`` never ends). Other ``OSError`` s as ``os.open`` raises them."""
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            what = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
            raise NotRegularFileError(errno.EINVAL, f"it is {what}, not a regular file", os.fspath(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike[str], limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (``open_regular``); with ``limit``, an
    ``OSError`` (EFBIG) for a file of more bytes than that, before reading it."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise OSError(errno.EFBIG, f"it holds {size:,} bytes, more than the {limit:,} allowed", os.fspath(path))
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read() if limit is None else f.read(limit + 1)[:limit]
    finally:
        os.close(fd)


def ovpages(size: int, psize: int) -> int:
    """Number of overflow pages LMDB uses for a value of ``size`` bytes (``OVPAGES``)."""
    return (PAGEHDRSZ - 1 + size) // psize + 1


@dataclass(frozen=True)
class DB:
    """One B-tree as a meta page describes it (``MDB_db``)."""

    pad: int
    flags: int
    depth: int
    branch_pages: int
    leaf_pages: int
    overflow_pages: int
    entries: int
    root: int


class PageFile:
    """Bounded, read-only lookups in one ``data.mdb`` (its main database).

    Args:
        path: the ``data.mdb`` file.
        readahead: False asks the kernel not to read ahead (``MADV_RANDOM``),
            as LMDB does with ``readahead=False``.

    Branch pages are parsed once and kept (the tree of a transaction never
    changes); leaf pages are searched in place. ``get`` costs a few
    microseconds. Raises PageDamage (``kind`` ``"format"`` or ``"truncated"``)
    when the file is not a complete LMDB 0.9 data file, and OSError when it
    cannot be read. ``previous``: read the tree of the other meta page, the
    commit before the current one (``pack --update`` commits each version in
    one transaction, so that is the version before; see ``committed_txnid``).
    Safe to share between threads (nothing it holds changes but its page
    cache, a dict).
    """

    def __init__(self, path: str | os.PathLike[str], *, readahead: bool = True, previous: bool = False) -> None:
        self.path = os.fspath(path)
        #: Read the tree of the meta page LMDB did not pick (the commit before the
        #: last one), not the current one: see ``committed_txnid``.
        self.previous = previous
        fd = open_regular(self.path)
        try:
            self.size = os.fstat(fd).st_size
            if self.size < 2 * 512:
                raise PageDamage(
                    self.path, f"it holds {self.size} bytes, too few for two LMDB meta pages", kind="format"
                )
            # Mapped at exactly the file's size: every address in the map is
            # backed by the file, and Python bounds-checks every access to it.
            self._mm = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if not readahead and hasattr(self._mm, "madvise"):
            self._mm.madvise(mmap.MADV_RANDOM)
        self._view = memoryview(self._mm)
        self._pages: dict[int, tuple[Any, ...]] = {}
        try:
            self._read_meta()
        except BaseException:
            self.close()
            raise

    # -- meta pages ------------------------------------------------------------
    def _meta_at(self, offset: int, where: int) -> tuple[int, ...]:
        if offset + PAGEHDRSZ + _META.size > self.size:
            raise PageDamage(self.path, f"meta page {where} lies beyond the end of the file", kind="truncated")
        _, _, flags, _, _ = PAGE_HEADER.unpack_from(self._mm, offset)
        fields = _META.unpack_from(self._mm, offset + PAGEHDRSZ)
        if not flags & P_META or fields[0] != MDB_MAGIC:
            raise PageDamage(self.path, f"page {where} is not an LMDB meta page", pgno=where, kind="format")
        if fields[1] != DATA_VERSION:
            raise PageDamage(
                self.path,
                f"LMDB data version {fields[1]}; this reader understands version {DATA_VERSION} (LMDB 0.9)",
                pgno=where,
                kind="format",
            )
        return fields

    def _read_meta(self) -> None:
        m0 = self._meta_at(0, 0)
        psize = m0[4]  # the free DB's md_pad holds the page size
        if psize < 512 or psize > 0x8000 or psize & (psize - 1):
            raise PageDamage(self.path, f"meta page 0 gives an impossible page size {psize}", pgno=0, kind="format")
        self.psize = psize
        m1 = self._meta_at(psize, 1)
        meta, which = (m1, 1) if m0[-1] < m1[-1] else (m0, 0)  # mdb_env_pick_meta
        if self.previous:
            meta, which = (m0, 0) if which else (m1, 1)
        self.metas = (m0, m1)
        (_, _, _, _, *dbs, last_pg, txnid) = meta
        self.free_db = DB(*dbs[0:8])
        self.main_db = DB(*dbs[8:16])
        self.txnid = txnid
        self.meta_page = which
        self.next_pgno = last_pg + 1
        self.main_flags, self.depth = self.main_db.flags, self.main_db.depth
        self.entries, self.root = self.main_db.entries, self.main_db.root
        if self.main_flags & (MDB_DUPSORT | MDB_INTEGERKEY | MDB_REVERSEKEY):
            raise PageDamage(
                self.path,
                f"its main database has flags 0x{self.main_flags:x}, not a plain key-value table",
                kind="format",
            )
        if self.next_pgno * psize > self.size:
            raise PageDamage(
                self.path,
                f"it is truncated: it holds {self.size:,} bytes but the database needs {self.next_pgno * psize:,}",
                kind="truncated",
            )
        for name, db in (("main", self.main_db), ("free", self.free_db)):
            if db.root != NO_ROOT and not NUM_METAS <= db.root < self.next_pgno:
                raise PageDamage(
                    self.path, f"meta page {which} names {name} root page {db.root}, out of range", pgno=which
                )

    def committed_txnid(self) -> int:
        """The id of the newest transaction committed to the file now (the larger
        txnid of the two meta pages, read again from the map).

        The map is shared with the file, so a writer's commits show here; the
        tree this ``PageFile`` reads stays the one of ``txnid`` (read at open).
        LMDB never overwrites a page of the tree of transaction ``T`` before
        transaction ``T + 3`` (pages freed by ``T + 1`` are reused from
        ``T + 3`` on, when no reader is registered, and ours are not), and
        writes a transaction's pages before its meta page: so lookups done
        before this returns at most ``txnid + 1`` read the tree of ``txnid``
        intact (``lmdbfolder.read.reader`` checks after each read).
        """
        at = PAGEHDRSZ + _META.size - 8
        return max(_U64.unpack_from(self._mm, at)[0], _U64.unpack_from(self._mm, self.psize + at)[0])

    # -- pages -------------------------------------------------------------------
    def _header(self, pgno: int, parent: int | None) -> tuple[int, int, int]:
        """(kind, number of nodes, upper) of B-tree page ``pgno``, all checked."""
        if not NUM_METAS <= pgno < self.next_pgno:
            raise PageDamage(
                self.path, f"it points to page {pgno}, outside {NUM_METAS}..{self.next_pgno - 1}", pgno=parent
            )
        base = pgno * self.psize
        stored, _, flags, lower, upper = PAGE_HEADER.unpack_from(self._mm, base)
        if stored != pgno:
            raise PageDamage(self.path, f"page {pgno} says it is page {stored} (a wrong page pointer?)", pgno=pgno)
        kind = flags & ~P_DIRTY
        if kind not in (P_BRANCH, P_LEAF):
            raise PageDamage(self.path, f"page {pgno} has flags 0x{flags:x}, expected a branch or leaf page", pgno=pgno)
        if lower < PAGEHDRSZ or upper > self.psize or lower > upper or lower & 1:
            raise PageDamage(self.path, f"page {pgno} has bad bounds lower={lower} upper={upper}", pgno=pgno)
        return kind, (lower - PAGEHDRSZ) >> 1, upper

    def _node(self, pgno: int, i: int, upper: int) -> tuple[int, int, int, int]:
        """(offset in the file, lo|hi, flags, key size) of node ``i`` of page ``pgno``, checked."""
        base = pgno * self.psize
        ptr = _U16.unpack_from(self._mm, base + PAGEHDRSZ + 2 * i)[0]
        if ptr < upper or ptr & 1 or ptr + _NODE.size > self.psize:
            raise PageDamage(self.path, f"page {pgno} node {i} has offset {ptr}, outside the node area", pgno=pgno)
        lo, hi, flags, ksize = _NODE.unpack_from(self._mm, base + ptr)
        if ptr + _NODE.size + ksize > self.psize:
            raise PageDamage(
                self.path, f"page {pgno} node {i} has a {ksize}-byte key that overruns the page", pgno=pgno
            )
        return base + ptr, lo | hi << 16, flags, ksize

    def _key(self, off: int, ksize: int) -> bytes:
        return self._mm[off + _NODE.size : off + _NODE.size + ksize]

    def _parse(self, pgno: int, parent: int | None) -> tuple[Any, ...]:
        """Checked summary of B-tree page ``pgno``, cached (the tree this file reads never changes).

        A branch: ``(P_BRANCH, keys, children, ordered)``. A leaf:
        ``(P_LEAF, nodes, upper, first)``, where ``first`` is the sample index
        of its first key when that is a record key (so the node of index
        ``i`` is usually node ``i - first``), else -1.
        """
        kind, n, upper = self._header(pgno, parent)
        info: tuple[Any, ...]
        if kind == P_BRANCH:
            if n < 2:
                # LMDB asserts NUMKEYS > 1 here (mdb_page_search_root): SIGABRT.
                raise PageDamage(self.path, f"branch page {pgno} has {n} child(ren), fewer than 2", pgno=pgno)
            keys, children = [], []
            for i in range(n):
                off, lohi, flags, ksize = self._node(pgno, i, upper)
                keys.append(self._key(off, ksize))
                children.append(lohi | flags << 32)
            ordered = all(a < b for a, b in zip(keys[1:], keys[2:]))
            info = (P_BRANCH, keys, children, ordered)
        else:
            first = -1
            if n:
                off, _, _, ksize = self._node(pgno, 0, upper)
                key = self._key(off, ksize)
                if ksize == 8 and key[0] == 0:
                    first = int.from_bytes(key, "big")
            info = (P_LEAF, n, upper, first)
        if len(self._pages) >= _CACHE_PAGES:
            self._pages.clear()
        self._pages[pgno] = info
        return info

    def _unexpected(self, exc: Exception) -> PageDamage:
        # The checks above keep every read inside the map; a layout they did
        # not foresee still ends as PageDamage naming the file, never as a bare
        # struct.error or IndexError.
        return PageDamage(self.path, f"unexpected page layout ({type(exc).__name__}: {exc})")

    def checked_nodes(self, pgno: int, parent: int | None) -> tuple[int, int, int, list[tuple[int, bytes, int, int]]]:
        """(kind, number of nodes, upper, nodes) of B-tree page ``pgno``, every node checked."""
        try:
            return self._page_nodes(pgno, parent)
        except PageDamage:
            raise
        except _UNEXPECTED as exc:
            raise self._unexpected(exc) from None

    def checked_value(self, pgno: int, i: int, off: int, dsize: int, flags: int, ksize: int) -> tuple[int, int]:
        """(file offset, size) of the value of leaf node ``i`` of page ``pgno``, checked as ``locate`` does."""
        try:
            return self._value(pgno, i, off, dsize, flags, ksize)
        except PageDamage:
            raise
        except _UNEXPECTED as exc:
            raise self._unexpected(exc) from None

    # -- lookups -------------------------------------------------------------------
    def locate(self, key: bytes) -> tuple[int, int] | None:
        """(file offset, size) of the value stored under ``key``, or None if it is absent.

        Raises PageDamage for damage on the way. The range returned lies
        inside the file.
        """
        try:
            return self._locate(key)
        except PageDamage:
            raise
        except _UNEXPECTED as exc:
            raise self._unexpected(exc) from None

    def _locate(self, key: bytes) -> tuple[int, int] | None:
        pgno, parent = self.root, None
        if pgno == NO_ROOT:
            return None
        pages = self._pages
        for _ in range(CURSOR_STACK):
            info = pages.get(pgno) or self._parse(pgno, parent)
            if info[0] == P_BRANCH:
                _, keys, children, ordered = info
                # mdb_node_search on a branch: node 0's key is ignored; follow
                # the last child whose key is <= key (bisect finds the same one
                # when the keys are in order).
                i = bisect.bisect_right(keys, key, 1) - 1 if ordered else _search(keys, key, 1)
                parent, pgno = pgno, children[i]
                continue
            _, n, upper, first = info
            if first >= 0 and len(key) == 8 and key[0] == 0:
                guess = int.from_bytes(key, "big") - first
                if 0 <= guess < n:
                    hit = self._guess(pgno, guess, upper, key)
                    if hit is not None:
                        return hit
            return self._leaf_lookup(pgno, n, upper, key)
        raise PageDamage(self.path, f"the tree is deeper than {CURSOR_STACK} levels (a page cycle?)", pgno=pgno)

    def _guess(self, pgno: int, i: int, upper: int, key: bytes) -> tuple[int, int] | None:
        """The value of node ``i`` of leaf ``pgno`` if its key is ``key`` (8 bytes), else None.

        The common case of a lookup (record ``i`` is node ``i - first`` of its
        leaf), with the checks of ``_node`` and ``_value`` inlined: every
        lookup of a record pays for it. Anything unusual takes the general
        path, which raises the precise PageDamage.
        """
        mm, psize = self._mm, self.psize
        base = pgno * psize
        ptr = _U16_AT(mm, base + PAGEHDRSZ + 2 * i)[0]
        if ptr < upper or ptr & 1 or ptr + _NODE.size + 8 > psize:
            off, dsize, flags, ksize = self._node(pgno, i, upper)  # raises, or it is a short key: not ours
            return None
        off = base + ptr
        lo, hi, flags, ksize = _NODE_AT(mm, off)
        if ksize != 8 or mm[off + 8 : off + 16] != key:
            return None
        dsize = lo | hi << 16
        if flags == F_BIGDATA and off + 24 <= base + psize:
            first = _U64_AT(mm, off + 16)[0]
            need = (PAGEHDRSZ - 1 + dsize) // psize + 1
            if first >= NUM_METAS and first + need <= self.next_pgno:
                stored, _, oflags, pages = _OVERFLOW_AT(mm, first * psize)
                if stored == first and oflags & ~P_DIRTY == P_OVERFLOW and pages == need:
                    return first * psize + PAGEHDRSZ, dsize
        elif not flags and off + 16 + dsize <= base + psize:
            return off + 16, dsize
        return self._value(pgno, i, off, dsize, flags, ksize)  # raises the precise PageDamage

    def _leaf_lookup(self, pgno: int, n: int, upper: int, key: bytes) -> tuple[int, int] | None:
        low, high = 0, n - 1
        while low <= high:  # mdb_node_search on a leaf, probing nodes in place
            i = (low + high) >> 1
            off, dsize, flags, ksize = self._node(pgno, i, upper)
            node_key = self._key(off, ksize)
            if key == node_key:
                return self._value(pgno, i, off, dsize, flags, ksize)
            if key > node_key:
                low = i + 1
            else:
                high = i - 1
        return None

    def _value(self, pgno: int, i: int, off: int, dsize: int, flags: int, ksize: int) -> tuple[int, int]:
        data = off + _NODE.size + ksize
        page_end = pgno * self.psize + self.psize
        if flags & ~F_BIGDATA:
            raise PageDamage(self.path, f"leaf page {pgno} node {i} has flags 0x{flags:x}", pgno=pgno)
        if not flags & F_BIGDATA:
            if data + dsize > page_end:
                raise PageDamage(
                    self.path, f"leaf page {pgno} node {i}: {dsize}-byte value overruns the page", pgno=pgno
                )
            return data, dsize
        first, need = self.overflow_extent(pgno, i, data, dsize)
        return first * self.psize + PAGEHDRSZ, dsize

    def overflow_extent(self, pgno: int, i: int, data: int, dsize: int) -> tuple[int, int]:
        """(first page, page count) of the overflow value whose node data is at file offset ``data``, checked."""
        if data + 8 > pgno * self.psize + self.psize:
            raise PageDamage(self.path, f"leaf page {pgno} node {i}: overflow pointer overruns the page", pgno=pgno)
        first = _U64.unpack_from(self._mm, data)[0]
        need = ovpages(dsize, self.psize)
        if first < NUM_METAS or first + need > self.next_pgno:
            raise PageDamage(
                self.path,
                f"leaf page {pgno} node {i}: a {dsize:,}-byte value in pages {first}..{first + need - 1}, "
                f"beyond the last page {self.next_pgno - 1}",
                pgno=pgno,
            )
        stored, _, oflags, pages = _OVERFLOW_HEADER.unpack_from(self._mm, first * self.psize)
        if stored != first or oflags & ~P_DIRTY != P_OVERFLOW or pages != need:
            raise PageDamage(
                self.path,
                f"leaf page {pgno} node {i}: page {first} is not the start of a {need}-page overflow value "
                f"(it says page {stored}, flags 0x{oflags:x}, {pages} pages)",
                pgno=pgno,
            )
        return first, need

    def get(self, key: bytes) -> memoryview | None:
        """The value stored under ``key`` as a zero-copy view, or None if absent (PageDamage if damaged)."""
        found = self.locate(key)
        if found is None:
            return None
        off, size = found
        return self._view[off : off + size]

    def view(self, offset: int, size: int) -> memoryview:
        """Bytes ``offset .. offset + size`` of the file (as ``locate`` returned them), zero-copy."""
        return self._view[offset : offset + size]

    # -- whole-tree walks ----------------------------------------------------------
    def pages(self, root: int | None = None) -> Iterator[tuple[int, int, int, list[tuple[int, bytes, int, int]]]]:
        """Every B-tree page reachable from ``root`` (default: the main database's),
        depth first, in key order: ``(pgno, depth, kind, nodes)`` with nodes
        ``(file offset, key, lo|hi, flags)``.

        Raises PageDamage at the first damaged page (it checks what ``get`` checks).
        """
        root = self.root if root is None else root
        if root == NO_ROOT:
            return
        stack: list[tuple[int, int | None, int]] = [(root, None, 1)]
        while stack:
            pgno, parent, depth = stack.pop()
            if depth > CURSOR_STACK:
                raise PageDamage(self.path, f"the tree is deeper than {CURSOR_STACK} levels", pgno=pgno)
            kind, n, upper, nodes = self.checked_nodes(pgno, parent)
            yield pgno, depth, kind, nodes
            if kind == P_BRANCH:
                for _off, _key, lohi, flags in reversed(nodes):
                    stack.append((lohi | flags << 32, pgno, depth + 1))

    def _page_nodes(self, pgno: int, parent: int | None) -> tuple[int, int, int, list[tuple[int, bytes, int, int]]]:
        kind, n, upper = self._header(pgno, parent)
        if kind == P_BRANCH and n < 2:
            raise PageDamage(self.path, f"branch page {pgno} has {n} child(ren), fewer than 2", pgno=pgno)
        nodes = []
        for i in range(n):
            off, lohi, flags, ksize = self._node(pgno, i, upper)
            nodes.append((off, self._key(off, ksize), lohi, flags))
        return kind, n, upper, nodes

    def items(self) -> Iterator[tuple[bytes, memoryview]]:
        """Every key and value of the main database, in key order, each value checked
        as ``get`` checks it; PageDamage at the first damaged page or out-of-order key."""
        last: bytes | None = None
        for pgno, _depth, kind, nodes in self.pages():
            if kind != P_LEAF:
                continue
            for i, (off, key, lohi, flags) in enumerate(nodes):
                if last is not None and key <= last:
                    raise PageDamage(self.path, f"leaf page {pgno} node {i}: keys out of order", pgno=pgno)
                last = key
                start, size = self.checked_value(pgno, i, off, lohi, flags, len(key))
                yield key, self._view[start : start + size]

    def audit(self) -> list[str]:
        """Check the whole file as LMDB's own audit would; returns the problems found (empty: intact).

        See ``Audit``. Never raises for damage.
        """
        return Audit(self).run()

    # -- lifetime ----------------------------------------------------------------
    def close(self) -> None:
        """Unmap the file (later, once views into it are gone: they keep it alive)."""
        self._pages.clear()
        self._view.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a value; the map goes with the last view

    def __enter__(self) -> PageFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _search(keys: list[bytes], key: bytes, low: int) -> int:
    """Index of the node ``mdb_node_search`` picks on a branch page (then ``mdb_page_search_root``)."""
    high = len(keys) - 1
    i, rc = low, 0
    while low <= high:
        i = (low + high) >> 1
        node_key = keys[i]
        if key == node_key:
            return i
        rc = 1 if key > node_key else -1
        if rc > 0:
            low = i + 1
        else:
            high = i - 1
    if rc > 0:
        i += 1
    if i >= len(keys):
        return len(keys) - 1
    return i - 1  # not exact: the child left of the first key above


@dataclass
class _Tree:
    name: str
    branch: int = 0
    leaf: int = 0
    overflow: int = 0
    entries: int = 0
    depth: int = 0
    values: list[tuple[int, int]] = field(default_factory=list)  # free DB: (file offset, size) of each IDL


class Audit:
    """The whole-file check behind ``PageFile.audit`` (``verify``, ``copy``).

    Walks the main and the free database from the current meta page, with
    the checks of a lookup, and checks what only a walk can: every page in
    ``2 .. last`` is reached exactly once or listed as free (never both,
    never neither), separator keys bound their subtrees, keys ascend, the
    free-list records are well formed, each meta page's counters match the
    walk, and no page carries a dirty flag at rest. Problems are sentences
    naming the page; the walk of a subtree stops at its first damaged page.
    """

    MAX_PROBLEMS = 200

    def __init__(self, pf: PageFile) -> None:
        self.pf = pf
        self.problems: list[str] = []
        self.seen = bytearray(pf.next_pgno)  # 1 reachable, 2 free

    def say(self, text: str) -> None:
        if len(self.problems) < self.MAX_PROBLEMS:
            self.problems.append(text)
        elif len(self.problems) == self.MAX_PROBLEMS:
            self.problems.append("... (more problems not listed)")

    def run(self) -> list[str]:
        pf = self.pf
        other = pf.metas[1 - pf.meta_page]
        if other[-1] == pf.txnid:
            self.say(f"both meta pages hold transaction {pf.txnid}")
        main = self._tree("main", pf.main_db, is_free=False)
        free = self._tree("free", pf.free_db, is_free=True)
        for tree, db in ((main, pf.main_db), (free, pf.free_db)):
            if tree is None:
                continue
            for label, walked, claimed in (
                ("branch pages", tree.branch, db.branch_pages),
                ("leaf pages", tree.leaf, db.leaf_pages),
                ("overflow pages", tree.overflow, db.overflow_pages),
                ("entries", tree.entries, db.entries),
                ("depth", tree.depth, db.depth),
            ):
                if walked != claimed:
                    self.say(f"{tree.name} database: the meta page says {claimed} {label}, the walk found {walked}")
        if free is not None:
            for off, size in free.values:
                self._free_list(off, size)
        if main is not None and free is not None:
            neither = [p for p in range(NUM_METAS, pf.next_pgno) if not self.seen[p]]
            if neither:
                self.say(
                    f"{len(neither)} page(s) are neither in use nor free (first: page {neither[0]}): "
                    "a damaged page pointer or free list"
                )
        return self.problems

    def _mark(self, pgno: int, how: int, what: str) -> bool:
        if not NUM_METAS <= pgno < self.pf.next_pgno:
            self.say(f"{what} names page {pgno}, outside {NUM_METAS}..{self.pf.next_pgno - 1}")
            return False
        if self.seen[pgno]:
            again = "in use" if self.seen[pgno] == 1 else "free"
            self.say(f"page {pgno} is reached more than once ({what}; it is already {again})")
            return False
        self.seen[pgno] = how
        return True

    def _tree(self, name: str, db: DB, *, is_free: bool) -> _Tree | None:
        tree = _Tree(name)
        if db.root == NO_ROOT:
            return tree
        if db.depth > CURSOR_STACK:
            self.say(f"{name} database: depth {db.depth} is more than {CURSOR_STACK}")
        # (page, parent, depth, lowest key allowed, key it must stay below)
        # The free database's keys are native (little-endian) integers: compare them as such.
        order: Callable[[bytes], Any] = (lambda k: int.from_bytes(k, "little")) if is_free else (lambda k: k)
        stack: list[tuple[int, int | None, int, Any, Any]] = [(db.root, None, 1, None, None)]
        complete = True
        last: Any = None
        while stack:
            pgno, parent, depth, lo, hi = stack.pop()
            where = f"{name} database, page {pgno}"
            if depth > CURSOR_STACK:
                self.say(f"{where}: the tree is deeper than {CURSOR_STACK} levels")
                complete = False
                continue
            if not self._mark(pgno, 1, f"{name} database page {parent}" if parent is not None else f"{name} root"):
                complete = False
                continue
            try:
                kind, n, upper, nodes = self.pf.checked_nodes(pgno, parent)
                flags = PAGE_HEADER.unpack_from(self.pf._mm, pgno * self.pf.psize)[2]
            except PageDamage as exc:
                self.say(f"{name} database: {exc.why}")
                complete = False
                continue
            if flags & P_DIRTY:
                self.say(f"{where} carries a dirty flag (0x{flags:x}) at rest")
            tree.depth = max(tree.depth, depth)
            keys = [order(key) for _off, key, _lohi, _flags in nodes]
            if kind == P_BRANCH:
                tree.branch += 1
                bounds = [lo, *keys[1:], hi]
                if any(a >= b for a, b in zip(keys[1:], keys[2:])):
                    self.say(f"{where}: separator keys out of order")
                if keys[1:] and ((lo is not None and keys[1] <= lo) or (hi is not None and keys[-1] >= hi)):
                    self.say(f"{where}: separator keys outside the range its parent gives it")
                for i in reversed(range(n)):
                    _off, _key, lohi, nflags = nodes[i]
                    stack.append((lohi | nflags << 32, pgno, depth + 1, bounds[i], bounds[i + 1]))
                continue
            tree.leaf += 1
            for i, (off, key, lohi, nflags) in enumerate(nodes):
                tree.entries += 1
                ordered = keys[i]
                if (lo is not None and ordered < lo) or (hi is not None and ordered >= hi):
                    self.say(f"{where} node {i}: its key lies outside the range the branch pages give it")
                if last is not None and ordered <= last:
                    self.say(f"{where} node {i}: keys out of order")
                last = ordered
                if is_free and len(key) != 8:
                    self.say(f"{where} node {i}: a free-list key of {len(key)} bytes, expected 8")
                if nflags & ~F_BIGDATA:
                    self.say(f"{where} node {i} has flags 0x{nflags:x}")
                    continue
                try:
                    start, size = self.pf.checked_value(pgno, i, off, lohi, nflags, len(key))
                except PageDamage as exc:
                    self.say(f"{name} database: {exc.why}")
                    continue
                if nflags & F_BIGDATA:
                    first = (start - PAGEHDRSZ) // self.pf.psize
                    count = ovpages(size, self.pf.psize)
                    tree.overflow += count
                    for p in range(first, first + count):
                        if not self._mark(p, 1, f"{where} node {i} (overflow value)"):
                            break
                if is_free:
                    tree.values.append((start, size))
        return tree if complete else None

    def _free_list(self, off: int, size: int) -> None:
        pf = self.pf
        if size < 8 or size % 8:
            self.say(f"a free-list record of {size} bytes, not a whole number of page numbers")
            return
        count = _U64.unpack_from(pf._mm, off)[0]
        if count != size // 8 - 1:
            self.say(f"a free-list record says {count} pages but holds {size // 8 - 1}")
            return
        previous = None
        for k in range(count):
            pg = _U64.unpack_from(pf._mm, off + 8 + 8 * k)[0]
            if previous is not None and pg >= previous:
                self.say("a free-list record is not in descending order")
                return
            previous = pg
            if not self._mark(pg, 2, "the free list"):
                return
