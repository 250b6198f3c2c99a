"""The patch embedding of the Vision Transformer (eq. 1's x_p E): an image cut into P x P patches,
each mapped by one shared linear map; and the input check every model's first layer makes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitlab.models import cpu_kernels
from vitlab.models.packed import plain, watched
from vitlab.models.pos_embed import Grid


def check_dtype(x: Tensor, weight: Tensor) -> None:
    """Raise ValueError unless x is float images the model's weights take: their dtype, or under
    autocast any float dtype it casts (all but float64)."""
    if not isinstance(x, Tensor) or not x.is_floating_point():  # a uint8 batch, a numpy array
        got = x.dtype if isinstance(x, Tensor) else f"a {type(x).__name__}, not a torch.Tensor"
        raise ValueError(
            f"expected float images, got {got}: scale them to [0, 1] and normalise (a uint8 "
            "batch: a loaded model's model.preprocessing.batch(images), vitlab.Preprocessing's)"
        )
    t = x.device.type  # no autocast on the meta device (FLOP counts, shapes)
    autocast = torch.amp.is_autocast_available(t) and torch.is_autocast_enabled(t)
    if x.dtype != weight.dtype and not (autocast and x.dtype != torch.float64):
        raise ValueError(
            f"expected images in the model's dtype {weight.dtype}, got {x.dtype}: convert them "
            f"with x.to({weight.dtype}) or the model with model.to({x.dtype})"
        )


class PatchEmbed(nn.Module):
    """Cuts an image into P x P patches and maps each with one shared linear map E (a P x P conv
    with stride P): (B, C, H, W) -> (B, N, D), N = (H / P) (W / P), patches in row-major order."""

    def __init__(self, img_size: Grid, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.set_image_size(img_size)
        self.proj = nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size)

    def set_image_size(self, img_size: Grid) -> None:
        self.img_size = img_size
        self.grid = (img_size[0] // self.patch_size, img_size[1] // self.patch_size)

    def check_input(self, x: Tensor) -> None:
        """Raise ValueError unless x is a (B, C, H, W) batch of the model's channels, size and
        dtype."""
        check_dtype(x, self.proj.weight)
        if x.ndim != 4:
            raise ValueError(
                f"expected a batch of images of shape (B, {self.in_chans}, {self.img_size[0]}, "
                f"{self.img_size[1]}), got a tensor of shape {tuple(x.shape)}"
            )
        _, c, h, w = x.shape
        if c != self.in_chans:
            s = "s" * (self.in_chans != 1)
            raise ValueError(f"expected images with {self.in_chans} channel{s}, got {c}")
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(
                f"image sides must be multiples of the patch size {p}: got {h}x{w}, "
                f"expected {self.img_size[0]}x{self.img_size[1]}"
            )
        if (h, w) != tuple(self.img_size):
            raise ValueError(
                f"expected images of size {self.img_size[0]}x{self.img_size[1]}, got {h}x{w} "
                f"(model.set_image_size() changes the model's resolution)"
            )

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        return self.project(x).flatten(1, 2)  # (B, N, D)

    def project(self, x: Tensor) -> Tensor:
        """Every patch's linear map: (B, C, H, W) -> (B, gh, gw, D). With one input channel, in
        float32 on a CPU where vitlab's kernels run (cpu_kernels.usable: AVX2, outside autocast,
        tracing and torch.func, the switch on), as the matrix product (B N, P P) x (P P, D) of the
        patches' pixels, which runs 2-4x faster than oneDNN's convolution there (BENCHMARKS.md,
        issue 16); the conv otherwise (and where a hook watches it, or it is not a plain
        nn.Conv2d)."""
        if not self._as_product(x):
            return self.proj(x).permute(0, 2, 3, 1)
        b, c, h, w = x.shape
        p = self.patch_size
        patches = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(b, h // p, w // p, c * p * p)  # not -1: an empty batch has 0
        return F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)

    def _as_product(self, x: Tensor) -> bool:
        if self.in_chans != 1 or not cpu_kernels.usable(x):
            return False
        conv, p = self.proj, self.patch_size
        patchify = conv.kernel_size == conv.stride == (p, p) and conv.padding == (0, 0)
        return plain(conv, nn.Conv2d) and patchify and conv.dilation == (1, 1) and not watched(conv)
