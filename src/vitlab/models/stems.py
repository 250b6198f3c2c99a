"""Convolutional stems: a CNN turns the image into a feature map and each position of the map
becomes a token ("patch size 1" on the map, paper §3.1). Both stems are PatchEmbeds: (B, C, H, W)
-> (B, N, D) on the grid (H / P, W / P), P the stem's total stride (the config's patch_size).

ConvStem   log2(P) stages of a 3x3 stride-2 conv -> BatchNorm -> ReLU (and stem_depths[i] - 1
           stride-1 ones), then a 1x1 conv to D (Xiao et al. 2021)
ResNetStem BiT's ResNet-v2 as the paper's hybrids use it (R50+ViT-B/16 ...), in timm's module
           layout and state-dict names (`patch_embed.backbone.stem.conv`, ...), then a 1x1 conv

The ResNet, for stem_width C0 and stem_depths (n_0, ..., n_{S-1}), TF "SAME" padding throughout
(the JAX original's; an odd pixel of padding goes to the bottom / right):

    backbone.stem       7x7/2 StdConv -> GN -> ReLU -> 3x3/2 max-pool     (B, C0, H/4, W/4)
    backbone.stages.i   n_i bottleneck units, 4 C0 2^i channels out; the first unit of a stage
                        strides (stage 0: 1, later: 2) on its 3x3 conv and projects the
                        shortcut (downsample: 1x1 StdConv -> GN)          (B, 4 C0 2^i, ...)
    proj                1x1 conv to D                                       (B, D, H/P, W/P)

    unit(x) = ReLU(GN(conv3(ReLU(GN(conv2(ReLU(GN(conv1(x))))))) + shortcut(x))
    P = 4 * 2^(S-1): R50 hybrid (3, 4, 9) -> 16 and 1,024 channels; R26 (2, 2, 2, 2) -> 32.

As in timm (and unlike BiT's classifier ResNets) the units are not pre-activation: GN and ReLU
follow each conv. The numerics are timm's: weights standardised as (w - mean) / sqrt(var + 1e-8)
per output channel, GroupNorm(32, eps 1e-5). The JAX original divides by std + 1e-5 and uses
GroupNorm eps 1e-6: nearly the same function, so weights from Google's .npz files give timm's
outputs here, close to but not exactly the JAX ones. Init: timm's (Kaiming-normal convs, GN
scale 1); the JAX code zero-initialises each unit's last GN scale, which would leave the unit's
convs without gradient at step 0.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from vitlab.models.patch_embed import PatchEmbed
from vitlab.models.pos_embed import Grid

GN_GROUPS = 32
GN_EPS = 1e-5
STD_EPS = 1e-8  # timm's StdConv2dSame for the hybrids


def resnet_stride(depths: tuple[int, ...]) -> int:
    """The ResNet's total stride: 4 (root conv and pool), x2 for every stage after the first."""
    return 4 * 2 ** (len(depths) - 1)


def resnet_channels(width: int, depths: tuple[int, ...]) -> list[int]:
    """Output channels of each stage: 4 width 2^i."""
    return [4 * width * 2**i for i in range(len(depths))]


def conv_stem_channels(width: int, depths: tuple[int, ...]) -> list[int]:
    """Output channels of each of the conv stem's stride-2 stages (conv_stem_depths): width 2^i."""
    return [width * 2**i for i in range(len(depths))]


