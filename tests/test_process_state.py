"""A library call leaves the caller's process as it found it.

glibc's heap adapts to a program: after a large block is freed, blocks of that
size come from the heap instead of fresh pages (its dynamic mmap threshold).
Any ``mallopt`` of those thresholds switches that off for the rest of the
process, and nothing switches it on again. The writer once tuned them around
every pack, in the caller's process: a notebook that packed and then trained
in the same process paid ~700 page faults and 1.8 ms of kernel time per
sample of a VOC pipeline afterwards (1.75x its CPU). These tests count the
page faults of the same allocations before and after each kind of write,
in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.conftest import tree

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")

#: Allocations of 1 MiB, each touched and freed: with glibc's adaptive thresholds the
#: first one raises the threshold and the rest reuse the heap (a few faults in all);
#: with the thresholds pinned at 128 KiB each is a fresh mapping (256 faults each).
_PROBE = 64

_SCRIPT = textwrap.dedent(
    """
    import json, resource, shutil, sys
    import numpy as np
    import lmdbfolder

    def faults():
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range({probe}):
            a = np.empty(1 << 20, np.uint8)
            a.fill(1)
            del a
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0

    src, dst, kind = sys.argv[1:4]
    faults()  # the heap learns the size
    out = {{"before": faults()}}
    if kind == "pack":
        lmdbfolder.pack(src, dst, workers=1)
    elif kind == "update":
        lmdbfolder.pack(src, dst, workers=1)
        out["after pack"] = faults()
        shutil.copyfile(src + "/cat/img00.jpg", src + "/dog/new.jpg")
        lmdbfolder.pack(src, dst, update=True)
    elif kind == "dataset":
        lmdbfolder.pack_dataset([(np.zeros((4, 5), np.uint8), {{"id": i}}) for i in range(6)], dst)
    out["after"] = faults()
    print(json.dumps(out))
    """
).format(probe=_PROBE)


@pytest.mark.parametrize("kind", ["pack", "update", "dataset"])
def test_writing_leaves_the_heap_adaptive(tmp_path: Path, kind: str) -> None:
    src = tree(tmp_path / "src", per_class=3)
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(src), str(tmp_path / "dst"), kind],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    pinned = _PROBE * 256  # every probe a fresh 1 MiB mapping
    for when, n in counts.items():
        assert n < pinned // 4, (when, counts)
