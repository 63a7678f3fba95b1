"""The fused crops of several fields (lmdbfolder.torch.joint, lmdbfolder.read.pairs) against
their oracles: torchvision v2's own pipeline on the decoded sample (image + mask + boxes), and
BasicSR's paired_random_crop + augment (its behaviour: Python's random, cv2's decode) for pairs.
Equality is pixel for pixel under the same seed."""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2

from conftest import photo_jpeg
from lmdbfolder.read.capabilities import current
from lmdbfolder.read.pairs import PairDraw, augment_patch, draw_pair
from lmdbfolder.torch.joint import (
    ImageFieldError,
    JointPlan,
    PairedRandomCrop,
    PairPlan,
    PendingImage,
    PendingMask,
    plan_fields,
    split_joint,
)


def _mask_png(w: int, h: int, seed: int = 0, mode: str = "P") -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    classes = ((x // 7 + y // 5 + rng.integers(0, 3, (h, w))) % 21).astype(np.uint8)
    classes[: h // 6] = 255  # VOC's "void" border
    img = Image.fromarray(classes, "L")
    if mode == "P":
        img = img.convert("P")
        img.putpalette([v for i in range(256) for v in (i, 255 - i, (7 * i) % 256)])
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def _decoder() -> object:
    return current().decoder("pillow")


def _sample(w: int, h: int, seed: int) -> tuple[bytes, bytes]:
    return photo_jpeg(w, h, seed=seed), _mask_png(w, h, seed)


def _oracle_inputs(jpeg: bytes, png: bytes) -> tuple[Image.Image, tv_tensors.Mask]:
    # What VOCSegmentation wrapped for v2 gives: the RGB image and the mask as a Mask.
    return Image.open(io.BytesIO(jpeg)).convert("RGB"), tv_tensors.Mask(
        v2.functional.pil_to_tensor(Image.open(io.BytesIO(png))).squeeze(0)
    )


def _layout(t: torch.Tensor) -> list[int]:
    """A tensor's memory layout: the strides of its dimensions longer than 1 (a transposed mask,
    or a contiguous image where v2's ToImage gives a permuted one, differs)."""
    return [stride for stride, n in zip(t.stride(), t.shape) if n > 1]


def _same(a: object, b: object) -> None:
    if isinstance(a, Image.Image):
        assert isinstance(b, Image.Image) and a.mode == b.mode and a.size == b.size
        assert np.array_equal(np.asarray(a), np.asarray(b))
    elif isinstance(a, torch.Tensor):
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape  # type: ignore[attr-defined]
        assert torch.equal(a.as_subclass(torch.Tensor), b.as_subclass(torch.Tensor))  # type: ignore[attr-defined]
        assert _layout(a) == _layout(b)  # type: ignore[arg-type]
        if isinstance(a, tv_tensors.BoundingBoxes):
            assert a.canvas_size == b.canvas_size and a.format == b.format  # type: ignore[attr-defined]
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b):  # type: ignore[call-overload]
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize(
    "interpolation", [v2.InterpolationMode.BILINEAR, v2.InterpolationMode.NEAREST, v2.InterpolationMode.BICUBIC]
)
def test_image_and_mask_equal_v2_under_the_same_seed(interpolation: v2.InterpolationMode) -> None:
    tf = v2.Compose(
        [v2.RandomResizedCrop((40, 56), interpolation=interpolation), v2.RandomHorizontalFlip(), v2.ToImage()]
    )
    plan = JointPlan(tf, decoder=_decoder())
    assert plan.fused and plan.batches
    for seed, (w, h) in enumerate([(161, 121), (97, 130), (64, 48), (33, 200)]):
        jpeg, png = _sample(w, h, seed)
        torch.manual_seed(seed)
        want = tf(*_oracle_inputs(jpeg, png))
        torch.manual_seed(seed)
        got = plan(PendingImage(jpeg), _oracle_inputs(jpeg, png)[1])
        _same(want, got)


def test_flips_both_ways_and_without_a_flip_step() -> None:
    jpeg, png = _sample(150, 110, 3)
    for tf in (
        v2.Compose([v2.RandomResizedCrop(32), v2.RandomHorizontalFlip(p=0.5)]),
        v2.Compose([v2.RandomResizedCrop(32), v2.RandomHorizontalFlip(p=1.0)]),
        v2.Compose([v2.RandomResizedCrop(32), v2.RandomHorizontalFlip(p=0.0)]),
        v2.Compose([v2.RandomResizedCrop(32)]),
        v2.RandomResizedCrop(32, scale=(0.5, 1.0)),
    ):
        plan = JointPlan(tf, decoder=_decoder())
        assert plan.fused
        for seed in range(4):
            torch.manual_seed(seed)
            want = tf(*_oracle_inputs(jpeg, png))
            after_want = torch.rand(1)
            torch.manual_seed(seed)
            got = plan(PendingImage(jpeg), _oracle_inputs(jpeg, png)[1])
            assert torch.equal(torch.rand(1), after_want)  # the same count of random numbers drawn
            _same(want, got)


def test_the_region_decoder_and_the_fast_decoder_keep_the_pixels() -> None:
    caps = current()
    if caps.region_decoder() is None:
        pytest.skip(f"no region decoder here: {caps.why_no_regions()}")
    tf = v2.Compose([v2.RandomResizedCrop(48), v2.RandomHorizontalFlip()])
    plan = JointPlan(tf, decoder=caps.decoder(caps.auto_decoder()))
    for seed in range(5):
        jpeg, png = _sample(173, 131, seed)
        torch.manual_seed(seed)
        want = tf(*_oracle_inputs(jpeg, png))
        torch.manual_seed(seed)
        got = plan(PendingImage(jpeg), _oracle_inputs(jpeg, png)[1])
        _same(want, got)


def test_boxes_labels_and_sanitize_as_v2() -> None:
    tf = v2.Compose(
        [
            v2.RandomResizedCrop(64, scale=(0.1, 0.5)),
            v2.RandomHorizontalFlip(),
            v2.SanitizeBoundingBoxes(min_size=2),
            v2.ToImage(),
        ]
    )
    plan = JointPlan(tf, decoder=_decoder())
    jpeg = photo_jpeg(180, 140, seed=5)

    def target() -> dict[str, object]:
        boxes = tv_tensors.BoundingBoxes(
            [[5, 5, 40, 30], [100, 60, 170, 135], [60, 10, 64, 14], [0, 100, 179, 139]],
            format="XYXY",
            canvas_size=(140, 180),
        )
        return {"boxes": boxes, "labels": torch.tensor([1, 2, 3, 4]), "image_id": 7}

    dropped = 0
    for seed in range(8):
        torch.manual_seed(seed)
        want = tf(Image.open(io.BytesIO(jpeg)).convert("RGB"), target())
        torch.manual_seed(seed)
        got = plan(PendingImage(jpeg), target())
        _same(want, got)
        dropped += 4 - len(got[1]["labels"])
    assert dropped  # some seeds cropped boxes away, and SanitizeBoundingBoxes dropped them as v2 did


def test_batch_equals_one_by_one_and_random_steps_after_keep_their_order() -> None:
    samples = [_sample(120 + 9 * k, 100 - 5 * k, k) for k in range(5)]
    for tf, batches in (
        (v2.Compose([v2.RandomResizedCrop(24), v2.RandomHorizontalFlip(), v2.ToImage()]), True),
        (v2.Compose([v2.RandomResizedCrop(24), v2.RandomHorizontalFlip(), v2.RandomPhotometricDistort(p=1)]), False),
    ):
        plan = JointPlan(tf, decoder=_decoder(), threads=2)
        assert plan.batches is batches
        torch.manual_seed(11)
        want = [tf(*_oracle_inputs(j, p)) for j, p in samples]
        torch.manual_seed(11)
        got = plan.batch([(PendingImage(j), _oracle_inputs(j, p)[1]) for j, p in samples])
        _same(want, got)


def test_pipelines_it_does_not_fuse_are_applied_as_given() -> None:
    jpeg, png = _sample(90, 70, 1)
    for tf in (
        v2.Compose([v2.RandomCrop(20), v2.RandomHorizontalFlip()]),
        v2.Compose([v2.RandomHorizontalFlip(), v2.RandomResizedCrop(20)]),
        None,
    ):
        plan = JointPlan(tf, decoder=_decoder())
        assert not plan.fused
        torch.manual_seed(2)
        want = _oracle_inputs(jpeg, png) if tf is None else tf(*_oracle_inputs(jpeg, png))
        torch.manual_seed(2)
        got = plan(PendingImage(jpeg), _oracle_inputs(jpeg, png)[1])
        _same(want, got)


def test_a_subclass_is_not_fused_and_a_changed_pipeline_is_stale() -> None:
    class Mine(v2.RandomResizedCrop):
        pass

    assert split_joint(v2.Compose([Mine(8)]))[0] is None
    tf = v2.Compose([v2.RandomResizedCrop(8), v2.RandomHorizontalFlip()])
    plan = JointPlan(tf, decoder=_decoder())
    assert not plan.stale(tf)
    tf.transforms[0].size = [16, 16]
    assert plan.stale(tf)


def test_image_and_mask_of_different_sizes_fail_as_in_v2() -> None:
    tf = v2.Compose([v2.RandomResizedCrop(8)])
    plan = JointPlan(tf, decoder=_decoder())
    jpeg, png = photo_jpeg(50, 40), _mask_png(51, 40)
    with pytest.raises(ValueError, match="multiple HxW"):
        plan(PendingImage(jpeg), _oracle_inputs(jpeg, png)[1])


def test_a_damaged_image_names_its_field() -> None:
    tf = v2.Compose([v2.RandomResizedCrop(8)])
    plan = JointPlan(tf, decoder=_decoder())
    jpeg = bytearray(photo_jpeg(60, 50))
    jpeg[400:900] = b"\x00" * 500
    del jpeg[-200:]
    with pytest.raises(ImageFieldError, match="record 3 field 'image'"):
        for seed in range(4):
            torch.manual_seed(seed)
            plan(PendingImage(bytes(jpeg), where="record 3 field 'image'"), tv_tensors.Mask(torch.zeros(50, 60)))


# -- pairs: BasicSR's paired_random_crop + augment --------------------------------------------------------
def _basicsr_oracle(lq_bgr: np.ndarray, gt_bgr: np.ndarray, gt_size: int, scale: int, hflip: bool, rot: bool):
    """BasicSR's PairedImageDataset training geometry, written from its documented
    behaviour (basicsr/data/transforms.py): float32 [0, 1] BGR images, the LQ patch at
    random.randint places, the GT patch at scale times them, then random() < 0.5 per
    enabled flag: cv2.flip(1), cv2.flip(0), transpose."""
    import cv2

    gt, lq = gt_bgr.astype(np.float32) / 255.0, lq_bgr.astype(np.float32) / 255.0
    p = gt_size // scale
    top = random.randint(0, lq.shape[0] - p)
    left = random.randint(0, lq.shape[1] - p)
    lq = lq[top : top + p, left : left + p]
    gt = gt[top * scale : top * scale + gt_size, left * scale : left * scale + gt_size]
    do_h = hflip and random.random() < 0.5
    do_v = rot and random.random() < 0.5
    do_r = rot and random.random() < 0.5
    out = []
    for img in (gt, lq):
        if do_h:
            img = cv2.flip(img, 1)
        if do_v:
            img = cv2.flip(img, 0)
        if do_r:
            img = img.transpose(1, 0, 2)
        out.append(img)
    return out[1], out[0]  # lq, gt


def _pair(w: int, h: int, scale: int, seed: int, kind: str = "PNG") -> tuple[bytes, bytes]:
    gt = Image.open(io.BytesIO(photo_jpeg(w * scale, h * scale, seed=seed))).convert("RGB")
    lq = gt.resize((w, h), Image.Resampling.BICUBIC)
    blobs = []
    for img in (lq, gt):
        out = io.BytesIO()
        img.save(out, kind, **({"quality": 92} if kind == "JPEG" else {}))
        blobs.append(out.getvalue())
    return blobs[0], blobs[1]


@pytest.mark.parametrize("hflip,rot", [(True, True), (True, False), (False, True), (False, False)])
def test_pairs_equal_basicsr_under_the_same_seed(hflip: bool, rot: bool) -> None:
    cv2 = pytest.importorskip("cv2")
    tf = PairedRandomCrop(gt_size=32, scale=4, hflip=hflip, rotation=rot, output="tensor")
    plan = PairPlan(tf, decoder=_decoder())
    assert plan.fused
    for seed in range(6):
        lq_png, gt_png = _pair(23 + seed, 17 + 2 * seed, 4, seed)
        decoded = [cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR) for b in (lq_png, gt_png)]
        random.seed(seed)
        want_lq, want_gt = _basicsr_oracle(decoded[0], decoded[1], 32, 4, hflip, rot)
        after = random.random()
        random.seed(seed)
        got_lq, got_gt = plan(PendingImage(lq_png), PendingImage(gt_png))
        assert random.random() == after  # the same count of Python random numbers
        for got, want in ((got_lq, want_lq), (got_gt, want_gt)):
            rgb = got.numpy().transpose(1, 2, 0)[:, :, ::-1]  # BasicSR keeps BGR until img2tensor
            assert np.array_equal(rgb.astype(np.float32) / 255.0, want)
        random.seed(seed)
        unfused = tf(*(Image.open(io.BytesIO(b)).convert("RGB") for b in (lq_png, gt_png)))
        assert all(torch.equal(a, b) for a, b in zip(unfused, (got_lq, got_gt)))


def test_jpeg_pairs_decoded_by_region_equal_the_whole_decode() -> None:
    tf = v2.Compose([PairedRandomCrop(gt_size=24, scale=3), v2.ToImage()])
    caps = current()
    plan = plan_fields(tf, decoder=caps.decoder(caps.auto_decoder()))
    assert isinstance(plan, PairPlan) and plan.fused
    for seed in range(6):
        lq, gt = _pair(40, 31, 3, seed, "JPEG")
        random.seed(seed)
        want = tf(*(Image.open(io.BytesIO(b)).convert("RGB") for b in (lq, gt)))
        random.seed(seed)
        got = plan(PendingImage(lq), PendingImage(gt))
        _same(want, got)


def test_pairs_of_the_wrong_scale_or_too_small_name_the_pair() -> None:
    plan = PairPlan(PairedRandomCrop(gt_size=16, scale=2), decoder=_decoder())
    lq, _ = _pair(20, 20, 2, 0)
    _, gt3 = _pair(20, 20, 3, 0)
    with pytest.raises(ValueError, match="record 9.*not 2 times"):
        plan(PendingImage(lq, "record 9 field 'lq'"), PendingImage(gt3, "record 9 field 'gt'"))
    small_lq, small_gt = _pair(5, 9, 2, 0)
    with pytest.raises(ValueError, match="smaller than the 8x8 patch"):
        plan(PendingImage(small_lq, "record 1"), PendingImage(small_gt))


def test_draw_pair_draws_what_basicsr_draws() -> None:
    rng = random.Random(5)
    twin = random.Random(5)
    d = draw_pair((30, 20), (60, 40), 16, 2, rng=rng)
    assert d == PairDraw(
        twin.randint(0, 12), twin.randint(0, 22), 8, 2, twin.random() < 0.5, twin.random() < 0.5, twin.random() < 0.5
    )
    assert d.gt_box() == (2 * d.top, 2 * d.left, 16, 16)
    patch = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    turned = augment_patch(patch, PairDraw(0, 0, 2, 1, True, True, True))
    assert turned.shape == (3, 2, 3) and turned.flags.c_contiguous
    assert np.array_equal(turned, patch[::-1, ::-1].transpose(1, 0, 2))


@pytest.mark.parametrize("mode", ["L", "P", "RGBA"])
def test_pairs_of_other_modes_equal_the_unfused_transform(mode: str) -> None:
    tf = PairedRandomCrop(gt_size=16, scale=2)
    plan = PairPlan(tf, decoder=_decoder())
    blobs = []
    for img in (Image.open(io.BytesIO(b)) for b in _pair(21, 13, 2, 4)):
        out = io.BytesIO()
        img.convert(mode).save(out, "PNG")
        blobs.append(out.getvalue())
    for seed in range(4):
        random.seed(seed)
        want = tf(*(Image.open(io.BytesIO(b)).convert("RGB") for b in blobs))
        random.seed(seed)
        _same(want, plan(PendingImage(blobs[0]), PendingImage(blobs[1])))


# -- through LMDBDataset: packs of a VOC tree and of pairs ----------------------------------------------
def _voc_pack(tmp_path: Path, *, deep: bool = True) -> tuple[Path, Path]:
    from torchvision.datasets import VOCSegmentation

    import lmdbfolder
    from conftest import VOC_SAMPLES, make_voc

    samples = VOC_SAMPLES + [("big_3", "RGB", (90, 70), "P"), ("tall_4", "RGB", (41, 95), "L")]
    if not deep:  # torch cannot send a uint16 tensor from a worker (its storage does not unpickle)
        samples = [s for s in samples if s[3] != "I;16"]
    root = make_voc(tmp_path / "voc", samples)
    dst = tmp_path / "voc.lmdb"
    lmdbfolder.pack_dataset(VOCSegmentation(str(root), year="2012", image_set="train"), dst)
    return root, dst


def _voc_oracle(root: Path, tf: object) -> object:
    from torchvision.datasets import VOCSegmentation, wrap_dataset_for_transforms_v2

    return wrap_dataset_for_transforms_v2(VOCSegmentation(str(root), year="2012", image_set="train", transforms=tf))


def _tf() -> v2.Compose:
    return v2.Compose([v2.RandomResizedCrop((20, 24)), v2.RandomHorizontalFlip(), v2.ToImage()])


def test_lmdbdataset_fuses_the_crop_and_equals_vocsegmentation(tmp_path: Path) -> None:
    from lmdbfolder.torch import LMDBDataset

    root, dst = _voc_pack(tmp_path)
    tf = _tf()
    ds, oracle = LMDBDataset(dst, transforms=tf), _voc_oracle(root, tf)
    assert ds._fused is not None and ds._fused.get(tf).fused
    for i in range(len(ds)):
        for seed in (0, 1):
            torch.manual_seed(seed)
            want = oracle[i]
            torch.manual_seed(seed)
            _same(want, ds[i])
    tf.transforms[0].size = [12, 12]  # changed in place between epochs: the plan follows
    torch.manual_seed(3)
    want = oracle[0]
    torch.manual_seed(3)
    _same(want, ds[0])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_lmdbdataset_fused_in_dataloader_workers(tmp_path: Path, context: str) -> None:
    from lmdbfolder.torch import LMDBDataset

    root, dst = _voc_pack(tmp_path, deep=False)
    tf = _tf()
    if context == "spawn":
        import pickle

        try:
            pickle.dumps(LMDBDataset(dst, transforms=tf))
        except (AttributeError, TypeError, pickle.PicklingError) as exc:
            pytest.skip(f"LMDBDataset cannot be sent to a spawned worker here: {exc}")
    got_all, want_all = [], []
    for ds, out in ((LMDBDataset(dst, transforms=tf), got_all), (_voc_oracle(root, tf), want_all)):
        loader = torch.utils.data.DataLoader(
            ds,
            batch_size=2,
            num_workers=2 if context == "fork" else 1,  # a spawned worker imports torch: one is enough
            multiprocessing_context=context,
            generator=torch.Generator().manual_seed(7),
            collate_fn=list,
        )
        for batch in loader:
            out.extend(batch)
    assert len(got_all) == 5
    _same(want_all, got_all)


def test_lmdbdataset_fuses_pairs_as_basicsr(tmp_path: Path) -> None:
    from lmdbfolder.format import NO_LABEL
    from lmdbfolder.torch import LMDBDataset
    from lmdbfolder.write.fields import FieldSamples, FieldSpec, pack_field_samples

    pairs = [_pair(20 + k, 16 + k, 2, k, "JPEG" if k % 2 else "PNG") for k in range(3)]
    samples = FieldSamples(
        layout="pairs",
        root=str(tmp_path),
        fields=(FieldSpec("lq", "image"), FieldSpec("gt", "image")),
        relpaths=[f"lq/{k}.png" for k in range(3)],
        field_paths=[(f"lq/{k}.png", f"gt/{k}.png") for k in range(3)],
        labels=[NO_LABEL] * 3,
        classes=[],
        read=lambda i: list(pairs[i]),
        layout_info={"scale": 2},
    )
    dst = tmp_path / "pairs.lmdb"
    pack_field_samples(samples, dst)
    tf = v2.Compose([PairedRandomCrop(gt_size=16, scale=2, output="tensor"), v2.ToDtype(torch.float32, scale=True)])
    ds = LMDBDataset(dst, transforms=tf)
    assert ds._fused is not None and ds._fused.get(tf).fused
    for i in range(3):
        random.seed(i)
        want = tf(*(Image.open(io.BytesIO(b)).convert("RGB") for b in pairs[i]))
        random.seed(i)
        got = ds[i]
        _same(want, got)
        # GT too: both patches are images to v2 (a plain second tensor would pass through)
        assert [t.dtype for t in got] == [torch.float32, torch.float32]


def test_lmdbdataset_reports_a_damaged_image_by_its_record(tmp_path: Path) -> None:
    from lmdbfolder.errors import CorruptRecordError
    from lmdbfolder.torch import LMDBDataset

    root, _ = _voc_pack(tmp_path)
    from conftest import VOC_SAMPLES

    path = root / "VOCdevkit" / "VOC2012" / "JPEGImages" / f"{VOC_SAMPLES[0][0]}.jpg"
    data = bytearray(path.read_bytes())
    data[300:] = b"\x00" * (len(data) - 302) + b"\xff\xd9"  # scan data gone, the end marker kept
    path.write_bytes(bytes(data))
    from torchvision.datasets import VOCSegmentation

    import lmdbfolder

    dst = tmp_path / "damaged.lmdb"
    lmdbfolder.pack_dataset(VOCSegmentation(str(root), year="2012", image_set="train"), dst, strict=False)
    ds = LMDBDataset(dst, transforms=_tf())
    with pytest.raises(CorruptRecordError, match="field 'image' cannot be read"):
        for i in range(len(ds)):
            ds[i]


def test_lmdbdataset_batches_equal_samples_one_by_one(tmp_path: Path) -> None:
    from lmdbfolder.torch import LMDBDataset

    root, dst = _voc_pack(tmp_path)
    for tf, batches in ((_tf(), True), (v2.Compose([v2.RandomResizedCrop(16), v2.RandomPhotometricDistort()]), False)):
        ds = LMDBDataset(dst, transforms=tf)
        assert ds._fused.get(tf).batches is batches
        torch.manual_seed(4)
        want = [_voc_oracle(root, tf)[i] for i in (5, 0, 3, 3)]
        torch.manual_seed(4)
        _same(want, ds.__getitems__([5, 0, 3, 3]))


def test_lmdbdataset_fused_shared_by_threads(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from lmdbfolder.torch import LMDBDataset

    root, dst = _voc_pack(tmp_path)
    tf = _drawless()
    ds, oracle = LMDBDataset(dst, transforms=tf), _voc_oracle(root, tf)
    assert ds._fused is not None and ds._fused.get(tf).fused
    order = [i % len(ds) for i in range(24)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ds.__getitem__, order))
    _same([oracle[i] for i in order], got)


def test_lmdbdataset_batches_in_threads_at_once(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from lmdbfolder.torch import LMDBDataset

    root, dst = _voc_pack(tmp_path)
    tf = _drawless()
    ds, oracle = LMDBDataset(dst, transforms=tf), _voc_oracle(root, tf)
    assert ds._fused.get(tf).batches and not ds._fused.get(tf).to_image
    # Each thread decodes a batch into its own buffer before making its PIL images.
    n = len(ds)
    chunks = [[(k + j) % n for j in range(5)] for k in range(n)] * 4
    with ThreadPoolExecutor(4) as pool:
        batches = list(pool.map(ds.__getitems__, chunks))
    _same([[oracle[i] for i in chunk] for chunk in chunks], batches)


def _drawless() -> v2.Compose:
    """A crop and flip whose outcome does not depend on the numbers drawn (threads share torch's
    generator, so which thread draws which is not known): no box of an aspect ratio in [5, 6]
    and the whole area fits an image wider than tall by less than 5, so each sample gets v2's
    fallback, the central crop of ratio 5; always flipped. (At ratios that hold the image's own,
    a box one pixel narrower than the image fits too, at a random place.)"""
    return v2.Compose(
        [v2.RandomResizedCrop((20, 24), scale=(1.0, 1.0), ratio=(5.0, 6.0)), v2.RandomHorizontalFlip(p=1.0)]
    )


def test_to_image_after_the_crop_gives_v2s_tensors_without_pil_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmdbfolder.torch import LMDBDataset

    root, dst = _voc_pack(tmp_path)
    made: list[object] = []
    fromarray = Image.fromarray
    # PIL images of a crop's size: what the crops would be made into without the fusion.
    monkeypatch.setattr(
        Image, "fromarray", lambda *a, **k: made.append(a[0].shape[:2] == (20, 24)) or fromarray(*a, **k)
    )
    to_float = v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True)
    fused = v2.Compose([v2.RandomResizedCrop((20, 24)), v2.RandomHorizontalFlip(), v2.ToImage(), to_float])
    later = v2.Compose([v2.RandomResizedCrop((20, 24)), v2.RandomHorizontalFlip(), v2.Grayscale(3), v2.ToImage()])
    for tf, direct in ((fused, True), (later, False), (_tf(), True)):
        ds, oracle = LMDBDataset(dst, transforms=tf), _voc_oracle(root, tf)
        assert ds._fused.get(tf).to_image is direct
        torch.manual_seed(7)
        want = [oracle[i] for i in range(len(ds))]
        made.clear()
        torch.manual_seed(7)
        got = [ds[i] for i in range(len(ds))]
        torch.manual_seed(7)
        got_batch = ds.__getitems__(list(range(len(ds))))
        # JPEG crops become tensors directly; only PNG images (none here) go through PIL.
        assert (sum(made) == 0) is direct
        _same(want, got)
        _same(want, got_batch)


def test_to_image_runs_only_where_it_converts_something(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the fused crop, a ``ToImage`` that would convert nothing (JPEG crops made as its
    tensors, masks) is not run; it runs where a field is a PIL image (a PNG image's crop) and
    where a hook waits on it. The samples are v2's either way."""
    from lmdbfolder.torch import LMDBDataset

    calls: list[int] = []
    forward = v2.ToImage.forward
    monkeypatch.setattr(v2.ToImage, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    tf = _tf()
    root, dst = _voc_pack(tmp_path)
    ds, oracle = LMDBDataset(dst, transforms=tf), _voc_oracle(root, tf)
    torch.manual_seed(3)
    want = [oracle[i] for i in range(len(ds))]
    calls.clear()
    torch.manual_seed(3)
    _same(want, [ds[i] for i in range(len(ds))])
    torch.manual_seed(3)
    _same(want, ds.__getitems__(list(range(len(ds)))))
    assert calls == []

    jpeg, mask = _sample(61, 47, 5)
    png = io.BytesIO()
    Image.open(io.BytesIO(jpeg)).save(png, "PNG")
    plan = JointPlan(tf, decoder=_decoder())
    torch.manual_seed(4)
    inputs = _oracle_inputs(png.getvalue(), mask)
    want_png = tf(*inputs)
    calls.clear()
    torch.manual_seed(4)
    _same(want_png, plan(PendingImage(png.getvalue()), inputs[1]))
    assert calls == [1]

    hooked: list[int] = []
    handle = tf.transforms[2].register_forward_hook(lambda *_: hooked.append(1))
    try:
        torch.manual_seed(3)
        _same(want[:2], [ds[0], ds[1]])
    finally:
        handle.remove()
    assert hooked == [1, 1]


def test_nearest_indices_are_torchs() -> None:
    from lmdbfolder.torch.joint import nearest_indices

    for size in (1, 2, 3, 7, 16, 97, 224, 375, 500):
        for out in (1, 2, 5, 16, 24, 97, 224, 225, 448, 512, 1000):
            src = torch.arange(size, dtype=torch.float32).reshape(1, 1, 1, size)
            want = torch.nn.functional.interpolate(src, size=(1, out), mode="nearest").flatten().to(torch.int64)
            assert np.array_equal(nearest_indices(size, out), want.numpy()), (size, out)


@pytest.mark.parametrize("mode,fmt", [("P", "PNG"), ("L", "PNG"), ("1", "PNG"), ("I;16", "PNG"), ("I", "TIFF")])
def test_a_pending_mask_crops_as_v2(mode: str, fmt: str) -> None:
    from lmdbfolder.torch.joint import PendingMask

    rng = np.random.default_rng(1)
    values = rng.integers(0, 40000 if mode.startswith("I") else 256, (37, 53)).astype(np.int32)
    img = Image.fromarray(values.astype(np.uint16)).convert(mode) if mode != "I" else Image.fromarray(values, "I")
    if mode in ("P", "L", "1"):
        img = Image.fromarray((values % 256).astype(np.uint8), "L").convert(mode)
    out = io.BytesIO()
    img.save(out, fmt)
    data = out.getvalue()
    whole = PendingMask(data).decode()
    assert torch.equal(whole, tv_tensors.Mask(Image.open(io.BytesIO(data))))
    for box, size, flip in [
        ((3, 5, 20, 30), [16, 24], False),
        ((0, 0, 37, 53), [37, 53], True),
        ((9, 1, 7, 9), [50, 40], True),
    ]:
        want = v2.functional.resized_crop(whole, *box, size=size)
        want = v2.functional.horizontal_flip(want) if flip else want
        got = PendingMask(data).crop(box, size, flip)
        assert type(got) is tv_tensors.Mask and got.dtype == want.dtype and torch.equal(got, want)


def test_open_rows_decodes_a_png_down_to_the_rows_asked_and_nothing_else_differs() -> None:
    from lmdbfolder.read.pairs import open_rows, rows_match_pillow

    assert rows_match_pillow()  # this Pillow reads PNG rows that way (else open_rows decodes whole)
    img = Image.fromarray(np.random.default_rng(2).integers(0, 256, (90, 70, 3), dtype=np.uint8))
    for kind, extra in (("PNG", {}), ("JPEG", {}), ("WEBP", {"lossless": True})):
        out = io.BytesIO()
        img.save(out, kind, **extra)
        whole = np.asarray(Image.open(io.BytesIO(out.getvalue())))
        part = open_rows(out.getvalue(), 31)
        assert part.size == ((70, 31) if kind == "PNG" else (70, 90))
        assert np.array_equal(np.asarray(part), whole[: part.height])


def test_open_rows_decodes_whole_where_pillow_was_not_found_to_match(capabilities) -> None:
    from lmdbfolder.read.pairs import open_rows

    caps = capabilities(**{"pillow.png_rows": False})
    out = io.BytesIO()
    Image.fromarray(np.zeros((40, 30), np.uint8)).save(out, "PNG")
    assert open_rows(out.getvalue(), 10, caps).size == (30, 40)


@pytest.mark.parametrize("mode", ["RGB", "L", "P", "RGBA"])
@pytest.mark.parametrize("interpolation", [v2.InterpolationMode.BILINEAR, v2.InterpolationMode.BICUBIC])
def test_png_images_decoded_down_to_the_box_equal_v2(mode: str, interpolation: v2.InterpolationMode) -> None:
    tf = v2.Compose([v2.RandomResizedCrop((30, 26), interpolation=interpolation), v2.RandomHorizontalFlip()])
    plan = JointPlan(tf, decoder=_decoder())
    for seed in range(4):
        rgb = Image.open(io.BytesIO(photo_jpeg(71 + seed, 53, seed=seed))).convert(mode)
        out = io.BytesIO()
        rgb.save(out, "PNG")
        png = out.getvalue()
        mask = _mask_png(71 + seed, 53, seed)
        torch.manual_seed(seed)
        want = tf(Image.open(io.BytesIO(png)).convert("RGB"), tv_tensors.Mask(Image.open(io.BytesIO(mask))))
        torch.manual_seed(seed)
        got = plan(PendingImage(png), PendingMask(mask))
        _same(want, got)


def test_lmdbdataset_fused_with_a_replay_seed(tmp_path: Path) -> None:
    from lmdbfolder.torch import LMDBDataset
    from lmdbfolder.torch.replay import stream

    root, dst = _voc_pack(tmp_path)
    tf = _tf()
    ds, oracle = LMDBDataset(dst, transforms=tf, seed=3), _voc_oracle(root, tf)
    for i in range(len(ds)):
        with stream(ds.replay.sample_seed(i)):  # type: ignore[union-attr]
            want = oracle[i]
        _same(want, ds[i])
        _same(want, ds.__getitems__([i])[0])


# -- png_rows: a PNG's rows inflated and unfiltered without Pillow's full-width copy --------------------
def _compiled() -> object:
    return current().compiled()


def _png_with_filters(pixels: np.ndarray, color: int, filters: list[int]) -> bytes:
    from lmdbfolder.read.pairs import _png_bytes

    return _png_bytes(pixels, color, filters, bytes(range(256)) * 3 if color == 3 else b"")


def test_png_rows_equal_pillows_samples_for_every_filter_and_colour_type() -> None:
    from lmdbfolder.read.pairs import png_rows, png_rows_match_pillow

    if not hasattr(_compiled(), "png_unfilter_stream"):
        pytest.skip("the compiled module here predates png_unfilter_stream")
    assert png_rows_match_pillow()
    rng = np.random.default_rng(11)
    pixels = rng.integers(0, 256, (37, 41, 4), dtype=np.uint8)
    for color, samples, mode in ((0, 1, "L"), (2, 3, "RGB"), (3, 1, "P"), (4, 2, "LA"), (6, 4, "RGBA")):
        for filters in ([0], [1], [2], [3], [4], [4, 0, 3, 1, 2]):
            data = _png_with_filters(pixels[:, :, :samples], color, filters)
            whole = np.asarray(Image.open(io.BytesIO(data))).reshape(37, 41, samples)
            for rows in (1, 20, 0):
                got = png_rows(data, rows)
                assert got is not None and got[1] == mode
                assert np.array_equal(got[0], whole[: rows or 37])
    # What Pillow writes, photo-like, in several image data chunks.
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (300, 260, 3), dtype=np.uint8)).save(out, "PNG")
    got = png_rows(out.getvalue(), 123)
    assert got is not None and np.array_equal(got[0], np.asarray(Image.open(out))[:123])


def test_png_rows_leaves_to_pillow_what_it_does_not_decode(capabilities) -> None:
    from lmdbfolder.read.pairs import pillow_patch, png_rows

    if not hasattr(_compiled(), "png_unfilter_stream"):
        pytest.skip("the compiled module here predates png_unfilter_stream")
    img = np.random.default_rng(4).integers(0, 256, (30, 20, 3), dtype=np.uint8)
    for save in (
        lambda out: Image.fromarray(img[:, :, 0].astype(np.uint16) * 200).save(out, "PNG"),  # 16-bit
        lambda out: Image.fromarray(img).save(out, "JPEG"),
        lambda out: Image.fromarray(img).convert("1").save(out, "PNG"),  # 1-bit
    ):
        out = io.BytesIO()
        save(out)
        assert png_rows(out.getvalue(), 10) is None
    # A filter type PNG does not have (7, on the first row): left to Pillow, which raises for it.
    import zlib

    good = _png_with_filters(img, 2, [1])
    assert png_rows(good, 5) is not None
    raw = b"\x07" + img[0].tobytes() + b"".join(b"\x00" + img[y].tobytes() for y in range(1, 30))
    body = zlib.compress(raw)
    head = good[:33]  # the signature and IHDR
    idat = len(body).to_bytes(4, "big") + b"IDAT" + body + zlib.crc32(b"IDAT" + body).to_bytes(4, "big")
    iend = (0).to_bytes(4, "big") + b"IEND" + zlib.crc32(b"IEND").to_bytes(4, "big")
    assert png_rows(head + idat + iend, 5) is None
    with pytest.raises(OSError, match="unrecognized data stream"):
        pillow_patch(head + idat + iend, (0, 0, 5, 5), 20, 30, "a bad PNG")
    # Where this process was not found to match Pillow (or has no png_unfilter_stream): Pillow decodes.
    caps = capabilities(**{"png.rows": False})
    assert png_rows(good, 5, caps) is None


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_pillow_patch_of_a_png_equals_pillows_converted_crop(mode: str) -> None:
    from lmdbfolder.read.pairs import pillow_patch

    img = Image.open(io.BytesIO(photo_jpeg(67, 45, seed=2))).convert(mode)
    out = io.BytesIO()
    img.save(out, "PNG")
    for box in ((0, 0, 45, 67), (7, 9, 20, 30), (30, 50, 15, 17)):
        top, left, rows, cols = box
        want = np.asarray(img.crop((left, top, left + cols, top + rows)).convert("RGB"))
        got = pillow_patch(out.getvalue(), box, 67, 45, "a PNG")
        assert got.dtype == np.uint8 and got.flags.c_contiguous and np.array_equal(got, want)


# -- the opt-in: lmdbfolder.fused.RandomResizedCrop as the joint crop ---------------------------------------
def _wrapped(jpeg: bytes, png: bytes) -> tuple[Image.Image, tv_tensors.Mask]:
    # What VOCSegmentation wrapped for v2 gives (its mask as tv_tensors.Mask of the PIL image: 1 x H x W).
    return Image.open(io.BytesIO(jpeg)).convert("RGB"), tv_tensors.Mask(Image.open(io.BytesIO(png)))


def _boxes_sample(w: int, h: int, seed: int) -> tuple[bytes, bytes, tv_tensors.BoundingBoxes]:
    jpeg, png = _sample(w, h, seed)
    boxes = tv_tensors.BoundingBoxes(
        [[3, 4, w // 2, h // 2], [w // 3, h // 4, w - 2, h - 3]], format="XYXY", canvas_size=(h, w)
    )
    return jpeg, png, boxes


def test_fused_crop_with_pillows_resize_equals_v2() -> None:
    from lmdbfolder import fused

    crop = fused.RandomResizedCrop((40, 56), resize="pil", reduce=False)
    tf = v2.Compose([crop, v2.RandomHorizontalFlip(), v2.ToImage()])
    oracle = v2.Compose([v2.RandomResizedCrop((40, 56)), v2.RandomHorizontalFlip(), v2.ToImage()])
    plan = JointPlan(tf, decoder=current().decoder(current().auto_decoder()))
    assert plan.fused and not plan.tensors and split_joint(tf)[0] is crop
    for seed, (w, h) in enumerate([(161, 121), (97, 130), (64, 48)]):
        jpeg, png, boxes = _boxes_sample(w, h, seed)
        torch.manual_seed(seed)
        want = oracle(*_wrapped(jpeg, png), boxes)
        torch.manual_seed(seed)
        got = plan(PendingImage(jpeg), PendingMask(png), boxes)
        _same(want, got)


@pytest.mark.parametrize("output", ["pil", "tensor"])
def test_fused_crop_native_keeps_v2s_geometry_and_is_within_its_tolerance(output: str) -> None:
    from lmdbfolder import fused

    if current().native_resize() is None or current().region_decoder() is None:
        pytest.skip("the compiled helper is not built here")
    tf = v2.Compose([fused.RandomResizedCrop((48, 64), resize="native", output=output), v2.RandomHorizontalFlip()])
    oracle = v2.Compose([v2.RandomResizedCrop((48, 64)), v2.RandomHorizontalFlip()])
    plan = JointPlan(tf, decoder=current().decoder(current().auto_decoder()))
    assert plan.fused and plan.tensors == (output == "tensor") and plan.batches
    diffs = []
    samples = [_boxes_sample(w, h, seed) for seed, (w, h) in enumerate([(301, 227), (170, 260), (90, 70), (400, 310)])]
    for seed, (jpeg, png, boxes) in enumerate(samples * 2):
        torch.manual_seed(seed)
        want_image, want_mask, want_boxes = oracle(*_wrapped(jpeg, png), boxes)
        after_want = torch.rand(1)
        torch.manual_seed(seed)
        image, mask, got_boxes = plan(PendingImage(jpeg), PendingMask(png), boxes)
        assert torch.equal(torch.rand(1), after_want)  # the same random numbers drawn
        _same(want_mask, mask)  # masks and boxes: exactly v2's
        _same(want_boxes, got_boxes)
        if output == "tensor":
            assert type(image) is tv_tensors.Image and image.dtype == torch.uint8 and image.is_contiguous()
            pixels = image.permute(1, 2, 0).numpy()
        else:
            assert isinstance(image, Image.Image) and image.mode == "RGB"
            pixels = np.asarray(image)
        want = np.asarray(want_image)
        assert pixels.shape == want.shape
        diffs.append(np.abs(pixels.astype(int) - want.astype(int)).mean())
    # The documented tolerance (docs/fields-fast.md): about a grey level on average.
    assert max(diffs) <= 3.0, diffs
    # The batch path gives the sample path's results.
    torch.manual_seed(7)
    one = [plan(PendingImage(j), PendingMask(p), b) for j, p, b in samples]
    torch.manual_seed(7)
    many = plan.batch([(PendingImage(j), PendingMask(p), b) for j, p, b in samples])
    _same(one, many)


def test_lmdbdataset_fuses_the_opt_in_crop(tmp_path: Path) -> None:
    from lmdbfolder import fused
    from lmdbfolder.torch import LMDBDataset

    root, dst = _voc_pack(tmp_path)
    tf = v2.Compose(
        [fused.RandomResizedCrop((20, 24), resize="pil", reduce=False), v2.RandomHorizontalFlip(), v2.ToImage()]
    )
    ds, oracle = LMDBDataset(dst, transforms=tf), _voc_oracle(root, _tf())
    assert ds._fused is not None and ds._fused.get(tf).fused
    for i in range(len(ds)):
        torch.manual_seed(i)
        want = oracle[i]
        torch.manual_seed(i)
        _same(want, ds[i])


def test_png_unfilter_stream_resumes_at_any_byte() -> None:
    import zlib

    compiled = _compiled()
    if not hasattr(compiled, "png_unfilter_stream"):
        pytest.skip("the compiled module here predates png_unfilter_stream")
    pixels = np.random.default_rng(8).integers(0, 256, (9, 7, 3), dtype=np.uint8)
    data = _png_with_filters(pixels, 2, [0, 1, 2, 3, 4])
    raw = zlib.decompress(b"".join(data[i + 8 : i + 8 + int.from_bytes(data[i : i + 4], "big")] for i in _idats(data)))
    for piece in (1, 2, 5, 22, 64, len(raw)):
        out = np.zeros((9, 7, 3), np.uint8)
        at, row_filter = 0, -1
        while at < len(raw):
            chunk = raw[at : at + piece]
            row_filter = compiled.png_unfilter_stream(chunk, at, row_filter, 9, 21, 3, out)  # type: ignore[attr-defined]
            at += len(chunk)
        assert np.array_equal(out, pixels), piece
    # Rows past ``rows`` are ignored; a filter type PNG does not have is refused.
    out = np.zeros((4, 7, 3), np.uint8)
    compiled.png_unfilter_stream(raw, 0, -1, 4, 21, 3, out)  # type: ignore[attr-defined]
    assert np.array_equal(out, pixels[:4])
    with pytest.raises(ValueError, match="filter type"):
        compiled.png_unfilter_stream(b"\x05" + raw[1:], 0, -1, 4, 21, 3, out)  # type: ignore[attr-defined]


def _idats(data: bytes) -> list[int]:
    # The offsets of the IDAT chunks of a PNG.
    found, pos = [], 8
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        if data[pos + 4 : pos + 8] == b"IDAT":
            found.append(pos)
        pos += 12 + length
    return found


def test_box_probes_hold_when_another_thread_draws_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probes that confirm the fast box draws compare draws from torch's generator, which
    every thread shares. A draw by another thread in the middle of one (here: once, on the first
    box the probe draws) used to answer False, and the fast path stayed off in that process."""
    from lmdbfolder.torch import crop, joint

    draw_box = crop._draw_box
    disturbed: list[int] = []

    def draw_after_a_stranger(*args: Any, **kwargs: Any) -> Any:
        if not disturbed:
            disturbed.append(1)
            torch.rand(1)  # what another thread's sample would draw at this moment
        return draw_box(*args, **kwargs)

    for probe in (crop._fast_boxes_ok, crop._batch_boxes_ok, joint._v2_boxes_ok):
        assert probe()
        disturbed.clear()
        monkeypatch.setattr(crop, "_draw_box", draw_after_a_stranger)
        assert probe(), probe.__name__
        assert disturbed == [1]
        monkeypatch.setattr(crop, "_draw_box", draw_box)


_GATHER_CASES = """
import numpy as np
from lmdbfolder.read import _crops
from lmdbfolder.torch.joint import nearest_indices
rng = np.random.default_rng(3)
for t in range(400):
    H, W = int(rng.integers(1, 300)), int(rng.integers(1, 700))
    plane = rng.integers(0, 256, (H, W, 1), dtype=np.uint8)
    h, w = int(rng.integers(1, H + 1)), int(rng.integers(1, W + 1))
    top, left = int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1))
    oh, ow = int(rng.integers(1, 300)), int(rng.integers(1, 300))
    rows, cols, flip = nearest_indices(h, oh), nearest_indices(w, ow), bool(rng.integers(2))
    out = np.empty((1, oh, ow), np.uint8)
    _crops.gather(plane, W, rows, top, cols, left, flip, out)
    want = plane[:, :, 0].take(rows + top, 0).take((cols + left)[::-1] if flip else cols + left, 1)
    if not np.array_equal(out[0], want):
        print("differs", (H, W), (top, left, h, w), (oh, ow), flip)
        break
else:
    print(_crops.exact_simd(), "ok")
"""


@pytest.mark.parametrize("simd", ["all", "avx2"])
def test_the_compiled_mask_gather_is_two_takes(simd: str) -> None:
    """The masks' nearest resize in one compiled pass (AVX-512's two-register byte permutes
    where the CPU has them, else the plain loop) gives what numpy's two takes give, mirrored
    or not, over shrinks and stretches; an index outside the rows is a ValueError."""
    import os
    import subprocess
    import sys

    compiled = current().compiled()
    if compiled is None or not hasattr(compiled, "gather"):
        pytest.skip("the compiled module is not built here")
    env = {k: v for k, v in os.environ.items() if k != "LMDBFOLDER_NO_AVX512"}
    if simd == "avx2":
        env["LMDBFOLDER_NO_AVX512"] = "1"
    done = subprocess.run([sys.executable, "-c", _GATHER_CASES], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "ok", done.stdout
    with pytest.raises(ValueError, match="row index"):
        compiled.gather(bytes(20), 5, np.array([4], np.int64), 1, np.array([0], np.int64), 0, False, bytearray(1))
    with pytest.raises(ValueError, match="column index"):
        compiled.gather(bytes(20), 5, np.array([0], np.int64), 0, np.array([3], np.int64), 2, False, bytearray(1))
    # (top + index + 1) * stride and left + index would wrap around to small numbers: refused all the same.
    with pytest.raises(ValueError, match="row index"):
        compiled.gather(
            bytes(20), 4, np.array([2**62 - 2], np.int64), 1, np.array([0], np.int64), 0, False, bytearray(1)
        )
    with pytest.raises(ValueError, match="column index"):
        compiled.gather(
            bytes(20), 5, np.array([0], np.int64), 0, np.array([2**63 - 1], np.int64), 2, False, bytearray(1)
        )