def stem_problem(stem: str, width: int, depths: tuple[int, ...], patch_size: int) -> str | None:
    """What is wrong with a ViTConfig's stem fields (None: nothing): stem_depths belong to the
    conv stem (one positive conv count per stride-2 stage, or none) or to the ResNet stem, which
    needs one positive unit count per stage, a width GroupNorm's 32 groups divide, and the patch
    size its stride gives."""
    if stem == "conv":
        stages = max(patch_size.bit_length() - 1, 0)  # log2(P) for the power of two it needs
        if depths and (len(depths) != stages or min(depths) < 1):
            return (
                f"stem='conv' with patch_size {patch_size} has {stages} stride-2 stages: "
                f"stem_depths must give {stages} conv counts (each >= 1), e.g. "
                f"{(2,) * stages}, got {depths}"
            )
        return None
    if stem != "resnet":
        if depths:
            return f"stem_depths {depths} apply to stem='conv' or 'resnet', not {stem!r}"
        return None
    if not depths or min(depths) <= 0:
        return (
            f"stem='resnet' needs stem_depths, units per stage (each >= 1), e.g. (3, 4, 9) for "
            f"R50+ViT-B/16; got {depths}"
        )
    if width <= 0 or width % GN_GROUPS:
        return (
            f"stem='resnet' needs stem_width a positive multiple of {GN_GROUPS} (GroupNorm's "
            f"groups), got {width}"
        )
    stride = resnet_stride(depths)
    if patch_size != stride:
        return (
            f"stem='resnet' with stem_depths {depths} has stride {stride}: its tokens are "
            f"{stride} pixels a side, so patch_size must be {stride}, got {patch_size}"
        )
    return None


def conv_stem_depths(patch_size: int, depths: tuple[int, ...]) -> tuple[int, ...]:
    """The conv stem's convs per stride-2 stage: `depths`, or one for each of the log2(P)."""
    return depths or (1,) * int(math.log2(patch_size))


