"""Fault injection: kill a real `lmdbfolder pack` with SIGKILL at random moments.

Every kill must leave a partial pack that the same command resumes, and the
pack that finally appears must equal an uninterrupted pack of the same tree.
The default run tries a few kills; `--run-slow` (make test-all) runs a soak.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
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


def kill_and_resume(src: Path, out: Path, kills: int, full_run: float, seed: int) -> dict:
    """Start the pack and SIGKILL it at a random moment of a full run's duration,
    `kills` times (or until a run finishes first), then let it finish."""
    rng = random.Random(seed)
    stats = {"tried": 0, "landed": 0}
    # Keep going until `kills` kills landed mid-pack (a busy machine can make a
    # kill come too early or too late), within a bound.
    while stats["landed"] < kills and stats["tried"] < 3 * kills:
        proc = subprocess.Popen(_cmd(src, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.05, 0.7) * full_run)
        stats["tried"] += 1
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        if out.is_dir():  # it finished (and maybe died on its way out): nothing left to do
            assert proc.returncode in (0, -signal.SIGKILL), err.decode()
            return stats
        assert proc.returncode == -signal.SIGKILL, err.decode()
        stats["landed"] += 1  # killed mid-pack
    proc = subprocess.run(_cmd(src, out), capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    return stats


def _check(tmp_path: Path, kills: int, n: int, seed: int) -> dict:
    """Pack the tree again and again, killing each run at random moments, until
    `kills` kills have landed mid-pack; every finished pack must equal the reference."""
    src = _tree(tmp_path / "src", n)
    start = time.perf_counter()
    subprocess.run(_cmd(src, tmp_path / "ref"), check=True, capture_output=True, timeout=300)
    full_run = time.perf_counter() - start
    reference = pack_contents(tmp_path / "ref")
    total = {"tried": 0, "landed": 0, "packs": 0}
    while total["landed"] < kills:
        out = tmp_path / f"out{total['packs']}"
        stats = kill_and_resume(src, out, kills - total["landed"], full_run, seed + total["packs"])
        assert out.is_dir() and not Path(f"{out}.partial").exists()
        assert verify(out, progress=False).ok
        assert pack_contents(out) == reference
        total["tried"] += stats["tried"]
        total["landed"] += stats["landed"]
        total["packs"] += 1
        shutil.rmtree(out)
        if stats["landed"] == 0 and total["packs"] > 3:
            break  # the machine is too fast or too slow for the kill timing: report what happened
    print(
        f"\nSIGKILLs sent {total['tried']}, landed mid-pack {total['landed']}, over {total['packs']} packs: "
        "every one resumed, every pack equals the uninterrupted reference"
    )
    return total


def test_sigkill_at_random_points_then_resume(tmp_path: Path) -> None:
    stats = _check(tmp_path, kills=5, n=1500, seed=int(os.environ.get("LMDBFOLDER_FAULT_SEED", "1")))
    assert stats["landed"] >= 3


@pytest.mark.slow
def test_sigkill_soak(tmp_path: Path) -> None:
    kills = int(os.environ.get("LMDBFOLDER_SOAK_KILLS", "100"))
    stats = _check(tmp_path, kills=kills, n=3000, seed=int(os.environ.get("LMDBFOLDER_FAULT_SEED", "2")))
    assert stats["landed"] >= kills
