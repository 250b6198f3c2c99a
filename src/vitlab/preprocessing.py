"""The preprocessing that belongs to a set of weights: input size, channels, normalisation,
resize mode and centre crop. It travels with every checkpoint vitlab writes and with every model
loaded from another library's checkpoint, and `predict` applies it (torchvision's weight enums,
timm's pretrained cfg, transformers' image processors)."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

import torch
from PIL import Image
from torch import Tensor

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)  # Google's weights: inputs scaled to [-1, 1]
_MODES = ("nearest", "bilinear", "bicubic")  # torchvision's InterpolationMode, by value
CROP_MODES = ("center", "squash", "border")  # timm's names (its eval transform's crop_mode)
REFERENCES = (None, "timm", "transformers")


def _tf():
    """torchvision's functional transforms, imported when an image is first resized or read:
    importing torchvision takes about a second (it loads torch's compiler), which a run whose
    images already have the model's size, and every `vitlab --help`, need not pay."""
    from torchvision.transforms.v2 import functional

    return functional


def _per_channel(values: object, name: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in values)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise ValueError(f"{name} is a value per channel, got {values!r}") from None


def crop_pct_for(crop: int, resize: int) -> float:
    """The crop_pct from which timm's floor(crop / crop_pct) gives back `resize` (a library that
    states both sizes, e.g. 224 of 256): crop / resize, or the float just below it where the
    division rounds under `resize` (224 / 242 does)."""
    pct = crop / resize
    while math.floor(crop / pct) < resize:
        pct = math.nextafter(pct, 0.0)
    return pct


@dataclass
class Preprocessing:
    """What turns an image into model input.

    `crop_pct` None: the whole image is resized to img_size (how vitlab's own runs train, and
    transformers' ViTImageProcessor); a number: the image is resized to img_size / crop_pct, then
    the centre img_size crop is taken, also when it already has img_size (timm's, torchvision's
    and transformers' DeiTImageProcessor's evaluation transform, e.g. 0.875 = 224 of 256).
    `crop_mode` (timm's names) says how that resize goes: "center" keeps the aspect ratio (the
    shorter side to floor(size / crop_pct)), "squash" resizes both sides to floor(size /
    crop_pct), "border" fits the longer side there and pads with the mean's colour.

    `reference` names whose pixels `pil` reproduces where the libraries differ: "timm" (also
    torchvision's weight transforms) resizes a PIL image with PIL and rounds the crop's offset;
    "transformers" resizes it as a uint8 tensor with torchvision and rounds the offset down;
    None: timm's with a crop_pct, transformers' without."""

    img_size: tuple[int, int]
    in_chans: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str = "bilinear"
    crop_pct: float | None = None
    crop_mode: str = "center"
    reference: str | None = None

    def __post_init__(self) -> None:
        size = self.img_size
        try:
            pair = (size, size) if isinstance(size, numbers.Integral) else tuple(size)
            ok = len(pair) == 2 and all(
                isinstance(n, numbers.Integral) and not isinstance(n, bool) and n > 0 for n in pair
            )
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"img_size is (height, width) in pixels, or one number for a "
                             f"square, got {size!r}")  # fmt: skip
        self.img_size = (int(pair[0]), int(pair[1]))
        if not isinstance(self.in_chans, numbers.Integral) or self.in_chans < 1:
            raise ValueError(f"in_chans is a number of channels (1 or more), got {self.in_chans!r}")
        self.mean, self.std = _per_channel(self.mean, "mean"), _per_channel(self.std, "std")
        if len(self.mean) != self.in_chans or len(self.std) != self.in_chans:
            raise ValueError(f"mean and std have a value per channel, {self.in_chans} for "
                             f"in_chans={self.in_chans}; got {len(self.mean)} and "
                             f"{len(self.std)}: {self.mean}, {self.std}")  # fmt: skip
        if not all(math.isfinite(v) for v in self.mean + self.std) or min(self.std) <= 0:
            raise ValueError(f"mean must be finite and std positive (they divide), got mean "
                             f"{self.mean}, std {self.std}")  # fmt: skip
        if self.interpolation not in _MODES:
            raise ValueError(
                f"interpolation must be one of {sorted(_MODES)}, got {self.interpolation!r}"
            )
        if self.crop_pct is not None and not 0.0 < self.crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {self.crop_pct}")
        if self.crop_mode not in CROP_MODES:
            raise ValueError(f"crop_mode must be one of {CROP_MODES}, got {self.crop_mode!r}")
        if self.reference not in REFERENCES:
            raise ValueError(f"reference must be one of {REFERENCES}, got {self.reference!r}")
        if self.crop_mode == "border" and self.reference == "transformers":
            raise ValueError("crop_mode 'border' is timm's: transformers' processors do not pad")

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def timm_data_config(self) -> dict:
        """This preprocessing in timm's data-config keys (`timm.data.create_transform(**it)`):
        the whole image resized is timm's squash at crop_pct 1.0."""
        whole = self.crop_pct is None
        return {
            "input_size": (self.in_chans, *self.img_size),
            "interpolation": self.interpolation,
            "mean": self.mean,
            "std": self.std,
            "crop_pct": 1.0 if whole else self.crop_pct,
            "crop_mode": "squash" if whole else self.crop_mode,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Preprocessing:
        """The inverse of to_dict; a dict written before crop_mode and reference reads with
        their defaults, which are what it meant."""
        return cls(
            img_size=tuple(d["img_size"]),
            in_chans=int(d["in_chans"]),
            mean=tuple(d["mean"]),
            std=tuple(d["std"]),
            interpolation=d.get("interpolation", "bilinear"),
            crop_pct=d.get("crop_pct"),
            crop_mode=d.get("crop_mode", "center"),
            reference=d.get("reference"),
        )

    @property
    def resampling(self) -> str:
        """The interpolation as torchvision and F.interpolate name it: "nearest" as PIL, timm and
        transformers sample it, each output pixel's centre ("nearest-exact"; the legacy nearest
        floors, a shifted grid: 99% of pixels differ at 457x300 -> 224)."""
        return "nearest-exact" if self.interpolation == "nearest" else self.interpolation

    def resize(self, images: Tensor | Image.Image) -> Tensor | Image.Image:
        """uint8 (B, C, H, W), or a PIL image -> the same at img_size (see crop_pct)."""
        size = tuple(images.shape[-2:]) if isinstance(images, Tensor) else images.size[::-1]
        if self.crop_pct is None and size == self.img_size:
            return images
        TF = _tf()
        from torchvision.transforms import InterpolationMode

        mode = InterpolationMode(self.resampling)
        if self.crop_pct is None:
            return TF.resize(images, list(self.img_size), interpolation=mode, antialias=True)
        images = TF.resize(images, self.scale_size(*size), interpolation=mode, antialias=True)
        return self.center_crop(images)

    def scale_size(self, height: int, width: int) -> list[int]:
        """The size an image of `height` x `width` is resized to before the centre crop, as in
        timm's eval transform. "center": a square img_size puts the shorter side at floor(size
        / crop_pct) (a one-number size: torchvision scales the other side); any other puts the
        side that is shorter relative to floor(img_size / crop_pct) there (timm's
        ResizeKeepRatio). "squash": both sides at floor(img_size / crop_pct). "border": the side
        that is longer relative to it there."""
        assert self.crop_pct is not None
        h, w = self.img_size
        sh, sw = math.floor(h / self.crop_pct), math.floor(w / self.crop_pct)
        if self.crop_mode == "squash":
            return [sh, sw]
        if sh == sw and self.crop_mode == "center":
            return [sh]
        pick = max if self.crop_mode == "border" else min
        ratio = pick(height / sh, width / sw)
        return [round(height / ratio), round(width / ratio)]

    def center_crop(self, images: Tensor | Image.Image) -> Tensor | Image.Image:
        """The centre img_size of images at least that size (padded first where they are not:
        with black, or with the mean's colour for "border", as timm's CenterCropOrPad); the
        offset as `reference` rounds it."""
        TF = _tf()
        height, width = TF.get_size(images)
        h, w = self.img_size
        if height < h or width < w:
            fill = [round(255 * m) for m in self.mean] if self.crop_mode == "border" else 0
            dh, dw = max(h - height, 0), max(w - width, 0)
            images = TF.pad(images, [dw // 2, dh // 2, (dw + 1) // 2, (dh + 1) // 2], fill=fill)
            height, width = height + dh, width + dw
        if self.reference == "transformers":
            top, left = (height - h) // 2, (width - w) // 2
        else:  # torchvision's center_crop, which timm's and torchvision's transforms use
            top, left = round((height - h) / 2), round((width - w) / 2)
        return TF.crop(images, top, left, h, w)

    def normalize(self, images: Tensor) -> Tensor:
        """uint8 (B, C, h, w) at img_size -> float (B, C, h, w), scaled to [0, 1], normalised:
        x * (1 / (255 std)) - mean / std, in two passes over one new tensor (the chain of four
        a float(), a div and torchvision's normalize take costs twice the time)."""
        self._uint8(images)
        mean = torch.tensor(self.mean, dtype=torch.float32, device=images.device).view(-1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32, device=images.device).view(-1, 1, 1)
        x = images.to(torch.float32, copy=True)  # never the caller's tensor, changed in place
        return x.mul_(1.0 / (255.0 * std)).add_(-mean / std)

    def _uint8(self, images: Tensor) -> None:
        if images.dtype != torch.uint8:  # a float one was divided by 255 again, without a word
            raise ValueError(
                f"expected uint8 images (0..255), got {images.dtype}: a float image in [0, 1] is "
                f"(x * 255).round().to(torch.uint8), or normalise it as (x - mean) / std, mean "
                f"{self.mean}, std {self.std}"
            )

    def batch(self, images: Tensor) -> Tensor:
        """uint8 (B, C, H, W) -> normalised float (B, in_chans, h, w) at img_size. As `vitlab
        eval` takes images: a grey batch for an RGB model is repeated to RGB, an RGB one for a
        grey model converted (ITU-R 601 luma, torchvision's rgb_to_grayscale)."""
        if not isinstance(images, Tensor) or images.ndim != 4:
            got = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
            one = isinstance(images, Tensor) and images.ndim == 3
            raise ValueError(f"expected a uint8 batch (B, C, H, W), got {got}"
                             f"{' (one image: images[None])' * one}")  # fmt: skip
        self._uint8(images)
        if (matched := self.match_channels(images)) is None:
            other = "RGB" if self.in_chans == 1 else "grey"
            raise ValueError(f"expected images of {self.in_chans} channel"
                             f"{'s' * (self.in_chans > 1)} (or {other}), got {images.shape[1]} "
                             f"in a batch of shape {tuple(images.shape)}")  # fmt: skip
        return self.normalize(self.resize(matched))

    def match_channels(self, images: Tensor) -> Tensor | None:
        """uint8 (B, C, H, W) with in_chans channels: grey repeated to RGB (any count), RGB
        converted to grey (ITU-R 601 luma, torchvision's: as PNG and JPEG files decode grey,
        where PIL's integer luma is a grey level off on some pixels); None for another pair."""
        have = images.shape[1]
        if have == self.in_chans:
            return images
        if have == 1:
            return images.expand(-1, self.in_chans, -1, -1)
        if have == 3 and self.in_chans == 1:
            return _tf().rgb_to_grayscale(images)
        return None

    def pil(self, image: Image.Image) -> Tensor:
        """A PIL image of any mode and size -> normalised float (C, h, w), the same pixels as the
        reference: timm's and torchvision's evaluation transforms resize it with PIL;
        transformers' processors (and vitlab's training batches) as a uint8 tensor with
        torchvision."""
        image = image.convert("L" if self.in_chans == 1 else "RGB")
        if self.reference == "timm" or (self.reference is None and self.crop_pct is not None):
            return self.normalize(_tf().pil_to_tensor(self.resize(image))[None])[0]
        return self.batch(_tf().pil_to_tensor(image)[None])[0]