def pad_same(x: Tensor, kernel: int, stride: int, value: float = 0.0) -> Tensor:
    """TF "SAME" padding of (B, C, H, W) for a kernel and stride: the output side is
    ceil(side / stride), the odd pixel of padding at the bottom / right."""
    pads = []
    for side in (x.shape[-1], x.shape[-2]):  # F.pad takes the last dimension first
        total = max((-(-side // stride) - 1) * stride + kernel - side, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads, value=value) if any(pads) else x


class StdConv2d(nn.Conv2d):
    """Weight-standardised conv without bias, "SAME" padding: each output channel's kernel is
    standardised over (C_in, k, k) before use, (w - mean) / sqrt(var + eps), biased variance."""

    def __init__(self, in_chans: int, out_chans: int, kernel: int, stride: int = 1) -> None:
        # stride 1 with an odd kernel: SAME is the symmetric padding (k - 1) / 2
        padding = (kernel - 1) // 2 if stride == 1 else 0
        super().__init__(in_chans, out_chans, kernel, stride, padding=padding, bias=False)
        self.eps = STD_EPS

    def standardized_weight(self) -> Tensor:
        """(out, in, k, k) kernels standardised per output channel. Batch norm in training mode
        over (1, out, in k k) is this formula, in one kernel (timm's way: the same rounding)."""
        w = self.weight.reshape(1, self.out_channels, -1)
        w = F.batch_norm(w, None, None, training=True, momentum=0.0, eps=self.eps)
        return w.reshape_as(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if self.stride[0] > 1:
            x = pad_same(x, self.kernel_size[0], self.stride[0])
        return F.conv2d(x, self.standardized_weight(), None, self.stride, self.padding)


def group_norm(chans: int) -> nn.GroupNorm:
    return nn.GroupNorm(GN_GROUPS, chans, eps=GN_EPS)


class Root(nn.Module):
    """7x7/2 StdConv -> GN -> ReLU -> 3x3/2 max-pool: (B, C, H, W) -> (B, width, H/4, W/4).
    `small` (the CNN baseline's small-image stem, models.resnetv2): a 3x3 stride-1 StdConv -> GN
    -> ReLU and no pool, (B, width, H, W)."""

    def __init__(self, in_chans: int, width: int, small: bool = False) -> None:
        super().__init__()
        self.conv = StdConv2d(in_chans, width, 3 if small else 7, stride=1 if small else 2)
        self.norm = group_norm(width)
        self.small = small

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.norm(self.conv(x)))
        if self.small:
            return x
        return F.max_pool2d(pad_same(x, 3, 2, value=-math.inf), 3, 2)


class Downsample(nn.Module):
    """The projected shortcut of a stage's first unit: 1x1 StdConv (strided) -> GN."""

    def __init__(self, in_chans: int, out_chans: int, stride: int) -> None:
        super().__init__()
        self.conv = StdConv2d(in_chans, out_chans, 1, stride)
        self.norm = group_norm(out_chans)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (strided) -> 1x1 StdConvs, GN after each, ReLU after the first two and after
    the residual sum; mid width out / 4."""

    def __init__(self, in_chans: int, out_chans: int, stride: int, project: bool) -> None:
        super().__init__()
        mid = out_chans // 4
        self.downsample = Downsample(in_chans, out_chans, stride) if project else None
        self.conv1 = StdConv2d(in_chans, mid, 1)
        self.norm1 = group_norm(mid)
        self.conv2 = StdConv2d(mid, mid, 3, stride)
        self.norm2 = group_norm(mid)
        self.conv3 = StdConv2d(mid, out_chans, 1)
        self.norm3 = group_norm(out_chans)

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        return F.relu(self.norm3(self.conv3(y)) + shortcut)


class Stage(nn.Module):
    """`depth` bottleneck units; the first strides and projects its shortcut."""

    def __init__(self, in_chans: int, out_chans: int, depth: int, stride: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *(
                Bottleneck(
                    in_chans if j == 0 else out_chans, out_chans, stride if j == 0 else 1, j == 0
                )
                for j in range(depth)
            )
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x)


class ResNetV2(nn.Module):
    """The hybrid's CNN (see the module docstring): (B, C, H, W) -> (B, 4 C0 2^(S-1), H/P, W/P);
    with `small_stem` Root's small variant, P / 4 (models.resnetv2's classifier)."""

    def __init__(
        self, in_chans: int, width: int, depths: tuple[int, ...], small_stem: bool = False
    ) -> None:
        super().__init__()
        self.stem = Root(in_chans, width, small_stem)
        chans = resnet_channels(width, depths)
        ins = [width, *chans[:-1]]
        self.stages = nn.Sequential(
            *(
                Stage(c_in, c, n, 1 if i == 0 else 2)
                for i, (c_in, c, n) in enumerate(zip(ins, chans, depths))
            )
        )
        self.out_chans = chans[-1]

    def forward(self, x: Tensor) -> Tensor:
        return self.stages(self.stem(x))


class ResNetStem(PatchEmbed):
    """The paper's hybrid embedding: the ResNet's feature map, each position projected to D by a
    1x1 conv. (B, C, H, W) -> (B, N, D), N = (H / P) (W / P), P = resnet_stride(depths) (the
    config checks that it is its patch_size)."""

    def __init__(
        self,
        img_size: Grid,
        patch_size: int,
        in_chans: int,
        embed_dim: int,
        width: int,
        depths: tuple[int, ...],
    ) -> None:
        nn.Module.__init__(self)
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.set_image_size(img_size)
        self.backbone = ResNetV2(in_chans, width, depths)
        self.proj = nn.Conv2d(self.backbone.out_chans, embed_dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        x = self.proj(self.backbone(x))  # (B, D, gh, gw)
        return x.flatten(2).transpose(1, 2)  # (B, N, D)


class ConvStem(PatchEmbed):
    """Early convolutions in place of the patchify layer (a small hybrid, Xiao et al. 2021 "Early
    Convolutions Help Transformers See Better"): log2(P) stages, each a 3x3 stride-2 conv ->
    BatchNorm -> ReLU and then depths[i] - 1 more 3x3 stride-1 ones at the stage's resolution
    (depths () is one conv a stage), widths doubling from `width`, then a 1x1 conv to D.
    (B, C, H, W) -> (B, N, D) on the same grid as P x P patches."""

    def __init__(
        self,
        img_size: Grid,
        patch_size: int,
        in_chans: int,
        embed_dim: int,
        width: int,
        depths: tuple[int, ...] = (),
    ) -> None:
        nn.Module.__init__(self)
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.set_image_size(img_size)
        layers: list[nn.Module] = []
        c = in_chans
        problem = stem_problem("conv", width, depths, patch_size)
        if problem:
            raise ValueError(problem)
        stages = conv_stem_depths(patch_size, depths)
        for n, out in zip(stages, conv_stem_channels(width, stages)):
            for j in range(n):
                layers += [
                    nn.Conv2d(c, out, 3, stride=1 if j else 2, padding=1, bias=False),
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
