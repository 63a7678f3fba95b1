"""An ordered, bounded, parallel map: the reading side of the writer.

Reading source files (and hashing, sniffing or decoding them) runs in a pool
of threads, which is enough here because the expensive parts (``read``,
``zlib.crc32``, Pillow's decoders and LMDB's commit) release the GIL. Results
come back in input order, so the single LMDB writer can append, and at most
``max_inflight`` results exist at a time, which bounds memory. Keeping many
reads in flight is what lets reading continue while the writer waits for a
commit to reach the disk. Items are handed to threads in small chunks so the
per-task overhead of the pool stays small next to the work.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generator, Sequence, TypeVar

__all__ = ["ordered_map", "default_workers"]

T = TypeVar("T")
R = TypeVar("R")


def default_workers() -> int:
    """Reader threads: enough to keep a disk busy, scaled with the CPU count."""
    return max(4, min(32, 2 * (os.cpu_count() or 1)))


def ordered_map(
    fn: Callable[[T], R], items: Sequence[T], *, workers: int, max_inflight: int, chunk: int = 8
) -> Generator[R, None, None]:
    """Yield ``fn(item)`` for each item, in order, computed by ``workers`` threads.

    At most about ``max_inflight`` results are computed ahead of the consumer.
    An exception raised by ``fn`` is re-raised when its result is reached.
    With ``workers <= 1`` everything runs in the calling thread. Closing the
    generator early cancels the work not yet started.
    """
    if workers <= 1:
        for item in items:
            yield fn(item)
        return
    chunk = max(1, min(chunk, max_inflight // (2 * workers) or 1))
    ahead = max(1, max_inflight // chunk)
    starts = iter(range(0, len(items), chunk))

    def run(start: int) -> list[R]:
        return [fn(item) for item in items[start : start + chunk]]

    pool = ThreadPoolExecutor(workers, thread_name_prefix="lmdbfolder-read")
    pending: deque[Future[list[R]]] = deque()
    try:
        for start in starts:
            pending.append(pool.submit(run, start))
            if len(pending) >= ahead:
                break
        while pending:
            results = pending.popleft().result()
            for start in starts:
                pending.append(pool.submit(run, start))
                break
            yield from results
    finally:
        for fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
