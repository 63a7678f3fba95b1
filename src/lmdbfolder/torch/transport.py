"""Batch memory that is reused, and its trip from a DataLoader worker to the main process.

The batch fast path (``TransformPlan.batch``, ``lmdbfolder.torch.plan``) writes a whole batch into one
uint8 tensor. Allocating that tensor afresh for every batch costs more than it
seems: in a DataLoader worker torch puts it in new shared memory (a new file,
``ftruncate``, ``mmap``, a page fault per 4 KiB written: ~38 per 224x224 image),
sends its file descriptor through a socket, and the main process maps it again
and faults its pages in once more. So the batches come from a small pool of
buffers per process (``BatchPool``), each reused only when nothing refers to the
last batch made in it:

* **Who may still hold a batch** is tracked by the memory itself: a batch tensor
  is made with ``torch.from_numpy`` over a fresh ndarray view of its buffer, and
  torch keeps that ndarray alive exactly as long as any tensor, view, slice or
  ``.numpy()`` of the batch is alive. A weak reference to the ndarray says when
  it died. ``share_memory_()`` (or ``set_()``) gives the tensors of a batch new
  memory while a ``.numpy()`` taken before still points at the buffer: the
  storage's own Python object, which torch keeps alive with the storage, is
  watched too, and a buffer is free only when both died (``_Lifetime``).
  Nothing is overwritten while a user holds any part of a batch.
* **In a DataLoader worker** (Linux: ``memfd_create``) a buffer is shared memory
  of our own. ``collate`` (and torch's ``default_collate``, through
  ``default_collate_fn_map``) returns the batch as a ``PooledBatch``, which the
  worker's result queue pickles as (pool, buffer, generation) plus, the first time
  only, the buffer's file descriptor. The main process maps each buffer once and
  builds the batch tensor over its mapping (no copy, no page fault once warm); when
  every view of that tensor has died there, it marks the buffer free in its
  shared header, and only then may the worker write into it again.
* **Anything else is safe by construction**: a batch tensor that leaves a worker
  any other way (a user's ``collate_fn`` returning it, ``share_memory_()``,
  ``torch.save``) is not memory torch shares, so torch copies it into shared memory
  of its own first (and the buffer is free again in the worker).
* **A process forked while the main process holds a worker's batch** maps the
  same shared memory: such a batch's buffer is never handed back to its worker
  (``_shared_with_children``), which makes another (or allocates as torch would).
* **In the main process** (``num_workers=0``, threads mode) the buffers are
  ordinary memory, reused the same way: a fresh batch no longer page-faults in.
* **Several batch tensors in one buffer** (``BatchPool.take_many``: a multi-crop's
  views, one float32 or uint8 batch per view) are made, watched, sent and freed as
  one batch: every view tensor is a slice of the buffer's one storage, so the buffer
  is free only when no tensor of any of them is alive; a worker sends their layout
  (dtype, shape, offset of each) with the buffer's reference.

A pool holds at most ``MAX_BUFFERS`` buffers; when all are in use (a program that
keeps many batches), batches are allocated as before. Where ``memfd_create`` is
missing (not Linux), worker batches go through torch's own shared memory as before.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any, Sequence

import numpy as np
import torch
import torch.utils.data

from lmdbfolder.errors import LmdbFolderError

__all__ = ["BatchPool", "PooledBatch", "pool", "MAX_BUFFERS", "Layout"]

#: Where each tensor of a ``take_many`` batch lies in its buffer: ``(dtype, shape, byte offset)``.
Layout = tuple[tuple[torch.dtype, tuple[int, ...], int], ...]

#: Byte alignment of each tensor of a ``take_many`` batch in its buffer (a cache line).
_ALIGN = 64

#: Buffers one process keeps (every size together). A DataLoader worker needs one
#: per batch in flight (``prefetch_factor``, 2 by default), one the user holds and
#: one being made.
MAX_BUFFERS = 6

# The first 64 bytes of a shared buffer: byte 0 is 1 while the main process holds
# (or is about to receive) the batch in it; bytes 8-15 the generation of that batch.
_HEADER = 64
_AT_RECEIVER = 1
_HAS_MEMFD = hasattr(os, "memfd_create")


class _Lifetime:
    """Calls ``done`` once nothing can reach a batch's memory any more.

    A batch tensor made with ``torch.from_numpy(view)`` keeps ``view`` alive through
    its storage's memory; ``share_memory_()`` or ``set_()`` swap that memory for
    other memory while the storage (and so every ``.numpy()`` of its tensors, whose
    base is a tensor) lives on. So both are watched: the ndarray, and the storage's
    Python object, which torch keeps alive as long as the storage itself.
    """

    __slots__ = ("refs", "done", "__weakref__")

    def __init__(self, view: np.ndarray, tensor: torch.Tensor, done: Any) -> None:
        self.done = done
        self.refs = (weakref.ref(view, self._died), weakref.ref(tensor.untyped_storage(), self._died))

    def _died(self, _: weakref.ref[Any]) -> None:
        if self.done is not None and all(ref() is None for ref in self.refs):
            done, self.done = self.done, None
            done(self)


class _Buffer:
    """One reusable batch buffer: ``nbytes`` of memory, shared (a memfd) or private."""

    __slots__ = (
        "index",
        "nbytes",
        "mm",
        "fd",
        "array",
        "held",
        "watch",
        "generation",
        "fd_sent",
        "layout",
        "__weakref__",
    )

    def __init__(self, index: int, nbytes: int, shared: bool) -> None:
        self.index = index
        self.nbytes = nbytes
        self.fd = -1
        self.mm: mmap.mmap | None = None
        if shared:
            self.fd = os.memfd_create("lmdbfolder-batch", os.MFD_CLOEXEC)
            try:
                os.ftruncate(self.fd, _HEADER + nbytes)
                self.mm = mmap.mmap(self.fd, _HEADER + nbytes)
            except BaseException:
                os.close(self.fd)
                raise
            self.array = np.frombuffer(self.mm, np.uint8, count=nbytes, offset=_HEADER)
        else:
            # Cache-line aligned, as a memfd's mapping past its header is (take_many's offsets).
            raw = np.empty(nbytes + _ALIGN, np.uint8)
            start = -raw.ctypes.data % _ALIGN
            self.array = raw[start : start + nbytes]
        self.held = False  # a tensor made in this process over the buffer is alive
        self.watch: _Lifetime | None = None
        self.generation = 0
        self.fd_sent = False
        #: The tensors of the last batch made here by ``take_many`` (None: one uint8 tensor).
        self.layout: Layout | None = None

    def free(self) -> bool:
        """Whether nothing refers to the last batch made here (in this process or, for
        a shared buffer, in the one it was sent to)."""
        return not self.held and (self.mm is None or self.mm[0] != _AT_RECEIVER)

    def tensor(self, shape: Sequence[int]) -> torch.Tensor:
        """A new batch tensor of ``shape`` over this buffer (which is now held)."""
        view = self.array.reshape(shape)  # a fresh ndarray: torch keeps it alive with the tensor
        self.held = True
        self.layout = None
        self.generation += 1
        if self.mm is not None:
            self.mm[8:16] = self.generation.to_bytes(8, "little")
        tensor = torch.from_numpy(view)
        self.watch = _Lifetime(view, tensor, self._dropped)
        return tensor

    def _dropped(self, lifetime: _Lifetime) -> None:
        if lifetime is self.watch:
            self.held = False

    def close(self) -> None:
        self.array = np.empty(0, np.uint8)
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass  # still exported by a batch someone holds: freed with it
            os.close(self.fd)


class BatchPool:
    """The batch buffers of one process (``pool()`` gives this process's).

    ``take(shape)`` returns a uint8 tensor of ``shape`` (its values undefined) in a
    buffer no live batch uses, or a newly allocated tensor when every buffer is in
    use; ``buffer_of(tensor)`` tells which shared buffer a batch is, for ``collate``.
    """

    def __init__(self, shared: bool) -> None:
        self.shared = shared and _HAS_MEMFD
        self.pid = os.getpid()
        # Names this pool to the receiving process: a pid can be reused, this cannot.
        self.token = f"{self.pid}-{os.urandom(8).hex()}"
        self._buffers: list[_Buffer] = []
        self._by_data: dict[int, _Buffer] = {}
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self.dropped: list[int] = []  # buffer indices closed here, for the receiver to unmap
        #: Batches that found no free buffer and were allocated (a program holding many batches).
        self.overflow = 0

    def take(self, shape: Sequence[int]) -> torch.Tensor:
        """A uint8 tensor of ``shape``, C-contiguous, from a free buffer if there is one."""
        nbytes = 1
        for d in shape:
            nbytes *= int(d)
        with self._lock:  # threads of one process may make batches at once
            buf = self._find(nbytes)
            if buf is not None:
                return buf.tensor(shape)
        self.overflow += 1
        if self.shared or (torch.utils.data.get_worker_info() is not None):
            storage = torch.UntypedStorage._new_shared(nbytes)  # what torch would have made
            return torch.empty(0, dtype=torch.uint8).set_(storage).view(*shape)
        return torch.empty(tuple(shape), dtype=torch.uint8)

    def take_many(self, specs: Sequence[tuple[torch.dtype, Sequence[int]]]) -> list[torch.Tensor]:
        """Tensors of the given ``(dtype, shape)`` s (values undefined), all in one free
        buffer if there is one (each C-contiguous, 64-byte aligned), which is free again
        only when no tensor of any of them is alive; else each newly allocated."""
        layout = _layout(specs)
        nbytes = _layout_bytes(layout)
        with self._lock:
            buf = self._find(nbytes) if nbytes else None
            if buf is not None:
                whole = buf.tensor((nbytes,))
                buf.layout = layout
                return _views_of(whole, layout)
        self.overflow += 1
        return [torch.empty(tuple(shape), dtype=dtype) for dtype, shape, _ in layout]

    def _find(self, nbytes: int) -> _Buffer | None:
        spare = None
        for buf in self._buffers:
            if buf.free():
                if buf.nbytes == nbytes:
                    return buf
                spare = buf
        if len(self._buffers) >= MAX_BUFFERS:
            if spare is None:
                return None
            # A free buffer of another size (the last, shorter batch of an epoch, a new
            # crop size): make room for this size.
            self._buffers.remove(spare)
            del self._by_data[spare.array.ctypes.data]
            if spare.fd_sent:
                self.dropped.append(spare.index)
            spare.close()
        try:
            buf = _Buffer(next(self._numbers), nbytes, self.shared)
        except (OSError, MemoryError):
            return None  # no memory for another buffer now: allocate as torch would
        self._buffers.append(buf)
        self._by_data[buf.array.ctypes.data] = buf
        return buf

    def buffer_of(self, tensor: torch.Tensor) -> _Buffer | None:
        """The shared buffer whose whole batch ``tensor`` is (None for any other tensor)."""
        if not self.shared or not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
            return None
        buf = self._by_data.get(tensor.data_ptr())
        if buf is None or not buf.held or tensor.numel() != buf.nbytes or tensor.dtype != torch.uint8:
            return None
        return buf

    def buffer_of_many(self, tensors: Any) -> _Buffer | None:
        """The shared buffer whose ``take_many`` batch ``tensors`` (a list) is, whole and
        in order (None for anything else)."""
        if not self.shared or not isinstance(tensors, list) or not tensors:
            return None
        first = tensors[0]
        if not isinstance(first, torch.Tensor):
            return None
        buf = self._by_data.get(first.data_ptr())
        if buf is None or not buf.held or buf.layout is None or len(buf.layout) != len(tensors):
            return None
        base = first.data_ptr()
        for t, (dtype, shape, offset) in zip(tensors, buf.layout):
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != dtype
                or tuple(t.shape) != shape
                or not t.is_contiguous()
                or t.data_ptr() != base + offset
            ):
                return None
        return buf

    def __len__(self) -> int:
        return len(self._buffers)


def _layout(specs: Sequence[tuple[torch.dtype, Sequence[int]]]) -> Layout:
    """Each tensor's place in one buffer: one after the other, each 64-byte aligned."""
    out = []
    offset = 0
    for dtype, shape in specs:
        dims = tuple(int(d) for d in shape)
        out.append((dtype, dims, offset))
        nbytes = torch.empty((), dtype=dtype).element_size()
        for d in dims:
            nbytes *= d
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return tuple(out)


def _layout_bytes(layout: Layout) -> int:
    """The bytes a buffer needs for ``layout`` (the end of its last tensor)."""
    if not layout:
        return 0
    dtype, shape, offset = layout[-1]
    nbytes = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        nbytes *= d
    return offset + nbytes


def _views_of(whole: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The tensors of ``layout`` as views of ``whole`` (a flat uint8 tensor): one storage."""
    out = []
    for dtype, shape, offset in layout:
        count = 1
        for d in shape:
            count *= d
        size = torch.empty((), dtype=dtype).element_size() * count
        out.append(whole[offset : offset + size].view(dtype).view(shape))
    return out


_POOLS: dict[int, BatchPool] = {}


def pool() -> BatchPool:
    """This process's batch pool: shared buffers in a DataLoader worker, private ones
    elsewhere. A forked child gets its own (the parent's buffers are the parent's)."""
    pid = os.getpid()
    p = _POOLS.get(pid)
    if p is None:
        _POOLS.clear()  # an inherited parent's pool: never ours to use
        p = _POOLS[pid] = BatchPool(shared=torch.utils.data.get_worker_info() is not None)
    return p


class PooledBatch(list):  # type: ignore[type-arg]
    """``[images, targets]`` as ``collate`` returns it in a DataLoader worker when the
    images are a pooled shared buffer: sent to the main process by reference (see the
    module docstring), where it arrives as a plain ``[images, targets]`` list. ``images``
    may be the list of tensors of a ``take_many`` batch (a multi-crop's views)."""

    def __init__(self, images: Any, targets: Any, buffer: _Buffer, owner: BatchPool) -> None:
        super().__init__([images, targets])
        self.buffer = buffer
        self.owner = owner
        self.generation = buffer.generation
        self.layout = buffer.layout
        self.sent = False


def _reduce_pooled(batch: PooledBatch) -> tuple[Any, tuple[Any, ...]]:
    """How the worker's result queue pickles a ``PooledBatch`` (ForkingPickler only)."""
    images, targets = batch[0], batch[1]
    buf, owner = batch.buffer, batch.owner
    if batch.sent or owner.pid != os.getpid() or buf.generation != batch.generation or buf.mm is None:
        # Pickled twice, or after the buffer moved on: send a copy the torch way.
        copied = [t.clone() for t in images] if isinstance(images, list) else images.clone()
        return (list, ([copied, targets],))
    batch.sent = True
    buf.mm[0] = _AT_RECEIVER  # before the worker can see the buffer unheld: it is not free
    fd = None
    if not buf.fd_sent:
        fd = DupFd(buf.fd)
        buf.fd_sent = True
    dropped, owner.dropped = owner.dropped, []
    int_targets = None
    if isinstance(targets, torch.Tensor) and type(targets) is torch.Tensor and targets.dtype == torch.int64:
        int_targets, targets = targets.tolist(), None  # 64 numbers: cheaper pickled than shared
    # The layout by dtype name: a torch.dtype pickles, but a name is plain data.
    layout = None if batch.layout is None else tuple((str(d).removeprefix("torch."), s, o) for d, s, o in batch.layout)
    shape = None if layout is not None else tuple(images.shape)
    message = (owner.token, buf.index, fd, buf.nbytes, batch.generation, shape, layout, int_targets, targets)
    return (_receive, (message, dropped))


ForkingPickler.register(PooledBatch, _reduce_pooled)


# -- the receiving process -----------------------------------------------------------------------

# token -> {buffer index: (mmap of the buffer, its size)}; read and changed under _LOCK.
_MAPPED: dict[str, dict[int, mmap.mmap]] = {}
_LOCK = threading.Lock()


def _receive(message: tuple[Any, ...], dropped: list[int]) -> list[Any]:
    """Unpickling a ``PooledBatch`` in the main process: the batch tensor over this
    process's mapping of the worker's buffer (or the tensors of its ``layout``), and the targets."""
    token, index, fd, nbytes, generation, shape, layout, int_targets, targets = message
    with _LOCK:
        maps = _MAPPED.get(token)
        if maps is None:
            _forget_dead_pools(token)
            maps = _MAPPED[token] = {}
        for gone in dropped:
            maps.pop(gone, None)
        mm = maps.get(index)
        if fd is not None:
            handle = fd.detach()
            try:
                mm = mmap.mmap(handle, _HEADER + nbytes)
            finally:
                os.close(handle)
            maps[index] = mm
    if mm is None:
        raise LmdbFolderError(
            f"a batch from DataLoader worker {token.split('-')[0]} arrived in a process that never mapped its "
            "buffer: a worker's batches are sent by reference only to the process that started the workers",
            "to pass a batch on to another process, send a copy (images.clone()) or the tensor itself",
        )
    if int.from_bytes(mm[8:16], "little") != generation:
        raise LmdbFolderError(
            f"batch buffer {index} of DataLoader worker {token.split('-')[0]} was written again before its "
            "batch arrived (a bug in lmdbfolder.transport: please report it)",
            "meanwhile, a collate_fn that returns a copy (e.g. [b.images.clone(), b.targets]) avoids the reuse",
        )
    view = np.frombuffer(mm, np.uint8, count=nbytes, offset=_HEADER)
    if shape is not None:
        view = view.reshape(shape)
    images = torch.from_numpy(view)
    result: Any = images
    if layout is not None:
        dtypes = []
        for name, dims, offset in layout:
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype):
                raise LmdbFolderError(
                    f"a batch from DataLoader worker {token.split('-')[0]} names no dtype {name!r}",
                    "the workers and the main process must run the same torch",
                )
            dtypes.append((dtype, tuple(dims), int(offset)))
        # Every tensor a view of ``images``: one storage, watched below as one batch.
        result = _views_of(images, tuple(dtypes))
    pid = os.getpid()

    key = next(_KEYS)

    def release(lifetime: _Lifetime, mm: mmap.mmap = mm) -> None:
        # Every view of the batch died here: the worker may write into the buffer again.
        # (Not in a forked child, whose copies of the objects are not the batch it holds,
        # and not once a child was forked while the batch was held: it maps it too.)
        _KEEP.pop(key, None)
        if os.getpid() == pid and not mm.closed and lifetime not in _shared_with_children:
            mm[0] = 0
        _shared_with_children.discard(lifetime)

    # The closure holds ``mm``: a batch whose storage moved (share_memory_) keeps the
    # mapping its numpy views point into until the storage dies, even after its worker exited.
    _KEEP[key] = _Lifetime(view, images, release)
    if int_targets is not None:
        targets = torch.tensor(int_targets, dtype=torch.int64)
    return [result, targets]


_KEEP: dict[int, _Lifetime] = {}  # the watches of received batches, alive until their batch dies
_KEYS = itertools.count()
#: Received batches that were held when this process forked: a child maps them too.
_shared_with_children: set[_Lifetime] = set()


def _before_fork() -> None:
    _shared_with_children.update(_KEEP.values())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork)


def _forget_dead_pools(new_token: str) -> None:
    """Drop the mappings of pools whose worker has exited (called when a new pool
    appears: a new worker, typically a new epoch without ``persistent_workers``)."""
    new_pid = int(new_token.split("-", 1)[0])
    for token in list(_MAPPED):
        pid = int(token.split("-", 1)[0])
        if pid == new_pid or not _alive(pid):
            del _MAPPED[token]  # batches still held keep their own mapping alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
