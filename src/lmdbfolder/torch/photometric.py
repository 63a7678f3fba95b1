"""Photometric operations on batches of uint8 images, as tensor operations that run on any device.

Each function takes a uint8 tensor ``N x 3 x H x W`` (RGB planes; on the CPU or on
CUDA) and one parameter per image, and returns a new uint8 tensor of the same
shape. Each reproduces the arithmetic of what torchvision does to a PIL image
(which is Pillow's C code), so on the same pixels and parameters the result is
the PIL path's, bit for bit (``tests/test_multicrop.py`` checks every one against
torchvision on photo-like images):

* ``brightness``, ``contrast``, ``saturation``: Pillow's ``ImageEnhance`` (``Image.blend``
  in float32, truncated, clipped; the contrast mean from the ``L`` histogram);
* ``hue``: torchvision's ``adjust_hue`` on a PIL image (Pillow's RGB -> HSV -> RGB,
  its float32/float64 steps and rounding reproduced, the hue byte shifted with wrap);
* ``grayscale``: Pillow's ``convert("L")`` (ITU-R 601-2 in 16-bit fixed point), three channels;
* ``gaussian_blur``: Pillow's ``ImageFilter.GaussianBlur(radius)``: three passes of its
  extended box blur each way (the box radius from the Gaussian's, 8.24 fixed-point
  weights, edges repeated), not a true Gaussian kernel;
* ``solarize``: Pillow's ``ImageOps.solarize`` (threshold 128 by default);
* ``normalize``: ``ToTensor`` then ``Normalize`` (the same float32 operations in the same order).

``color_jitter`` applies torchvision's ``ColorJitter`` (the order of the four
operations drawn per image, as its ``get_params`` draws it) to a batch whose images
each have their own order and factors: for each of the four slots, the images whose
operation in that slot is the same are processed together.

On the CPU the operations run in the compiled ``lmdbfolder.torch._photometric``
(one pass per pixel, without the GIL) where it is built and gives these values here
(``compiled()``: checked once per process against the tensor operations); the tensor
operations are the reference and the path on every other device (``compiled=False``
asks for them).

No operation here draws random numbers: the caller draws them (``lmdbfolder.torch.multicrop``).
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Sequence

import numpy as np

from lmdbfolder.errors import MissingDependencyError

try:
    import torch
except ImportError as exc:  # a core-only install: say what to install
    raise MissingDependencyError("lmdbfolder.fused.MultiCrop", "torch", "torch and torchvision") from exc

__all__ = [
    "brightness",
    "contrast",
    "saturation",
    "hue",
    "grayscale",
    "gaussian_blur",
    "box_blur_radius",
    "solarize",
    "normalize",
    "color_jitter",
    "compiled",
    "BRIGHTNESS",
    "CONTRAST",
    "SATURATION",
    "HUE",
]

#: The operation numbers of torchvision's ``ColorJitter.get_params`` (``fn_idx``).
BRIGHTNESS, CONTRAST, SATURATION, HUE = 0, 1, 2, 3


def _factors(values: Sequence[float] | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """One float32 factor per image, ``N x 1 x 1 x 1`` (Pillow takes the factor as a C float)."""
    t = torch.as_tensor(values, dtype=torch.float64).to(torch.float32).reshape(-1)
    if t.numel() == 1 and n != 1:
        t = t.expand(n)
    if t.numel() != n:
        raise ValueError(f"{t.numel()} factors for {n} images")
    return t.to(device).view(n, 1, 1, 1)


def _blend(x: torch.Tensor, base: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Pillow's ``Image.blend(base, x, alpha)``: ``base + alpha * (x - base)`` in float32,
    each product and sum rounded to float32 (two operations, never fused), truncated
    toward zero and clipped to 0..255."""
    b = base.to(torch.float32)
    t = x.to(torch.float32) - b  # exact: small integers
    t = t.mul_(alpha)
    t = t.add_(b)
    return t.trunc_().clamp_(0, 255).to(torch.uint8)


def _luma(x: torch.Tensor) -> torch.Tensor:
    """Pillow's ``convert("L")`` of RGB planes: ``N x 1 x H x W`` int32."""
    xi = x.to(torch.int32)
    y = xi[:, 0:1] * 19595 + xi[:, 1:2] * 38470 + xi[:, 2:3] * 7471 + 0x8000
    return torch.bitwise_right_shift(y, 16)


