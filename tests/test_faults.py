"""Fault injection: kill a real `lmdbfolder pack` with SIGKILL at random points of its work.

Every kill must leave a partial pack that the same command resumes, and the
pack that finally appears must equal an uninterrupted pack of the same tree.
The default run tries a few kills; `--run-slow` (make test-all) runs a soak.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import image_bytes, pack_contents, write
from lmdbfolder.tools.verify import verify


def _tree(root: Path, n: int) -> Path:
    rng = np.random.default_rng(11)
    for i in range(n):
        data, ext = image_bytes("rgb_jpeg" if i % 7 else "palette_png", rng, w=32 + i % 9, h=24 + i % 5)
        write(root / f"class{i % 5}" / f"img{i:04d}{ext}", data)
    write(root / "class1" / "zero.jpg", b"")  # a skip, to check skips survive kills too
    return root


def _cmd(src: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "lmdbfolder", "pack", str(src), str(out), "--commit-every", "3", "--no-progress"]


# ``lmdbfolder pack`` that SIGKILLs itself at an event, not at a moment: when commit
# number C starts, a thread is started that spins S times and then sends the kill,
# and commit C + 1 waits for it at its end. So the kill lands between the start of
# commit C and the end of commit C + 1 (inside LMDB's commit, between two commits,
# while a batch is read, wherever the spin ends) on a quiet or a busy machine alike:
# a kill timed by the clock came too early or too late when the machine was busy.
KILLER = textwrap.dedent(
    """
    import os, signal, sys, threading
    from lmdbfolder.write import loop
    from lmdbfolder.cli import main

    at, spins = int(sys.argv[1]), int(sys.argv[2])
    commits = [0]
    sent = threading.Event()
    commit = loop._Partial.commit

    def kill():
        for _ in range(spins):
            pass
        sent.set()
        os.kill(os.getpid(), signal.SIGKILL)

    def counted(self, batch, extra):
        n = commits[0]
        commits[0] += 1
        if n == at:
            threading.Thread(target=kill, daemon=True).start()
        commit(self, batch, extra)
        if n == at + 1:
            sent.wait()
            threading.Event().wait()  # the kill is on its way

    loop._Partial.commit = counted
    sys.exit(main(sys.argv[3:]))
    """
)


def kill_and_resume(src: Path, out: Path, kills: int, commits: int, seed: int) -> dict:
    """Start the pack and SIGKILL it at a random commit and spin, ``kills`` times (each run
    resuming the last; ``commits``: how many a whole run makes), then let it finish."""
    rng = random.Random(seed)
    stats = {"tried": 0, "landed": 0}
    # A run killed at commit ``at`` made at most ``at + 2`` commits: leave room for every kill.
    share = max(3, commits // (kills + 1))
    for _ in range(kills):
        at, spins = rng.randrange(share - 2), rng.choice((0, 10, 1_000, 100_000, 1_000_000))
        argv = [sys.executable, "-c", KILLER, str(at), str(spins), *_cmd(src, out)[3:]]
        proc = subprocess.run(argv, capture_output=True, timeout=300)
        stats["tried"] += 1
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()  # every kill lands mid-pack
        assert not out.is_dir()
        stats["landed"] += 1
    proc = subprocess.run(_cmd(src, out), capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    return stats


def _check(tmp_path: Path, kills: int, n: int, seed: int) -> dict:
    """Pack the tree, killing the run at a random commit ``kills`` times (each run resumes
    the last); the pack that finally appears must equal the uninterrupted reference."""
    src = _tree(tmp_path / "src", n)
    subprocess.run(_cmd(src, tmp_path / "ref"), check=True, capture_output=True, timeout=300)
    reference = pack_contents(tmp_path / "ref")
    commits = n // 3  # --commit-every 3 (more when a batch fills its bytes first)
    out = tmp_path / "out"
    stats = kill_and_resume(src, out, kills, commits, seed)
    assert out.is_dir() and not Path(f"{out}.partial").exists()
    assert verify(out, progress=False).ok
    assert pack_contents(out) == reference
    print(
        f"\nSIGKILLs sent {stats['tried']}, landed mid-pack {stats['landed']}: "
        "every one resumed, the pack equals the uninterrupted reference"
    )
    return stats


def test_sigkill_at_random_points_then_resume(tmp_path: Path) -> None:
    stats = _check(tmp_path, kills=5, n=1500, seed=int(os.environ.get("LMDBFOLDER_FAULT_SEED", "1")))
    assert stats["landed"] == 5


@pytest.mark.slow
def test_sigkill_soak(tmp_path: Path) -> None:
    kills = int(os.environ.get("LMDBFOLDER_SOAK_KILLS", "100"))
    stats = _check(tmp_path, kills=kills, n=3000, seed=int(os.environ.get("LMDBFOLDER_FAULT_SEED", "2")))
    assert stats["landed"] >= kills
