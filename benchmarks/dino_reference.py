"""facebookresearch/dino's ``DataAugmentationDINO``, as ``main_dino.py`` builds it (lines
419-464 at 7c446df) with ``utils.py``'s ``GaussianBlur`` and ``Solarization`` (lines 36-68),
rebuilt from torchvision transforms: the reference that ``bench_multicrop.py`` times and
tests/test_multicrop.py compares the ``MultiCrop.dino`` preset with, view for view."""

from __future__ import annotations

import random
from typing import Any

from PIL import Image, ImageFilter, ImageOps
from torchvision import transforms


class GaussianBlur:
    """dino/utils.py lines 36-54."""

    def __init__(self, p: float = 0.5, radius_min: float = 0.1, radius_max: float = 2.0) -> None:
        self.prob, self.radius_min, self.radius_max = p, radius_min, radius_max

    def __call__(self, img: Image.Image) -> Image.Image:
        if not random.random() <= self.prob:
            return img
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(self.radius_min, self.radius_max)))


class Solarization:
    """dino/utils.py lines 57-68."""

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, img: Image.Image) -> Image.Image:
        return ImageOps.solarize(img) if random.random() < self.p else img


class DataAugmentationDINO:
    """dino/main_dino.py lines 419-464."""

    def __init__(self, global_crops_scale: Any, local_crops_scale: Any, local_crops_number: int) -> None:
        flip_and_color_jitter = transforms.Compose(
            [
                transforms.RandomHorizontalFlip(p=0.5),
                transforms.RandomApply(
                    [transforms.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1)], p=0.8
                ),
                transforms.RandomGrayscale(p=0.2),
            ]
        )
        normalize = transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
        )
        bicubic = Image.BICUBIC
        self.global_transfo1 = transforms.Compose(
            [
                transforms.RandomResizedCrop(224, scale=global_crops_scale, interpolation=bicubic),
                flip_and_color_jitter,
                GaussianBlur(1.0),
                normalize,
            ]
        )
        self.global_transfo2 = transforms.Compose(
            [
                transforms.RandomResizedCrop(224, scale=global_crops_scale, interpolation=bicubic),
                flip_and_color_jitter,
                GaussianBlur(0.1),
                Solarization(0.2),
                normalize,
            ]
        )
        self.local_crops_number = local_crops_number
        self.local_transfo = transforms.Compose(
            [
                transforms.RandomResizedCrop(96, scale=local_crops_scale, interpolation=bicubic),
                flip_and_color_jitter,
                GaussianBlur(p=0.5),
                normalize,
            ]
        )

    def __call__(self, image: Image.Image) -> list[Any]:
        crops = [self.global_transfo1(image), self.global_transfo2(image)]
        for _ in range(self.local_crops_number):
            crops.append(self.local_transfo(image))
        return crops
