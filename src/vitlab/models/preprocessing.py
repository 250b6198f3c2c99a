"""The preprocessing that belongs to a set of weights: input size, channels, normalisation,
resize mode and centre crop. It travels with every checkpoint vitlab writes and with every model
loaded from another library's checkpoint, and `predict` applies it (torchvision's weight enums,
timm's pretrained cfg)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from torch import Tensor
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)  # Google's weights: inputs scaled to [-1, 1]
_MODES = {"nearest": InterpolationMode.NEAREST, "bilinear": InterpolationMode.BILINEAR}
_MODES["bicubic"] = InterpolationMode.BICUBIC


@dataclass
class Preprocessing:
    """What turns an image into model input.

    `crop_pct` None: the whole image is resized to img_size (how vitlab's own runs train);
    a number: the shorter side is resized to img_size / crop_pct, then the centre img_size crop
    is taken (timm's and torchvision's evaluation transform, e.g. 0.875 = 224 of 256)."""

    img_size: tuple[int, int]
    in_chans: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str = "bilinear"
    crop_pct: float | None = None

    def __post_init__(self) -> None:
        if self.interpolation not in _MODES:
            raise ValueError(
                f"interpolation must be one of {sorted(_MODES)}, got {self.interpolation!r}"
            )
        if self.crop_pct is not None and not 0.0 < self.crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {self.crop_pct}")

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> Preprocessing:
        return cls(
            img_size=tuple(d["img_size"]),
            in_chans=int(d["in_chans"]),
            mean=tuple(d["mean"]),
            std=tuple(d["std"]),
            interpolation=d.get("interpolation", "bilinear"),
            crop_pct=d.get("crop_pct"),
        )

    def resize(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, C, h, w) at img_size (unchanged when already that size)."""
        if tuple(images.shape[-2:]) == self.img_size:
            return images
        mode = _MODES[self.interpolation]
        if self.crop_pct is None:
            return TF.resize(images, list(self.img_size), interpolation=mode, antialias=True)
        h, w = self.img_size
        if h == w:  # shorter side to img_size / crop_pct, keeping the aspect ratio
            size = [math.floor(h / self.crop_pct)]
        else:
            size = [math.floor(h / self.crop_pct), math.floor(w / self.crop_pct)]
        images = TF.resize(images, size, interpolation=mode, antialias=True)
        return TF.center_crop(images, [h, w])

    def batch(self, images: Tensor) -> Tensor:
        """uint8 (B, C, H, W) -> normalised float (B, C, h, w) at img_size."""
        x = self.resize(images).float().div_(255.0)
        return TF.normalize(x, list(self.mean), list(self.std))

    def pil(self, image) -> Tensor:
        """A PIL image of any mode and size -> normalised float (C, h, w)."""
        image = image.convert("L" if self.in_chans == 1 else "RGB")
        x = TF.pil_to_tensor(image)
        return self.batch(x[None])[0]
