"""The read plan (``lmdbfolder.read.plan``) and the capabilities snapshot it is decided from.

Decided once, run many: the questions "is the compiled module built, does it
reproduce Pillow, which decoder, which pass order, what does the environment
say" are answered once per process, the plan takes its answers once per
dataset and transform, and the per-image path asks nothing. These tests count
the questions and the environment reads over whole batches, and check that
every way of making a sample goes through the one executor (``ReadPlan.run``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from conftest import image_bytes, photo_jpeg, write
from lmdbfolder import fused, pack
from lmdbfolder.encodings import ENCODINGS, encoding_of
from lmdbfolder.read import regions
from lmdbfolder.read.capabilities import Capabilities, current
from lmdbfolder.read.plan import ReadPlan
from lmdbfolder.torch import LMDBFolder, collate


@pytest.fixture(scope="module")
def tree_and_pack(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("plan")
    rng = np.random.default_rng(5)
    for k in range(12):
        w, h = [(161, 121), (121, 161), (300, 200), (64, 48)][k % 4]
        if k % 4 == 3:
            data, ext = image_bytes(["rgba_png", "cmyk_jpeg", "gray_jpeg"][k % 3], rng, w, h)
        else:
            data, ext = photo_jpeg(w, h, seed=k), ".jpg"
        write(root / "src" / f"c{k % 2}" / f"{k:02d}{ext}", data)
    pack(root / "src", root / "p", progress=False)
    return root / "src", root / "p"


class CountingEnviron(dict):  # type: ignore[type-arg]
    """``os.environ`` that counts every read."""

    reads = 0

    def __getitem__(self, key: str) -> str:
        CountingEnviron.reads += 1
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        CountingEnviron.reads += 1
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        CountingEnviron.reads += 1
        return super().__contains__(key)


TRANSFORMS = {
    "default": lambda: T.Compose([T.RandomResizedCrop(48), T.RandomHorizontalFlip(), T.PILToTensor()]),
    "fast": lambda: T.Compose(
        [fused.RandomResizedCrop(48, resize="opencv", output="tensor"), T.RandomHorizontalFlip()]
    ),
    "per-sample": lambda: T.Compose([T.RandomResizedCrop(40), T.ToTensor(), T.Normalize([0.5] * 3, [0.2] * 3)]),
    "whole": lambda: T.Compose([T.Resize((20, 20)), T.PILToTensor()]),
}


@pytest.mark.parametrize("kind", sorted(TRANSFORMS))
@pytest.mark.parametrize("threads", [1, 2])
def test_a_batch_asks_no_questions_and_reads_no_environment(
    tree_and_pack: tuple[Path, Path], capabilities: Any, monkeypatch: pytest.MonkeyPatch, kind: str, threads: int
) -> None:
    if kind == "fast":
        pytest.importorskip("cv2")
    _, packed = tree_and_pack
    caps = capabilities()
    ds = LMDBFolder(packed, transform=TRANSFORMS[kind](), threads=threads)
    every = list(range(len(ds)))
    ds.__getitems__(every[:2])  # the first use resolves the plan: the questions are asked here
    ds[0]
    asked = caps.questions
    monkeypatch.setattr(os, "environ", CountingEnviron(os.environ))
    CountingEnviron.reads = 0
    for _ in range(2):
        ds.__getitems__(every)
        for i in every:
            ds[i]
    assert caps.questions == asked, "the per-image path asked the capabilities again"
    assert CountingEnviron.reads == 0, "the per-image path read the environment"


def test_every_path_runs_through_the_one_executor(tree_and_pack: tuple[Path, Path]) -> None:
    """One sample, a whole batch, the fused crop with PIL and tensor output: each
    is made by ``ReadPlan.run`` (a batch of one for single samples)."""
    _, packed = tree_and_pack
    for tf in (TRANSFORMS["default"](), fused.RandomResizedCrop(32, output="tensor"), fused.RandomResizedCrop(32)):
        ds = LMDBFolder(packed, transform=tf)
        plan = ds._plan()
        with mock.patch.object(plan.read, "run", wraps=plan.read.run) as spy:
            ds[0]
            ds.__getitems__([1, 2, 3])
        sizes = [len(call.args[0]) for call in spy.call_args_list]
        assert sizes == ([1, 3] if plan.batches else [1, 1, 1, 1])


def test_the_plan_is_made_once_per_transform_and_process(tree_and_pack: tuple[Path, Path]) -> None:
    _, packed = tree_and_pack
    ds = LMDBFolder(packed, transform=TRANSFORMS["default"]())
    first = ds._plan()
    ds[0]
    ds.__getitems__([0, 1])
    assert ds._plan() is first
    ds.transform = TRANSFORMS["fast"]() if current().cv2() is not None else TRANSFORMS["whole"]()
    assert ds._plan() is not first  # a new transform: a new plan
    ds.decoder = "pillow"
    assert ds._plan().read.decoder.name == "pillow" and ds._plan().read.regions is None


def test_a_snapshot_asks_each_question_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    caps = Capabilities(environ={})
    for _ in range(3):
        assert caps.answer("x", lambda: calls.append("x") or 7) == 7
    assert calls == ["x"] and caps.questions == 3
    # The environment switch is read when the snapshot is made, never again.
    off = Capabilities(environ={regions.ENV_SWITCH: "0"})
    assert off.region_decoder() is None and regions.ENV_SWITCH in (off.why_no_regions() or "")
    # Answers given up front are taken as found (None included).
    given = Capabilities(environ={}, compiled=None)
    assert given.compiled() is None and given.exact_resize() is None and "not built" in (given.why_no_regions() or "")


def test_a_read_plan_is_not_sent_to_other_processes() -> None:
    import pickle

    plan = ReadPlan(current().decoder("pillow"))
    with pytest.raises(TypeError, match="each process"):
        pickle.dumps(plan)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_make_their_own_plan_and_give_imagefolders_batches(
    tree_and_pack: tuple[Path, Path], context: str
) -> None:
    """The dataset used in the parent first (its plan made there), then two workers:
    each makes its own plan (fork: the parent's is not reused; spawn: none is
    sent), and the batches are ImageFolder's."""
    src, packed = tree_and_pack
    tf = TRANSFORMS["default"]()
    ours = LMDBFolder(packed, transform=tf)
    ours[0]  # the parent's plan
    loaders = []
    for ds, collate_fn in ((ImageFolder(str(src), transform=tf), None), (ours, collate)):
        torch.manual_seed(11)
        loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context, collate_fn=collate_fn)
        loaders.append(list(loader))
    for (xa, ya), (xb, yb) in zip(*loaders):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_each_encoding_is_looked_up_in_one_registry() -> None:
    assert {"jpeg", "png", "webp", "raw", "other"} <= set(ENCODINGS)
    assert encoding_of("never-heard-of") is ENCODINGS["other"]
    jpeg, raw = encoding_of("jpeg"), encoding_of("raw")
    assert jpeg.fusable(3) and jpeg.fusable(1) and not jpeg.fusable(4)  # CMYK is Pillow's conversion
    assert raw.fusable(3) and encoding_of("webp").fusable(3) and not encoding_of("png").fusable(4)
    with pytest.raises(ValueError, match="raw pixels"):
        raw.pixels(b"\x00" * 5, 2, 1, 3, None, 1, None)


def test_an_interrupt_returns_only_once_every_thread_has_finished(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C in the main thread's share of a batch left the pool's threads writing into
    # the batch buffer, which the next batch reuses. (The Python path: not only native.)
    from lmdbfolder.read.plan import CropJob, CropSpec, ReadPlan

    plan = ReadPlan(current().decoder("pillow"), crop=CropSpec((4, 4), "pil"), threads=2)
    main = threading.get_ident()
    go, made = threading.Event(), []

    def one(job: CropJob, dst: np.ndarray, local: Any, planar: bool) -> None:
        if threading.get_ident() == main:
            go.set()
            raise KeyboardInterrupt
        go.wait()
        dst[...] = 1
        made.append(job)

    monkeypatch.setattr(plan, "_one", one)
    out = np.zeros((40, 3, 4, 4), np.uint8)
    with pytest.raises(KeyboardInterrupt):
        plan.run([None] * 40, out)  # type: ignore[list-item]
    assert len(made) == 39 and int(out.sum()) == 39 * 48  # all the other thread's images, before it returned
