"""Every Python snippet of the README and of the docs pages that took over its sections runs.

The snippets are read from the documents themselves (every fenced ``python``
block), so a snippet that is edited is the snippet that is tested, and a new
one without a way to run here fails ``test_every_snippet_has_a_runner``. Each
runs in a fresh interpreter, in a work folder holding the small tree or pack
its paths name; what it leaves to the reader (``train_transform``,
``checkpoint``, ...) is defined by a prelude, and the places it names that do
not exist here are swapped for local ones: a cluster path for the work
folder, ``"cuda"`` for ``"cpu"``, NCCL for gloo on one rank, S3 for the test
suite's moto server. The Ray snippet runs in this process, on the session's
Ray cluster.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from conftest import S3, free_port, make_small_tree, make_voc
from lmdbfolder import Resize, pack
from lmdbfolder.write.shards import pack_sharded

REPO = Path(__file__).resolve().parent.parent
#: The README and the pages its sections moved to (the ones holding snippets).
PAGES = (
    "README.md",
    "docs/usage.md",
    "docs/performance.md",
    "docs/gpu.md",
    "docs/distributed.md",
    "docs/object-storage.md",
    "docs/sharding.md",
    "docs/troubleshooting.md",
    "docs/hugging-face.md",
    "docs/switching-from-imagefolder.md",
    "docs/replay.md",
)
_FENCE = re.compile(r"^( *)```python\n(.*?)^\1```", re.M | re.S)


def snippets() -> list[tuple[str, int, str]]:
    """``(page, number on the page, code)`` of every Python snippet (indentation removed)."""
    found = []
    for page in PAGES:
        text = (REPO / page).read_text()
        for n, match in enumerate(_FENCE.finditer(text)):
            indent = len(match.group(1))
            code = "\n".join(line[indent:] for line in match.group(2).splitlines())
            found.append((page, n, code + "\n"))
    return found


def _tree(work: Path) -> Path:
    return make_small_tree(work / "imagenet" / "train")


def _train_pack(work: Path) -> None:
    pack(_tree(work), work / "train.lmdb", progress=False)


def _resized_pack(work: Path) -> None:
    pack(_tree(work), work / "train-256.lmdb", resize=Resize(256), progress=False)


def _sharded_pack(work: Path) -> None:
    pack_sharded(_tree(work), work / "train", shards=2, progress=False)


def _exported(work: Path) -> None:
    from lmdbfolder.tools.export import export

    pack(_tree(work), work / "source.lmdb", progress=False)
    export(work / "source.lmdb", work / "train-hf", format="huggingface", progress=False)


#: One rank of a gloo job, as torchrun would set it up.
_ONE_RANK = """
import os
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
"""
_TRANSFORM = (
    "from torchvision import transforms as T\ntrain_transform = T.Compose([T.RandomResizedCrop(32), T.PILToTensor()])\n"
)


def _voc(work: Path) -> None:
    make_voc(work / "data")


def _pairs(work: Path) -> None:
    # BasicSR's folders at x4 (DIV2K's names), packed as the README's shell line says.
    import numpy as np
    from PIL import Image

    from lmdbfolder.cli import main

    rng = np.random.default_rng(0)
    (work / "DIV2K/DIV2K_train_HR").mkdir(parents=True)
    (work / "DIV2K/DIV2K_train_LR_bicubic/X4").mkdir(parents=True)
    for name in ("0001", "0002", "0003"):
        gt = Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
        gt.save(work / f"DIV2K/DIV2K_train_HR/{name}.png")
        gt.resize((16, 12), Image.BICUBIC).save(work / f"DIV2K/DIV2K_train_LR_bicubic/X4/{name}x4.png")
    argv = ["pack", str(work / "DIV2K"), str(work / "sr.lmdb"), "--layout", "pairs", "--scale", "4", "--no-progress"]
    assert (
        main([*argv, "--gt-dir", "DIV2K_train_HR", "--lq-dir", "DIV2K_train_LR_bicubic/X4", "--filename-tmpl", "{}x4"])
        == 0
    )


@dataclass
class Runner:
    """How one snippet runs here: what its work folder holds, what it is given, what is swapped."""

    marker: str  # a line of the snippet that names it
    setup: Callable[[Path], None] | None = None
    prelude: str = ""
    swaps: dict[str, str] = field(default_factory=dict)
    epilogue: str = ""
    needs: tuple[str, ...] = ()  # modules without which it cannot run here (skipped)
    s3: bool = False  # its pack is uploaded to the test's bucket first
    ray: bool = False  # runs in this process, on the session's Ray cluster


RUNNERS = [
    Runner(
        'lmdbfolder.pack("imagenet/train", "train.lmdb")',
        _tree,
        epilogue="assert len(ds) == 12 and images.shape[1:] == (3, 224, 224)\n",
    ),
    Runner(
        'ds = LMDBFolder("train-256.lmdb", transform=tf, threads=8)',
        _resized_pack,
        epilogue="images, targets = next(iter(loader))\nassert images.shape == (12, 3, 224, 224)\n",
    ),
    Runner('with lmdbfolder.open_pack("train.lmdb") as r:', _train_pack),
    Runner(
        "crop = DeviceRandomResizedCrop(224",
        _train_pack,
        swaps={'device="cuda"': 'device="cpu"', "pin_memory=True": "pin_memory=False"},
        epilogue="assert images.shape[1:] == (3, 224, 224) and images.dtype.is_floating_point\n",
    ),
    Runner(
        'dist.init_process_group("nccl")',
        _train_pack,
        prelude=_ONE_RANK + _TRANSFORM + "checkpoint = None\nepochs = 2\n",
        swaps={'"nccl"': '"gloo"', '"/local/ssd/train"': '"train.lmdb"', "num_workers=8": "num_workers=2"},
        epilogue="assert epoch == 1 and os.path.exists('ckpt-rank0.pt')\n",
        needs=("torchdata",),
    ),
    Runner(
        'ds = LMDBFolder("s3://bucket/train"',
        _sharded_pack,
        prelude=_ONE_RANK
        + "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
        + "from lmdbfolder.sampler import ExactDistributedSampler\nfrom lmdbfolder.torch import LMDBFolder\n"
        + "tf = None\nnum_nodes = 1\n",
        swaps={'"/local/nvme/cache"': '"cache"'},
        epilogue="assert sorted(ds[i][1] for i in sampler) == sorted(ds.targets)\n",
        needs=("s3fs", "moto"),
        s3=True,
    ),
    Runner(
        "pack_ray(",
        _tree,
        swaps={'"/shared/imagenet/train"': '"imagenet/train"', '"/shared/packs/train"': '"packs/train"'},
        epilogue="import lmdbfolder\nassert len(lmdbfolder.open_pack('packs/train')) == 12\n",
        needs=("ray",),
        ray=True,
    ),
    Runner(
        'ds = load_dataset("train-hf", split="train")',
        _exported,
        epilogue="assert len(ds) == 12 and ds.features['label'].names == ['class0', 'class1', 'class2']\n",
        needs=("datasets",),
    ),
    Runner(
        'lmdbfolder.pack_dataset(ds, "train.lmdb")',
        _exported,
        epilogue="r = lmdbfolder.open_pack('train.lmdb')\nassert len(r) == 12 and r.classes == ds.features['label'].names\n",  # noqa: E501
        needs=("datasets",),
    ),
    Runner(
        'ds = LMDBFolder(pack, class_order="timm")',
        _train_pack,
        prelude="from lmdbfolder.torch import LMDBFolder\npack = 'train.lmdb'\n",
        epilogue="assert ds.classes == ['class0', 'class1', 'class2']\n",
    ),
    Runner(
        "class WithoutBackground(LMDBFolder):",
        _train_pack,
        prelude="from lmdbfolder.torch import LMDBFolder\n",
        epilogue="ds = WithoutBackground('train.lmdb')\nassert len(ds.classes) == 3 and len(ds) == 12\n",
    ),
    Runner(
        'ds = LMDBFolder("train.lmdb", transform=tf, seed=0)',
        _train_pack,
        prelude=_ONE_RANK,
        swaps={'backend="nccl"': 'backend="gloo"', "num_workers=8": "num_workers=2", "batch_size=256": "batch_size=4"},
        epilogue="assert ds.epoch == 1 and images.shape[1:] == (3, 224, 224)\n",
    ),
    Runner(
        "class SkipBad(LMDBFolder):",
        _train_pack,
        prelude="from lmdbfolder.torch import LMDBFolder\n",
        epilogue="ds = SkipBad('train.lmdb')\nassert ds[0][1] == 0\n",
    ),
    Runner(
        'lmdbfolder.pack_dataset(datasets.VOCSegmentation("data", image_set="train"), "voc.lmdb")',
        _voc,
        swaps={
            "RandomResizedCrop(320)": "RandomResizedCrop(32)",
            "batch_size=16, num_workers=8": "batch_size=2, num_workers=2",
        },
        epilogue="images, masks = next(iter(loader))\n"
        "assert images.shape == (2, 3, 32, 32) and masks.shape == (2, 1, 32, 32)\n",
    ),
    Runner(
        'fused.PairedRandomCrop(128, 4, output="tensor")',
        _pairs,
        swaps={
            "PairedRandomCrop(128, 4": "PairedRandomCrop(32, 4",
            "batch_size=16, num_workers=8": "batch_size=3, num_workers=2",
        },
        epilogue="assert lq.shape == (3, 3, 8, 8) and gt.shape == (3, 3, 32, 32) and gt.dtype == torch.float32\n",
    ),
]


def runner_of(code: str) -> Runner | None:
    mine = [r for r in RUNNERS if r.marker in code]
    return mine[0] if len(mine) == 1 else None


SNIPPETS = snippets()


def test_every_snippet_has_a_runner() -> None:
    assert len(SNIPPETS) >= 16  # README 4, the docs pages 12 (the fast settings twice)
    for page, n, code in SNIPPETS:
        assert runner_of(code) is not None, f"{page}, snippet {n + 1}: add a Runner to tests/test_docs_snippets.py"
    used = {runner_of(code).marker for _, _, code in SNIPPETS}  # type: ignore[union-attr]
    assert used == {r.marker for r in RUNNERS}, "a Runner whose snippet is gone"


def _params() -> list[object]:
    out = []
    for page, n, code in SNIPPETS:
        runner = runner_of(code)
        marks = [pytest.mark.ray] if runner is not None and runner.ray else []
        if runner is not None and runner.s3:
            marks.append(pytest.mark.s3)  # its S3 server's threads stay: run after the forking tests
        out.append(pytest.param(page, code, id=f"{page}-{n + 1}", marks=marks))
    return out


@pytest.mark.long("runs every snippet of the README and the docs pages, each in a fresh interpreter")
@pytest.mark.parametrize("page, code", _params())
def test_the_snippet_runs(page: str, code: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    runner = runner_of(code)
    assert runner is not None
    for module in runner.needs:
        pytest.importorskip(module)
    work = tmp_path / "work"
    work.mkdir()
    if runner.setup is not None:
        runner.setup(work)
    for old, new in runner.swaps.items():
        assert old in code, f"{page}: the snippet no longer says {old}"
        code = code.replace(old, new)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    if runner.s3:
        s3: S3 = request.getfixturevalue("s3")
        from lmdbfolder import copy_pack

        copy_pack(work / "train", s3.url("train"), progress=False)
        code = code.replace('"s3://bucket/train"', repr(s3.url("train")))
        env.update(s3.env())
    if runner.ray:
        request.getfixturevalue("ray_cluster")
        monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
        monkeypatch.chdir(work)
        exec(compile(runner.prelude + code + runner.epilogue, page, "exec"), {"__name__": "__snippet__"})
        return
    program = runner.prelude.replace("{port}", str(free_port())) + code + runner.epilogue
    proc = subprocess.run(
        [sys.executable, "-c", program], cwd=work, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"{page}:\n{program}\n{proc.stdout}\n{proc.stderr[-4000:]}"
