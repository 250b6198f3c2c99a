"""BiT's ResNet-v2-50 as a CNN baseline (`arch="resnetv2_50"`): the R50 hybrid's ResNet
(models.stems.ResNetV2: GroupNorm, weight-standardised convs, TF "SAME" padding, units that are
not pre-activation) with all four stages (3, 4, 6, 3), then the map's mean and a classifier, in
timm's module layout and names:

map    = stem(x)                          7x7/2 StdConv -> GN -> ReLU -> 3x3/2 max-pool
                                          (B, 64, H/4, W/4)
map    = stages.i(map), i = 0..3          bottleneck units, 256 / 512 / 1024 / 2048 channels,
                                          stride 2 from stages.1 on: (B, 2048, H/32, W/32)
logits = head.fc(mean over the map)       a 1x1 conv with bias on the (B, 2048, 1, 1) mean

Its twin in timm is the backbone of the hybrid vit_large_r50_s32_224 (units (3, 4, 6, 3)) with a
head:
`timm.models.resnetv2.ResNetV2(layers=(3, 4, 6, 3), preact=False, stem_type="same",
conv_layer=partial(StdConv2dSame, eps=1e-8), num_classes=N, in_chans=C)`, whose state dict loads
here as it is (its `norm` is an Identity without preact, its head.fc a 1x1 Conv2d). It is NOT timm's
registered `resnetv2_50` (pre-activation units, BatchNorm) nor BiT's released `resnetv2_50x1_bit`
(pre-activation, GroupNorm): models.cnn_checkpoint refuses both by name.

Small images (both sides <= 32 unless `small_stem` says otherwise): the stem is a 3x3 stride-1
StdConv -> GN -> ReLU with no max-pool (stems.Root's small variant, like the torchvision ResNets'
small stem), so a 28x28 image keeps a 28x28 first map; the names stay stem.conv / stem.norm and the
kernel (3x3 or 7x7) tells a checkpoint's stem. Init: timm's (Kaiming-normal convs, GN scale 1,
head N(0, 0.01) with zero bias; zero_init_residual zeroes each unit's norm3 scale).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from vitlab.models.cnn import CNN, STEM_WIDTH, CNNConfig
from vitlab.models.stems import ResNetV2, Stage


class ConvHead(nn.Module):
    """timm's ClassifierHead(use_conv=True) after the pooling: a 1x1 conv from the pooled
    (B, C, 1, 1) map to the classes, flattened to (B, num_classes); fc is an Identity without
    classes."""

    def __init__(self, fc: nn.Module) -> None:
        super().__init__()
        self.fc = fc

    def forward(self, pooled: Tensor) -> Tensor:
        return self.fc(pooled).flatten(1)


class BiTResNet(CNN):
    """BiT's ResNet-v2-50 for one CNNConfig (arch "resnetv2_50"), the hybrid's ResNet's modules
    adopted under timm's names: stem, stages, head.fc."""

    classifier_name = "head.fc"

    def __init__(self, config: CNNConfig) -> None:
        super().__init__(config)
        cfg = self.config
        if not cfg.bit:
            raise ValueError(f"{cfg.arch} is a torchvision ResNet (models.cnn.ResNet)")
        net = ResNetV2(cfg.in_chans, STEM_WIDTH, cfg.depths, cfg.uses_small_stem)
        self.stem, self.stages = net.stem, net.stages  # timm's names
        self.head = ConvHead(nn.Identity())
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if cfg.zero_init_residual:
            for block in self.blocks:
                nn.init.zeros_(block.norm3.weight)
        if cfg.num_classes:
            self.head.fc = self._classifier_layer(cfg.num_classes)
            nn.init.normal_(self.head.fc.weight, std=0.01)
            nn.init.zeros_(self.head.fc.bias)

    @staticmethod
    def _units(stage: Stage) -> nn.Sequential:
        return stage.blocks

    def _classifier_layer(self, num_classes: int, **device: Any) -> nn.Module:
        return nn.Conv2d(self.num_features, num_classes, 1, **device)

    def _stem(self, x: Tensor) -> Tensor:
        return self.stem(x)

    def forward_head(self, features: Tensor, pre_logits: bool = False) -> Tensor:
        x = features.mean(dim=(2, 3), keepdim=True)  # (B, C, 1, 1)
        return x.flatten(1) if pre_logits else self.head(x)
