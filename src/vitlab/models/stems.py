"""Convolutional stems: a CNN turns the image into a feature map and each position of the map
becomes a token ("patch size 1" on the map, paper §3.1). A stem is a PatchEmbed: (B, C, H, W) ->
(B, N, D) on the grid (H / P, W / P), P the stem's total stride (the config's patch_size).

ConvStem   log2(P) 3x3 stride-2 conv -> BatchNorm -> ReLU, then a 1x1 conv to D (Xiao et al. 2021)
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from vitlab.models.layers import PatchEmbed
from vitlab.models.pos_embed import Grid


class ConvStem(PatchEmbed):
    """Early convolutions in place of the patchify layer (a small hybrid, Xiao et al. 2021 "Early
    Convolutions Help Transformers See Better"): log2(P) blocks of 3x3 stride-2 conv ->
    BatchNorm -> ReLU, widths doubling from `width`, then a 1x1 conv to D. (B, C, H, W) ->
    (B, N, D) on the same grid as P x P patches."""

    def __init__(
        self, img_size: Grid, patch_size: int, in_chans: int, embed_dim: int, width: int
    ) -> None:
        nn.Module.__init__(self)
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.set_image_size(img_size)
        layers: list[nn.Module] = []
        c = in_chans
        for i in range(int(math.log2(patch_size))):
            out = width * 2**i
            layers += [
                nn.Conv2d(c, out, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(inplace=True),
            ]
            c = out
        self.stem = nn.Sequential(*layers)
        self.proj = nn.Conv2d(c, embed_dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        x = self.proj(self.stem(x))  # (B, D, gh, gw)
        return x.flatten(2).transpose(1, 2)  # (B, N, D)
