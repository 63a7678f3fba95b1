"""Where a benchmark writes its scratch: a new folder of its own, removed at the end.

A benchmark's scratch (copies of a tree, packs, downloads) can be several times
the size of the dataset, so it must not outlive the run, and a folder the user
names (``--work DIR``) may already hold their own files under names a benchmark
would pick (``src``, ``old``, ``copy``, ``pack.lmdb``...). So:

* the scratch is always a folder this run creates, uniquely named
  (``tempfile.mkdtemp``) inside the folder given, or inside the system's
  temporary folder; nothing that was there before is written to or deleted;
* it is removed when the run ends, successfully or not, unless ``keep``
  (then its path is printed, so it can be looked at and removed by hand).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def scratch(parent: str | None, prefix: str, *, keep: bool = False) -> Iterator[str]:
    """A new folder named ``prefix...`` inside ``parent`` (made if missing; ``None``: the
    system's temporary folder), yielded, then removed with everything in it unless ``keep``."""
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield path
    finally:
        if keep:
            print(f"kept the work folder {path} (remove it when done: it is scratch)", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
