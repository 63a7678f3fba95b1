"""What the writer changes in the process it runs in.

* A Ctrl-C latch (``_interrupt_latch``), while a pack runs: Python can
  swallow a SIGINT that arrives inside a ``__del__``; the write loop checks
  the latch before every record instead of trusting the KeyboardInterrupt.
* glibc's heap thresholds (``keep_freed_memory``): freed record buffers stay
  in the process instead of going back to the kernel after every record.
  Only in the ``lmdbfolder`` command's own process, for its whole life: a
  ``mallopt`` of these thresholds switches off glibc's adaptive ones for
  good (nothing switches them on again), so a library call that made it in
  the caller's process would slow whatever that process did afterwards
  (tests/test_process_state.py).

Names with a leading underscore are shared by the write modules only.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from typing import Any, Iterator

__all__: list[str] = []


class _Latch:
    """Whether a SIGINT arrived during the pack (true once it has)."""

    def __init__(self) -> None:
        self.hit = False

    def __bool__(self) -> bool:
        return self.hit


@contextlib.contextmanager
def _interrupt_latch() -> Iterator[_Latch]:
    """Remember a Ctrl-C as well as raising it, while Python's own handler is in place.

    Python raises KeyboardInterrupt wherever the main thread is when the
    signal is handled; inside a ``__del__`` (multiprocessing's connections
    have one) or a weakref callback it only prints "Exception ignored", and
    the pack ran on to the end. The writer checks the latch before each
    record instead of trusting the raise. A handler the program installed
    itself is left alone, as is any thread but the main one.
    """
    latch = _Latch()
    import signal

    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield latch
        return

    def on_sigint(signum: int, frame: Any) -> None:
        latch.hit = True
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield latch
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def keep_freed_memory() -> None:
    """Let glibc keep freed heap memory in this process from now on (the ``lmdbfolder``
    command calls it first thing; a library call never does).

    Every record passes through a ~100 KB buffer of ours and a dirty page
    buffer of LMDB's; with glibc's starting thresholds each is returned to the
    kernel when freed and faulted in again for the next record. Keeping them
    cut the kernel time of a 1 GB pack by about a quarter (benchmarks/bench_pack.py).
    """
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return
    mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _glibc_mallopt() -> Any:
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None  # not glibc (musl, ...): nothing to tune
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt
