"""CNN baselines: torchvision's ResNet-18 / 34 / 50 (He et al., CVPR 2016), built by torchvision's
own builders and kept under torchvision's parameter names (conv1, bn1, layer1..4, fc), so its state
dicts load as they are and give its outputs; and BiT's ResNet-v2-50 as the hybrids build it
(models.resnetv2, timm's names). `CNN` is what both share: the config, the stages, the forward
split, intermediates, grad checkpointing and the classifier reset.

map    = maxpool(relu(bn1(conv1(x))))     (B, 64, H/4, W/4)    7x7 stride 2, 3x3 max-pool stride 2
map    = layer_i(map), i = 1..4           residual blocks, stride 2 from layer2 on, widths
                                          64 / 128 / 256 / 512 (x4 with bottlenecks)
                                          forward_features(): (B, C, H/32, W/32), C 512 or 2048
logits = fc(mean over the map)            forward_head()

Small images (both sides <= 32 unless `small_stem` says otherwise): conv1 is a 3x3 stride-1 conv
and there is no max-pool, so a 32x32 image keeps a 32x32 first map (4x4 at the end), as CIFAR
ResNets do. The names stay the same; conv1's kernel (3x3 or 7x7) tells a checkpoint's stem. A CNN
takes any image size: img_size is what the preprocessing resizes to, not a constraint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from vitlab.config import ConfigError, check_keys, pair, validate
from vitlab.models.classifier import ClassifierApi
from vitlab.models.indices import chosen_indices
from vitlab.models.patch_embed import check_dtype

ResNetArch = Literal["resnet18", "resnet34", "resnet50", "resnetv2_50"]

# arch -> (residual blocks per stage, bottleneck blocks); torchvision's resnet18 / 34 / 50, and
# the BiT ResNet-v2-50 of models.resnetv2 (GroupNorm, weight-standardised convs, timm's names)
ARCHS: dict[str, tuple[tuple[int, ...], bool]] = {
    "resnet18": ((2, 2, 2, 2), False),
    "resnet34": ((3, 4, 6, 3), False),
    "resnet50": ((3, 4, 6, 3), True),
    "resnetv2_50": ((3, 4, 6, 3), True),
}
BIT_ARCHS = ("resnetv2_50",)  # built by models.resnetv2, not torchvision
_TITLES = {"resnetv2_50": "BiT ResNet-v2-50"}
STEM_WIDTH = 64  # conv1's output channels
SMALL_SIDE = 32  # the automatic small stem: both image sides at most this


@dataclass
class CNNConfig:
    """Everything that defines a ResNet baseline. Defaults are torchvision's ResNet-18 at 224 for
    ImageNet."""

    family: ClassVar[str] = "cnn"

    arch: ResNetArch = "resnet18"
    img_size: int | tuple[int, int] = 224  # one side, or (height, width): the input size
    in_chans: int = 3
    num_classes: int = 1000  # 0: no classifier, forward() returns pooled features
    small_stem: bool | None = None  # 3x3 stride-1 conv1, no max-pool; None: when sides <= 32
    zero_init_residual: bool = False  # each block's last norm scale (BatchNorm, GN) starts at 0

    def __post_init__(self) -> None:
        validate(self)
        h, w = self.img_hw
        if min(h, w, self.in_chans) <= 0:
            raise ConfigError(f"img_size and in_chans must be positive, got {self}")
        if self.num_classes < 0:
            raise ConfigError(f"num_classes must be >= 0, got {self.num_classes}")

    @property
    def img_hw(self) -> tuple[int, int]:
        return pair(self.img_size)

    @property
    def uses_small_stem(self) -> bool:
        """small_stem, or when it is None whether both image sides are at most 32."""
        if self.small_stem is not None:
            return self.small_stem
        return max(self.img_hw) <= SMALL_SIDE

    @property
    def depths(self) -> tuple[int, ...]:
        """Residual blocks per stage."""
        return ARCHS[self.arch][0]

    @property
    def bottleneck(self) -> bool:
        """Bottleneck blocks (1x1, 3x3, 1x1, 4x wider out) rather than basic ones (3x3, 3x3)."""
        return ARCHS[self.arch][1]

    @property
    def stage_dims(self) -> tuple[int, ...]:
        """Output channels of each stage."""
        expansion = 4 if self.bottleneck else 1
        return tuple(STEM_WIDTH * 2**i * expansion for i in range(len(self.depths)))

    @property
    def num_features(self) -> int:
        """Channels of the last stage, of forward_features and of the pooled vector."""
        return self.stage_dims[-1]

    @property
    def stem_stride(self) -> int:
        """Input pixels per first-stage map pixel: 1 (small stem) or 4 (conv and max-pool)."""
        return 1 if self.uses_small_stem else 4

    @property
    def bit(self) -> bool:
        """BiT's ResNet-v2 (models.resnetv2, timm's names) rather than a torchvision ResNet."""
        return self.arch in BIT_ARCHS

    @property
    def title(self) -> str:
        """'ResNet-18' ... 'BiT ResNet-v2-50'."""
        return _TITLES.get(self.arch, f"ResNet-{self.arch.removeprefix('resnet')}")

    @property
    def first_conv(self) -> str:
        """The weight in_chans acts on (load_checkpoint adapts it to another channel count)."""
        return "stem.conv.weight" if self.bit else "conv1.weight"

    def replace(self, **changes: object) -> CNNConfig:
        """A copy with `changes` applied; unknown keys and wrong types raise ConfigError."""
        check_keys(CNNConfig, changes.keys())
        return dataclasses.replace(self, **changes)


def _torchvision_builders() -> dict[str, object]:
    from torchvision import models  # imported when first built: it takes seconds

    return {"resnet18": models.resnet18, "resnet34": models.resnet34, "resnet50": models.resnet50}


@contextmanager
def _batchnorm_stats_kept(module: nn.Module) -> Iterator[None]:
    """Whatever BatchNorm running statistics `module` updates inside are put back on exit: a
    checkpointed block recomputed in the backward pass must not count its batch twice."""
    norms = [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]
    saved = [(b, b.clone()) for m in norms for b in m.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _stats_once(block: nn.Module) -> Callable[[], tuple[AbstractContextManager, ...]]:
    """checkpoint()'s context_fn for `block`: nothing around the forward, BatchNorm statistics
    kept around the recomputation."""
    return lambda: (nullcontext(), _batchnorm_stats_kept(block))


class CNN(ClassifierApi, nn.Module):
    """What the CNN baselines share. A subclass builds its stem, `stages` (each an iterable of
    residual blocks, or a module with `.blocks`) and a classifier at `classifier_name`, and defines
    _stem, forward_head and _classifier_layer."""

    num_prefix_tokens = 0  # no tokens: features are a map
    stages: Sequence[nn.Module]  # the four stages, in order

    def __init__(self, config: CNNConfig) -> None:
        super().__init__()
        # the stem is fixed once built: a checkpoint says which, whatever size it is used at later
        self.config = config.replace(small_stem=config.uses_small_stem)
        self.num_features = self.config.num_features
        self.grad_checkpointing = False
        self.preprocessing = None  # a vitlab.preprocessing.Preprocessing when the weights have one
        self.classes: list[str] | None = None  # class names, likewise

    # --- construction ----------------------------------------------------------------------------

    @staticmethod
    def _units(stage: nn.Module) -> Iterable[nn.Module]:
        """A stage's residual blocks."""
        return stage

    @property
    def blocks(self) -> list[nn.Module]:
        """Every residual block in order (FSDP shards each; train.distributed.wrap)."""
        return [block for stage in self.stages for block in self._units(stage)]

    def _classifier_layer(self, num_classes: int, **device: Any) -> nn.Module:
        """A new classifier from num_features to `num_classes`, with weight and bias."""
        raise NotImplementedError

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the classifier by a zero-initialised one for `num_classes` (0: none), as the ViT
        and the Swin do, so a fine-tuned head starts from zero logits (a model built from a config
        keeps its library's initialisation instead). Class names of another count are dropped."""
        self.config = self.config.replace(num_classes=num_classes)
        self.classes = self.classes if len(self.classes or ()) == num_classes else None
        head: nn.Module = nn.Identity()
        if num_classes:
            ref = next(self.parameters())
            head = self._classifier_layer(num_classes, device=ref.device, dtype=ref.dtype)
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        parent, _, name = self.classifier_name.rpartition(".")
        setattr(self.get_submodule(parent), name, head)

    def set_image_size(
        self, img_size: int | tuple[int, int], small_stem: bool | None = None
    ) -> None:
        """Record another input size (a CNN takes any): the preprocessing resizes to it. The stem
        is fixed when the model is built: the config keeps the built one (stated explicitly when
        the automatic choice would differ at the new size), and a `small_stem` other than the
        built one is a ConfigError."""
        built = self.config.uses_small_stem
        if small_stem is not None and small_stem != built:
            raise ConfigError(
                f"the stem is fixed when the model is built ({'small' if built else 'standard'} "
                f"here): build a model with small_stem={small_stem} instead"
            )
        cfg = self.config.replace(img_size=img_size)
        if cfg.uses_small_stem != built:
            cfg = cfg.replace(small_stem=built)
        self.config = cfg
        if self.preprocessing is not None:
            self.preprocessing = dataclasses.replace(self.preprocessing, img_size=cfg.img_hw)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each residual block's activations in the backward pass instead of storing
        them (BatchNorm statistics, where there are any, are updated once per batch all the
        same)."""
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Names of the parameters AdamW should not decay: the norms' scales and shifts, the
        classifier's bias."""
        return {name for name, p in self.named_parameters() if p.ndim <= 1}

    # --- forward ---------------------------------------------------------------------------------

    def _check(self, x: Tensor) -> None:
        check_dtype(x, next(self.parameters()))
        c = self.config.in_chans
        if x.ndim != 4:
            raise ValueError(
                f"expected a batch of images of shape (B, {c}, H, W), got a tensor of shape "
                f"{tuple(x.shape)}"
            )
        if x.shape[1] != c:
            raise ValueError(f"expected images with {c} channel{'s' * (c != 1)}, got {x.shape[1]}")

    def _stem(self, x: Tensor) -> Tensor:
        """(B, C, H, W) images -> (B, 64, H/s, W/s), s the stem's stride (4, or 1)."""
        raise NotImplementedError

    def _checkpointed(self, block: nn.Module, x: Tensor) -> Tensor:
        return checkpoint(block, x, use_reentrant=False)

    def _stage(self, stage: nn.Module, x: Tensor) -> Tensor:
        for block in self._units(stage):
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = self._checkpointed(block, x)
            else:
                x = block(x)
        return x

    def _maps(self, x: Tensor) -> Iterator[Tensor]:
        """(B, C, H, W) images -> each stage's output map (B, C_i, h_i, w_i)."""
        self._check(x)
        x = self._stem(x)
        for stage in self.stages:
            x = self._stage(stage, x)
            yield x

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, C_last, h, w) the last stage's map: h = ceil(H / 32) with the
        standard stem, ceil(H / 8) with the small one."""
        self._check(x)
        x = self._stem(x)
        for stage in self.stages:
            x = self._stage(stage, x)
        return x

    def forward_head(self, features: Tensor, pre_logits: bool = False) -> Tensor:
        """(B, C, h, w) map -> (B, num_classes) logits, or the pooled (B, num_features) vector
        (the map's mean, what the classifier reads) when `pre_logits`."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) images -> (B, num_classes) logits."""
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
        self, x: Tensor, indices: int | Sequence[int] | None = None
    ) -> list[Tensor]:
        """The chosen stages' output maps (B, C_i, h_i, w_i), at strides s 2^i (s the stem's: 4, or
        1 with the small stem). `indices`: an int n (the last n stages) or stage indices
        (negative allowed); None for all four. Stops after the last chosen stage."""
        chosen = chosen_indices(indices, len(self.stages), "stage")
        out: list[Tensor] = []
        if not chosen:
            return out
        for i, feats in enumerate(self._maps(x)):
            if i in chosen:
                out.append(feats)
            if i == chosen[-1]:
                break
        return out