def brightness(x: torch.Tensor, factors: Sequence[float] | torch.Tensor, *, compiled: bool = True) -> torch.Tensor:
    """``adjust_brightness`` of each image by its factor (a blend with black)."""
    done = _in_c(x, compiled, "blend", 0, _c_floats(factors, len(x)))
    if done is not None:
        return done
    return _blend(x, torch.zeros((), dtype=torch.float32, device=x.device), _factors(factors, len(x), x.device))


def contrast(x: torch.Tensor, factors: Sequence[float] | torch.Tensor, *, compiled: bool = True) -> torch.Tensor:
    """``adjust_contrast`` of each image: a blend with the grey of its mean luma
    (Pillow's ``int(mean + 0.5)`` of the ``L`` image)."""
    done = _in_c(x, compiled, "blend", 1, _c_floats(factors, len(x)))
    if done is not None:
        return done
    n = len(x)
    luma = _luma(x)
    total = luma.sum(dim=(1, 2, 3), dtype=torch.int64).to(torch.float64)
    mean = torch.floor(total / float(luma.shape[2] * luma.shape[3]) + 0.5)
    return _blend(x, mean.view(n, 1, 1, 1), _factors(factors, n, x.device))


def saturation(x: torch.Tensor, factors: Sequence[float] | torch.Tensor, *, compiled: bool = True) -> torch.Tensor:
    """``adjust_saturation`` of each image: a blend with its own grey (``L``) image."""
    done = _in_c(x, compiled, "blend", 2, _c_floats(factors, len(x)))
    if done is not None:
        return done
    return _blend(x, _luma(x), _factors(factors, len(x), x.device))


