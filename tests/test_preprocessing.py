"""The preprocessing that travels with weights gives the inputs the reference libraries give:
timm's evaluation transform (resize to size / crop_pct keeping the aspect ratio, centre crop) for
weights with a crop_pct, transformers' ViTImageProcessor (the whole image resized) for weights
without, on real-size images of several shapes, the model's own size included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from vitlab.preprocessing import IMAGENET_MEAN, IMAGENET_STD, Preprocessing

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

# (H, W) of the test images: the model's own size, landscape, portrait, smaller than the model
SHAPES = [(224, 224), (300, 400), (500, 333), (97, 131)]
# a pixel level after normalisation is 1 / 255 / std >= 0.017: anything below 1e-5 is float
# rounding of identical pixels
SAME = 1e-5


def photo(shape: tuple[int, int], seed: int = 0) -> Image.Image:
    """A smooth image with noise (resamplers differ most on edges; this has both)."""
    h, w = shape
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx / w, yy / h, (xx + yy) / (h + w)], -1) * 200
    pixels = base + rng.normal(0, 25, (h, w, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def timm_eval(pre: Preprocessing):
    from timm.data import create_transform, resolve_data_config

    cfg = resolve_data_config(
        {
            "input_size": (pre.in_chans, *pre.img_size),
            "interpolation": pre.interpolation,
            "mean": pre.mean,
            "std": pre.std,
            "crop_pct": pre.crop_pct,
            "crop_mode": "center",
        }
    )
    return create_transform(**cfg)


CROPS = [
    ((224, 224), 0.9, "bicubic"),
    ((224, 224), 0.875, "bilinear"),
    ((160, 224), 0.9, "bicubic"),
]


@pytest.mark.parametrize("img_size,crop_pct,interpolation", CROPS)
@pytest.mark.parametrize("shape", SHAPES)
def test_crop_pct_matches_timms_eval_transform(
    shape: tuple[int, int], img_size: tuple[int, int], crop_pct: float, interpolation: str
) -> None:
    """Exact (same pixels): an image already at the model's size is still resized to
    size / crop_pct and centre-cropped, as timm does."""
    pre = Preprocessing(img_size, 3, IMAGENET_MEAN, IMAGENET_STD, interpolation, crop_pct)
    image = photo(shape)
    want = timm_eval(pre)(image)
    got = pre.pil(image)
    assert got.shape == want.shape == (3, *img_size)
    assert (got - want).abs().max().item() <= SAME


@pytest.mark.parametrize("shape", SHAPES)
def test_crop_pct_on_uint8_batches_follows_timm(shape: tuple[int, int]) -> None:
    """Batches (evaluation loaders) resize uint8 tensors with torchvision, whose resampler rounds
    differently from PIL's: the same geometry, within a grey level on average."""
    pre = Preprocessing((224, 224), 3, IMAGENET_MEAN, IMAGENET_STD, "bicubic", 0.9)
    image = photo(shape)
    want = timm_eval(pre)(image)
    got = pre.batch(TF.pil_to_tensor(image)[None])[0]
    levels = (got - want) * torch.tensor(pre.std)[:, None, None] * 255
    assert levels.abs().mean().item() < 0.1


@pytest.mark.parametrize("resample,interpolation", [(2, "bilinear"), (3, "bicubic")])
@pytest.mark.parametrize("shape", [*SHAPES, (32, 32)])
def test_whole_image_resize_matches_transformers_vit_image_processor(
    shape: tuple[int, int], resample: int, interpolation: str
) -> None:
    """Exact (same pixels) against transformers' ViTImageProcessor, which resizes the whole
    image as a uint8 tensor with torchvision."""
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    processor = transformers.ViTImageProcessor(
        size={"height": 224, "width": 224}, resample=resample, image_mean=mean, image_std=std
    )
    pre = Preprocessing((224, 224), 3, mean, std, interpolation, crop_pct=None)
    image = photo(shape)
    want = processor(image, return_tensors="pt")["pixel_values"][0]
    got = pre.pil(image)
    assert got.shape == want.shape == (3, 224, 224)
    assert (got - want).abs().max().item() <= SAME


@pytest.mark.parametrize("workers", [0, 1])
def test_evaluation_loaders_crop_once_as_timm_does(tmp_path, workers: int) -> None:
    """`vitlab eval` of weights with a crop_pct: the loader's batches (in memory and from an
    image folder) are timm's eval transform of each image, cropped once (the loader once
    resized per image and then again per batch: an effective crop of 0.81)."""
    from vitlab.data.datasets import ArraySplit, load_split
    from vitlab.data.loader import make_loader

    pre = Preprocessing((224, 224), 3, IMAGENET_MEAN, IMAGENET_STD, "bicubic", 0.9)
    image = photo((300, 400))
    want = timm_eval(pre)(image)
    pixels = TF.pil_to_tensor(image)[None]
    if workers == 0:
        split = ArraySplit(pixels.repeat(2, 1, 1, 1), torch.tensor([0, 1]), ["a", "b"])
    else:
        for name in "ab":
            (tmp_path / name).mkdir()
            for i in range(4):
                image.save(tmp_path / name / f"{i}.png")
        split = load_split(f"imagefolder:{tmp_path}", "test")
    (x, _), *_ = list(make_loader(split, 2, pre, workers=workers))
    for got in x:
        levels = (got - want) * torch.tensor(pre.std)[:, None, None] * 255
        assert levels.abs().mean().item() < 0.1