class ResNet(CNN):
    """torchvision's ResNet for one CNNConfig, its modules adopted under their own names."""

    classifier_name = "fc"

    def __init__(self, config: CNNConfig) -> None:
        super().__init__(config)
        cfg = self.config
        if cfg.bit:
            raise ConfigError(f"{cfg.arch} is built by models.resnetv2.BiTResNet, not ResNet")
        net = _torchvision_builders()[cfg.arch](
            weights=None,
            num_classes=cfg.num_classes or 1,
            zero_init_residual=cfg.zero_init_residual,
        )
        if cfg.uses_small_stem or cfg.in_chans != 3:
            kernel, stride, pad = (3, 1, 1) if cfg.uses_small_stem else (7, 2, 3)
            net.conv1 = nn.Conv2d(cfg.in_chans, STEM_WIDTH, kernel, stride, pad, bias=False)
            nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
        if cfg.uses_small_stem:
            net.maxpool = nn.Identity()
        if not cfg.num_classes:
            net.fc = nn.Identity()
        for name, module in net.named_children():  # conv1 bn1 relu maxpool layer1-4 avgpool fc
            self.add_module(name, module)

    @property
    def stages(self) -> list[nn.Sequential]:
        """layer1 ... layer4."""
        return [self.layer1, self.layer2, self.layer3, self.layer4]

    def _classifier_layer(self, num_classes: int, **device: Any) -> nn.Module:
        return nn.Linear(self.num_features, num_classes, **device)

    def _stem(self, x: Tensor) -> Tensor:
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))

    def _checkpointed(self, block: nn.Module, x: Tensor) -> Tensor:
        return checkpoint(block, x, use_reentrant=False, context_fn=_stats_once(block))

    def forward_head(self, features: Tensor, pre_logits: bool = False) -> Tensor:
        x = self.avgpool(features).flatten(1)  # (B, C)
        return x if pre_logits else self.fc(x)