def grayscale(
    x: torch.Tensor, chosen: Sequence[bool] | None = None, *, compiled: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``rgb_to_grayscale(img, 3)`` of a PIL image: Pillow's ``L`` in all three channels
    (of the images ``chosen``, default all; ``inplace``: in ``x`` itself where it can)."""
    flags = _chosen(chosen, len(x))
    module = _target(x, compiled)
    if module is not None:
        out = _owned(x, inplace)
        _c_blend(module, out, 3, np.where(flags, 0.0, np.nan))
        return out
    return _subset(x, flags, lambda part: _luma(part).to(torch.uint8).expand(-1, 3, -1, -1).contiguous())


def solarize(
    x: torch.Tensor,
    threshold: int = 128,
    chosen: Sequence[bool] | None = None,
    *,
    compiled: bool = True,
    inplace: bool = False,
) -> torch.Tensor:
    """``ImageOps.solarize``: every value at or above ``threshold`` inverted (in the images
    ``chosen``, default all)."""
    flags = _chosen(chosen, len(x))
    module = _target(x, compiled) if threshold == 128 else None
    if module is not None:
        out = _owned(x, inplace)
        _c_blend(module, out, 4, np.where(flags, 0.0, np.nan))
        return out
    return _subset(x, flags, lambda part: torch.where(part >= threshold, 255 - part, part))


def _chosen(chosen: Sequence[bool] | None, n: int) -> np.ndarray:
    flags = np.ones(n, bool) if chosen is None else np.asarray(chosen, bool).reshape(-1)
    if flags.size != n:
        raise ValueError(f"{flags.size} choices for {n} images")
    return flags


def _subset(x: torch.Tensor, flags: np.ndarray, fn: Any) -> torch.Tensor:
    """``fn`` applied to the images of ``x`` whose flag is set (the tensor operations' path)."""
    members = np.flatnonzero(flags).tolist()
    if not members:
        return x
    if len(members) == len(x):
        return fn(x)
    idx = torch.tensor(members, device=x.device)
    out = x.clone()
    out.index_copy_(0, idx, fn(x.index_select(0, idx)))
    return out


def _round_half_away(t: torch.Tensor) -> torch.Tensor:
    """C's ``round`` of non-negative values (half away from zero; torch rounds half to even)."""
    whole = torch.trunc(t)
    return whole + ((t - whole) >= 0.5).to(t.dtype)


def hue(x: torch.Tensor, factors: Sequence[float] | torch.Tensor, *, compiled: bool = True) -> torch.Tensor:
    """torchvision's ``adjust_hue`` of a PIL image, for each image and its factor
    (-0.5..0.5): Pillow's RGB -> HSV, the hue byte plus ``int(factor * 255)`` with
    wrap-around, HSV -> RGB, each step with Pillow's float32/float64 arithmetic."""
    n = len(x)
    values = torch.as_tensor(factors, dtype=torch.float64).reshape(-1)
    if values.numel() == 1 and n != 1:
        values = values.expand(n)
    # np.int32(factor * 255).astype(np.uint8): truncation toward zero, then modulo 256
    shifts = [int(float(f) * 255) % 256 for f in values.tolist()]
    done = _in_c(x, compiled, "hue", np.asarray(shifts, np.int32).tobytes())
    if done is not None:
        return done
    shift = torch.tensor(shifts, dtype=torch.int32, device=x.device).view(n, 1, 1)
    f32, f64 = torch.float32, torch.float64
    xi = x.to(torch.int32)
    r, g, b = xi[:, 0], xi[:, 1], xi[:, 2]
    maxc = torch.maximum(torch.maximum(r, g), b)
    minc = torch.minimum(torch.minimum(r, g), b)
    grey = maxc == minc
    cr = (maxc - minc).to(f32)
    safe_cr = torch.where(grey, torch.ones_like(cr), cr)
    s = cr / maxc.to(f32).clamp_(min=1)
    rc = (maxc - r).to(f32) / safe_cr
    gc = (maxc - g).to(f32) / safe_cr
    bc = (maxc - b).to(f32) / safe_cr
    # h is a C float: "2.0 + rc - bc" is evaluated in double, then stored as float
    h_g = (2.0 + rc.to(f64) - bc.to(f64)).to(f32)
    h_b = (4.0 + gc.to(f64) - rc.to(f64)).to(f32)
    h = torch.where(r == maxc, bc - gc, torch.where(g == maxc, h_g, h_b))
    h = torch.fmod(h.to(f64) / 6.0 + 1.0, 1.0).to(f32)
    uh = torch.trunc(h.to(f64) * 255.0).to(torch.int32).clamp_(0, 255)
    us = torch.trunc(s.to(f64) * 255.0).to(torch.int32).clamp_(0, 255)
    uh = torch.where(grey, torch.zeros_like(uh), uh)
    us = torch.where(grey, torch.zeros_like(us), us)
    v = maxc
    hh = torch.remainder(uh + shift, 256)
    # HSV -> RGB (Pillow's hsv2rgb)
    hf = hh.to(f64) * 6.0 / 255.0
    i = torch.floor(hf)
    frac = (hf - i).to(f32)
    fs = (us.to(f64) / 255.0).to(f32)
    vf = v.to(f64)
    p = _round_half_away(vf * (1.0 - fs.to(f64)))
    q = _round_half_away(vf * (1.0 - (fs * frac).to(f64)))
    t = _round_half_away(vf * (1.0 - fs.to(f64) * (1.0 - frac.to(f64))))
    cand = torch.stack((vf, t, p, q)).clamp_(0, 255).to(torch.uint8)  # 4 x N x H x W
    sector = torch.remainder(i.to(torch.int64), 6)
    # (r, g, b) per sector, as indices into (v, t, p, q)
    table = torch.tensor([[0, 1, 2], [3, 0, 2], [2, 0, 1], [2, 3, 0], [1, 2, 0], [0, 2, 3]], device=x.device)
    pick = table[sector]  # N x H x W x 3
    out = torch.gather(cand, 0, pick.permute(3, 0, 1, 2).contiguous())  # 3 x N x H x W
    out = out.permute(1, 0, 2, 3)
    unsat = (us == 0).unsqueeze(1)
    return torch.where(unsat, v.to(torch.uint8).unsqueeze(1).expand(-1, 3, -1, -1), out).contiguous()


def box_blur_radius(radius: float, passes: int = 3) -> float:
    """The extended box radius Pillow's ``GaussianBlur(radius)`` blurs with (its
    ``_gaussian_blur_radius``, in C floats: the result is a float32 value)."""
    f = np.float32
    sigma2 = f(f(radius) * f(radius)) / f(passes)
    big_l = f(math.sqrt(12.0 * float(sigma2) + 1.0))
    small_l = f(math.floor((float(big_l) - 1.0) / 2.0))
    a = (f(2) * small_l + f(1)) * (small_l * (small_l + f(1)) - f(3) * sigma2)
    a = a / (f(6) * (sigma2 - (small_l + f(1)) * (small_l + f(1))))
    return float(small_l + a)


def _box_weights(box: float) -> tuple[int, int, int]:
    """Pillow's ``ImagingHorizontalBoxBlur`` set-up for a box radius: (whole radius, inner
    weight, edge weight), the weights in 8.24 fixed point."""
    whole = int(box)
    inner = int(np.float32(1 << 24) / (np.float32(box) * np.float32(2) + np.float32(1)))
    edge = ((1 << 24) - (whole * 2 + 1) * inner) // 2
    return whole, inner, edge


def _box_pass(x: torch.Tensor, whole: int, inner: torch.Tensor, edge: torch.Tensor) -> torch.Tensor:
    """One horizontal pass of Pillow's box blur over the last dimension of the int64 ``x``
    (edges repeated), rounded to 8 bits as Pillow stores each pass."""
    width = x.shape[-1]
    pad = whole + 1
    left = x[..., :1].expand(*x.shape[:-1], pad)
    right = x[..., -1:].expand(*x.shape[:-1], pad)
    padded = torch.cat((left, x, right), dim=-1)
    acc = padded[..., 1 : 1 + width].clone()
    for j in range(2, 2 * whole + 2):
        acc += padded[..., j : j + width]
    far = padded[..., 0:width] + padded[..., 2 * whole + 2 : 2 * whole + 2 + width]
    bulk = acc * inner + far * edge + (1 << 23)
    return torch.bitwise_right_shift(bulk, 24)


def gaussian_blur(
    x: torch.Tensor, radii: Sequence[float], *, compiled: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``img.filter(ImageFilter.GaussianBlur(radius))`` of each image with its radius:
    Pillow's three extended box-blur passes along rows, then three along columns
    (a radius of 0: the image unchanged)."""
    n = len(x)
    if len(radii) != n:
        raise ValueError(f"{len(radii)} radii for {n} images")
    if _target(x, compiled) is not None:
        weights = [(-1, 0, 0) if r == 0 else _box_weights(box_blur_radius(r)) for r in radii]
        columns = [
            np.asarray([wt[i] for wt in weights], dtype) for i, dtype in enumerate((np.int32, np.uint32, np.uint32))
        ]
        out = _owned(x, inplace)
        _, _, h, w = out.shape
        _compiled_module().blur(out.numpy(), n, h, w, *(c.tobytes() for c in columns))
        return out
    out = x.clone()
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for k, radius in enumerate(radii):
        if radius == 0:
            continue  # Pillow copies the image for a radius of 0
        whole, weight, side = _box_weights(box_blur_radius(radius))
        groups.setdefault(whole, []).append((k, weight, side))
    for whole, members in groups.items():
        idx = torch.tensor([m[0] for m in members], device=x.device)
        inner = torch.tensor([m[1] for m in members], dtype=torch.int64, device=x.device).view(-1, 1, 1, 1)
        edge = torch.tensor([m[2] for m in members], dtype=torch.int64, device=x.device).view(-1, 1, 1, 1)
        t = x.index_select(0, idx).to(torch.int64)
        for _ in range(3):
            t = _box_pass(t, whole, inner, edge)
        t = t.transpose(2, 3)
        for _ in range(3):
            t = _box_pass(t, whole, inner, edge)
        out.index_copy_(0, idx, t.transpose(2, 3).to(torch.uint8))
    return out


def normalize(
    x: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    compiled: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ToTensor()`` then ``Normalize(mean, std)``: float32 ``x / 255``, minus the mean,
    divided by the std (the same operations, in the same order, as torchvision's), into
    ``out`` if given (a float32 tensor of ``x``'s shape). Compiled: one table lookup per
    value, the table made by these same operations on every byte value (so the same
    float32 values)."""
    if out is not None and tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, the images {tuple(x.shape)}")
    module = _target(x, compiled)
    if module is not None and (out is None or (out.is_contiguous() and out.dtype == torch.float32)):
        table = _normal_table(tuple(float(v) for v in mean), tuple(float(v) for v in std))
        src = x.contiguous()
        dst = torch.empty(src.shape, dtype=torch.float32) if out is None else out
        n, _, h, w = src.shape
        module.lookup(src.numpy(), n, h, w, table, dst.numpy())
        return dst
    made = _normalized(x, mean, std)
    if out is None:
        return made
    out.copy_(made)
    return out


def normalizer(mean: Sequence[float], std: Sequence[float]) -> Any:
    """``normalize(x, mean, std, out=out)`` as a function ``(x, out) -> None`` whose table
    and compiled helper are found once (a multi-crop normalizes each view into its slot
    of a batch: one call per view, without the set-up of each)."""
    mean_t, std_t = tuple(float(v) for v in mean), tuple(float(v) for v in std)
    module = _compiled_module()
    table = _normal_table(mean_t, std_t) if module is not None else b""

    def run(x: torch.Tensor, out: torch.Tensor) -> None:
        if (
            module is None
            or _target(x, True) is None
            or not x.is_contiguous()
            or not out.is_contiguous()
            or out.dtype != torch.float32
            or out.device.type != "cpu"
            or out.shape != x.shape
        ):
            normalize(x, mean_t, std_t, out=out)
            return
        n, _, h, w = x.shape
        module.lookup(x.numpy(), n, h, w, table, out.numpy())

    return run


def _normalized(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    m = torch.as_tensor(mean, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    return x.to(torch.float32).div_(255).sub_(m).div_(s)


_TABLES: dict[tuple[tuple[float, ...], tuple[float, ...]], bytes] = {}


def _normal_table(mean: tuple[float, ...], std: tuple[float, ...]) -> bytes:
    """``_normalized`` of every byte value in each channel: 3 x 256 float32, made once."""
    table = _TABLES.get((mean, std))
    if table is None:
        values = torch.arange(256, dtype=torch.uint8).view(1, 1, 1, 256).expand(1, 3, 1, 256).contiguous()
        table = _normalized(values, mean, std).numpy().tobytes()
        _TABLES[(mean, std)] = table
    return table


_OPS = {BRIGHTNESS: brightness, CONTRAST: contrast, SATURATION: saturation, HUE: hue}

# -- the compiled operations ---------------------------------------------------------------------------
_COMPILED: list[Any] = []  # [module or None], decided once per process (a fork inherits the answer)


def _c_floats(values: Sequence[float] | torch.Tensor, n: int) -> bytes:
    """One C float per image (a single value: the same for every image)."""
    arr = np.asarray(torch.as_tensor(values, dtype=torch.float64).reshape(-1).tolist(), np.float64)
    if arr.size == 1 and n != 1:
        arr = np.repeat(arr, n)
    if arr.size != n:
        raise ValueError(f"{arr.size} factors for {n} images")
    return arr.astype(np.float32).tobytes()


def _compiled_module() -> Any:
    if not _COMPILED:
        _COMPILED.append(_find_compiled())
    return _COMPILED[0]


def compiled() -> bool:
    """Whether the CPU operations run compiled here: ``lmdbfolder.torch._photometric``
    is built and gives the tensor operations' values on probe images (checked once
    per process)."""
    return _compiled_module() is not None


def _target(x: torch.Tensor, allowed: bool) -> Any:
    """The compiled module where it takes ``x`` (a CPU uint8 ``N x 3 x H x W`` batch), else None."""
    if not allowed or x.device.type != "cpu" or x.dtype != torch.uint8 or x.dim() != 4 or x.shape[1] != 3:
        return None
    if not x.numel():
        return None
    return _compiled_module()


def _owned(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """A C-contiguous tensor of ``x``'s values the compiled operations may write: ``x``
    itself with ``inplace`` when it is contiguous, else a copy."""
    out = x.contiguous()
    if out.data_ptr() == x.data_ptr() and not inplace:
        out = out.clone()
    return out


def _c_blend(module: Any, out: torch.Tensor, kind: int, alphas: np.ndarray) -> None:
    n, _, h, w = out.shape
    module.blend(out.numpy(), n, h, w, kind, np.asarray(alphas, np.float64).astype(np.float32).tobytes())


def _in_c(x: torch.Tensor, allowed: bool, name: str, *params: Any) -> torch.Tensor | None:
    """The compiled ``name`` on a copy of ``x`` (CPU, uint8), or None where it does not run."""
    module = _target(x, allowed)
    if module is None:
        return None
    out = _owned(x)
    n, _, h, w = out.shape
    getattr(module, name)(out.numpy(), n, h, w, *params)
    return out


def _find_compiled() -> Any:
    try:
        # By name: the C module is a leaf beside this file, not the package (whose
        # __init__ reaches the dataset, which imports this module).
        module = importlib.import_module("lmdbfolder.torch._photometric")
    except ImportError:
        return None
    _COMPILED.append(module)  # for the probe below, which calls the public functions
    try:
        rng = np.random.default_rng(11)
        y, x = np.mgrid[0:19, 0:23]
        smooth = np.stack([(x * 11) % 256, (y * 13) % 256, (x * y) % 256]).astype(np.uint8)
        noise = rng.integers(0, 256, (3, 19, 23), dtype=np.uint8)
        probe = torch.from_numpy(np.stack([smooth, noise, np.full_like(smooth, 77)]))
        checks: list[tuple[Any, Any]] = [
            (brightness, [0.61, 1.37, 1.0]),
            (contrast, [0.6, 1.4, 0.9]),
            (saturation, [0.8, 1.2, 0.0]),
            (hue, [-0.1, 0.07, 0.5]),
            (gaussian_blur, [0.1, 1.7, 0.0]),
            (grayscale, [True, False, True]),
            (lambda t, chosen, **kw: solarize(t, 128, chosen, **kw), [False, True, True]),
        ]
        same = all(torch.equal(fn(probe, arg), fn(probe, arg, compiled=False)) for fn, arg in checks)
        imagenet = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        same = same and torch.equal(normalize(probe, *imagenet), _normalized(probe, *imagenet))
        orders, jitter = [(3, 1, 0, 2), (0, 1, 2, 3), ()], [(1.2, 0.7, 1.1, 0.05), (0.8, 1.3, None, -0.07), (None,) * 4]
        same = same and torch.equal(
            color_jitter(probe, orders, jitter), color_jitter(probe, orders, jitter, compiled=False)
        )
    except Exception:  # a helper that fails on a valid batch does not match either
        same = False
    finally:
        _COMPILED.clear()
    return module if same else None


def color_jitter(
    x: torch.Tensor,
    orders: Sequence[Sequence[int]],
    factors: Sequence[Sequence[float | None]],
    *,
    compiled: bool = True,
    inplace: bool = False,
) -> torch.Tensor:
    """torchvision's ``ColorJitter`` on each image of ``x``: image ``k`` gets the operations
    in ``orders[k]`` (``fn_idx``: a permutation of 0..3, brightness, contrast,
    saturation, hue) with ``factors[k]`` (four factors, None for an operation the
    jitter leaves out). An image with an empty order is left as it is. Compiled: one
    pass over the batch per slot and operation, in place in one copy of ``x`` (in ``x``
    itself with ``inplace``)."""
    n = len(x)
    if len(orders) != n or len(factors) != n:
        raise ValueError(f"{len(orders)} orders and {len(factors)} factor sets for {n} images")
    slots: list[dict[int, list[int]]] = []
    for slot in range(4):
        by_op: dict[int, list[int]] = {}
        for k in range(n):
            if slot < len(orders[k]):
                op = int(orders[k][slot])
                if factors[k][op] is not None:
                    by_op.setdefault(op, []).append(k)
        slots.append(by_op)
    module = _target(x, compiled)
    if module is not None:
        out = _owned(x, inplace)
        for by_op in slots:
            for op, members in by_op.items():
                if op == HUE:
                    shifts = np.full(n, -1, np.int32)
                    shifts[members] = [int(float(factors[k][op]) * 255) % 256 for k in members]  # type: ignore[arg-type]
                    _, _, h, w = out.shape
                    module.hue(out.numpy(), n, h, w, shifts.tobytes())
                else:
                    alphas = np.full(n, np.nan)
                    alphas[members] = [float(factors[k][op]) for k in members]  # type: ignore[arg-type]
                    _c_blend(module, out, op, alphas)
        return out
    out = x
    for by_op in slots:
        for op, members in by_op.items():
            fn = _OPS[op]
            chosen = [float(factors[k][op]) for k in members]  # type: ignore[arg-type]
            if len(members) == n:
                out = fn(out, chosen)
                continue
            idx = torch.tensor(members, device=x.device)
            if out is x:
                out = x.clone()
            out.index_copy_(0, idx, fn(out.index_select(0, idx), chosen))
    return out
