"""The Swin Transformer (Liu et al., ICCV 2021) and its typed config; parameter names, shapes and
behaviour are timm 1.0's `SwinTransformer`, so its state dicts load strictly and give its outputs.

map    = LN(PatchEmbed_P(x))                       (B, H/P, W/P, C)        stride P (4)
map    = stage_0(map)                              blocks of W-MSA / SW-MSA, width C
map    = stage_i(map), i > 0                       patch merging (stride x2, width x2), blocks
map    = LN(map)                                   forward_features(): (B, H/32, W/32, 8C) at P=4
logits = head(mean over the map)                   forward_head()

Windows are clamped to a stage's map where the map is smaller (no shift along that axis then);
a map whose sides the window does not tile is padded with zeros at the bottom and right inside
each block, and an odd map is padded before merging, as in timm (see swin_layers). Images must
have the configured size (timm's default strict_img_size); set_image_size() changes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from vitlab.config import ConfigError, check_keys, pair, validate
from vitlab.models.classifier import ClassifierApi
from vitlab.models.indices import chosen_indices, positive
from vitlab.models.swin_layers import (
    TABLE_RESAMPLING,
    StageSpec,
    SwinPatchEmbed,
    SwinStage,
    WindowAttention,
)


@dataclass
class SwinConfig:
    """Everything that defines a Swin Transformer. Defaults are Swin-T at 224 for ImageNet."""

    family: ClassVar[str] = "swin"

    img_size: int | tuple[int, int] = 224  # one side, or (height, width)
    patch_size: int = 4
    in_chans: int = 3
    num_classes: int = 1000  # 0: no classifier, forward() returns pooled features
    embed_dim: int = 96  # C, the first stage's width; stage i has C * 2^i
    depths: tuple[int, ...] = (2, 2, 6, 2)  # blocks per stage
    num_heads: tuple[int, ...] = (3, 6, 12, 24)  # heads per stage
    window_size: int | tuple[int, int] = 7  # M, one side or (height, width), every stage
    mlp_ratio: float = 4.0  # MLP width int(C_i * mlp_ratio)
    qkv_bias: bool = True
    dropout: float = 0.0  # after the attention projection and in the MLP (timm's proj_drop_rate)
    attn_dropout: float = 0.0
    drop_path: float = 0.1  # stochastic depth of the last block; linear from 0 over all blocks
    head_dropout: float = 0.0  # before the classifier (timm's drop_rate)
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        validate(self)
        (h, w), p = self.img_hw, self.patch_size
        positive(img_size=self.img_size, window_size=self.window_size, patch_size=p,
                 in_chans=self.in_chans, embed_dim=self.embed_dim)  # fmt: skip
        if self.num_classes < 0:
            raise ConfigError(f"num_classes must be >= 0, got {self.num_classes}")
        if h % p or w % p:
            raise ConfigError(f"img_size {h}x{w} is not a multiple of patch_size {p}")
        if not self.depths or len(self.depths) != len(self.num_heads):
            raise ConfigError(
                f"depths and num_heads need one entry per stage (at least one), got depths "
                f"{self.depths} and num_heads {self.num_heads}"
            )
        if min(self.depths) <= 0 or min(self.num_heads) <= 0:
            raise ConfigError(
                f"depths and num_heads must be positive, got {self.depths}, {self.num_heads}"
            )
        for i, (dim, heads) in enumerate(zip(self.stage_dims, self.num_heads)):
            if dim % heads:
                raise ConfigError(
                    f"stage {i} width {dim} (embed_dim {self.embed_dim} x 2^{i}) is not divisible "
                    f"by its num_heads {heads}"
                )
        if int(self.embed_dim * self.mlp_ratio) <= 0:
            raise ConfigError(f"mlp_ratio must be positive, got {self.mlp_ratio}")
        for name in ("dropout", "attn_dropout", "drop_path", "head_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.norm_eps <= 0:
            raise ConfigError(f"norm_eps must be positive, got {self.norm_eps}")

    @property
    def img_hw(self) -> tuple[int, int]:
        return pair(self.img_size)

    @property
    def window_hw(self) -> tuple[int, int]:
        return pair(self.window_size)

    @property
    def grid(self) -> tuple[int, int]:
        """The first stage's map: img_hw // patch_size."""
        h, w = self.img_hw
        return h // self.patch_size, w // self.patch_size

    @property
    def num_stages(self) -> int:
        return len(self.depths)

    @property
    def stage_dims(self) -> tuple[int, ...]:
        return tuple(self.embed_dim * 2**i for i in range(self.num_stages))

    @property
    def num_features(self) -> int:
        """Width of the last stage, of forward_features and of the pooled vector."""
        return self.stage_dims[-1]

    def stage_grid(self, i: int) -> tuple[int, int]:
        """Stage i's map: the patch grid halved i times, rounding up (odd sides are padded)."""
        h, w = self.grid
        return -(-h // 2**i), -(-w // 2**i)

    def stage(self, i: int) -> StageSpec:
        """What stage i's blocks are built from."""
        grid = self.stage_grid(i)
        window = tuple(min(m, n) for m, n in zip(self.window_hw, grid))
        shift = tuple(0 if n <= m else m // 2 for m, n in zip(window, grid))
        dim = self.stage_dims[i]
        return StageSpec(
            embed_dim=dim,
            num_heads=self.num_heads[i],
            mlp_dim=int(dim * self.mlp_ratio),
            grid=grid,
            window=window,
            shift=shift,
            qkv_bias=self.qkv_bias,
            dropout=self.dropout,
            attn_dropout=self.attn_dropout,
            norm_eps=self.norm_eps,
        )

    def replace(self, **changes: object) -> SwinConfig:
        """A copy with `changes` applied; unknown keys and wrong types raise ConfigError."""
        check_keys(SwinConfig, changes.keys())
        return dataclasses.replace(self, **changes)


class PooledHead(nn.Module):
    """Global average pooling of the (B, H, W, C) map, dropout, then the classifier `fc`
    (timm's ClassifierHead names)."""

    def __init__(self, dim: int, num_classes: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.fc: nn.Module = nn.Linear(dim, num_classes) if num_classes else nn.Identity()

    def forward(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = self.drop(x.mean(dim=(1, 2)))  # (B, C)
        return x if pre_logits else self.fc(x)


class SwinTransformer(ClassifierApi, nn.Module):
    """Swin Transformer built from one SwinConfig, with timm's module names."""

    num_prefix_tokens = 0  # no class token: features are a map
    classifier_name = "head.fc"

    def __init__(self, config: SwinConfig) -> None:
        super().__init__()
        cfg = self.config = config
        self.patch_embed = SwinPatchEmbed(
            cfg.img_hw, cfg.patch_size, cfg.in_chans, cfg.embed_dim, cfg.norm_eps
        )
        rates = torch.linspace(0, cfg.drop_path, sum(cfg.depths), device="cpu").tolist()
        stages, start, in_dim = [], 0, cfg.embed_dim
        for i, depth in enumerate(cfg.depths):
            spec = cfg.stage(i)
            stages.append(SwinStage(spec, in_dim, depth, rates[start : start + depth], i > 0))
            start, in_dim = start + depth, spec.embed_dim
        self.layers = nn.ModuleList(stages)
        self.num_features = cfg.num_features
        self.norm = nn.LayerNorm(self.num_features, eps=cfg.norm_eps)
        self.head = PooledHead(self.num_features, cfg.num_classes, cfg.head_dropout)
        self.grad_checkpointing = False
        self.preprocessing = None  # a vitlab.preprocessing.Preprocessing when the weights have one
        self.classes: list[str] | None = None  # class names, likewise
        self.init_weights()

    # --- construction ----------------------------------------------------------------------------

    def init_weights(self) -> None:
        """timm's init: truncated normal(0.02) Linear weights (classifier included) and relative
        position tables, zero biases, LayerNorm ones and zeros, PyTorch's default for the patch
        convolution."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Conv2d):
                m.reset_parameters()
            elif isinstance(m, WindowAttention):
                nn.init.trunc_normal_(m.relative_position_bias_table, std=0.02)

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the classifier by a zero-initialised one for `num_classes` (0: none), as
        VisionTransformer.reset_classifier does (class names of another count dropped)."""
        self.config = self.config.replace(num_classes=num_classes)
        self.classes = self.classes if len(self.classes or ()) == num_classes else None
        head: nn.Module = nn.Identity()
        if num_classes:
            ref = self.norm.weight
            head = nn.Linear(self.num_features, num_classes, device=ref.device, dtype=ref.dtype)
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        self.head.fc = head

    def set_image_size(
        self,
        img_size: int | tuple[int, int],
        window_size: int | tuple[int, int] | None = None,
        table_resampling: str = "bicubic",
    ) -> None:
        """Change the input resolution and, when given, the window (the configured M; each stage
        clamps it to its map). Relative position tables are resampled to each block's new window
        (swin_layers.resample_rel_pos_table: 'bicubic', the official Swin code's fine-tuning, or
        'timm', as timm's checkpoint loader), masks and indices rebuilt; all other weights are
        kept. The model is then the one SwinConfig.replace(img_size=..., window_size=...) builds.
        Unlike timm's set_input_size, the window is not scaled with the image: pass window_size
        (e.g. 12 for 384 from a 224 / window 7 model)."""
        if table_resampling not in TABLE_RESAMPLING:
            raise ValueError(
                f"table_resampling must be one of {TABLE_RESAMPLING}, got {table_resampling!r}"
            )
        changes: dict[str, object] = {"img_size": img_size}
        if window_size is not None:
            changes["window_size"] = window_size
        cfg = self.config.replace(**changes)
        self.patch_embed.set_image_size(cfg.img_hw)
        for i, stage in enumerate(self.layers):
            stage.set_spec(cfg.stage(i), table_resampling)
        self.config = cfg
        if self.preprocessing is not None:  # inputs are now resized to the new size
            self.preprocessing = dataclasses.replace(self.preprocessing, img_size=cfg.img_hw)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass instead of storing them."""
        self.grad_checkpointing = enable
        for stage in self.layers:
            stage.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Names of the parameters AdamW should not decay: biases, norm scales and the relative
        position tables."""
        return {
            name
            for name, p in self.named_parameters()
            if p.ndim <= 1 or "relative_position_bias_table" in name
        }

    # --- forward ---------------------------------------------------------------------------------

    def _stages(self, x: Tensor) -> Iterator[Tensor]:
        """(B, C, H, W) images -> each stage's output map (B, h_i, w_i, C_i), before the final
        LayerNorm."""
        x = self.patch_embed(x)  # (B, H/P, W/P, C)
        for stage in self.layers:
            x = stage(x)
            yield x

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, h, w, C_last) last stage map after the final LayerNorm (channels
        last, as timm's), h = ceil(H / (P 2^(stages - 1)))."""
        x = self.patch_embed(x)
        for stage in self.layers:
            x = stage(x)
        return self.norm(x)

    def forward_head(self, features: Tensor, pre_logits: bool = False) -> Tensor:
        """(B, h, w, C) map -> (B, num_classes) logits, or the pooled (B, num_features) vector
        when `pre_logits` (after the head's dropout)."""
        return self.head(features, pre_logits=pre_logits)

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) images -> (B, num_classes) logits."""
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
        self, x: Tensor, indices: int | Sequence[int] | None = None, norm: bool = False
    ) -> list[Tensor]:
        """The chosen stages' outputs as (B, C_i, h_i, w_i) maps at strides P 2^i (4, 8, 16, 32
        for P = 4), channels first, before the final LayerNorm: timm's forward_intermediates with
        norm=False; `norm` applies the final LayerNorm to the last stage only, as timm does.
        `indices`: an int n (the last n stages) or stage indices (negative allowed); None for
        all. Stops after the last chosen stage."""
        chosen = chosen_indices(indices, len(self.layers), "stage")
        out: list[Tensor] = []
        if not chosen:
            return out
        last = len(self.layers) - 1
        for i, feats in enumerate(self._stages(x)):
            if i in chosen:
                feats = self.norm(feats) if norm and i == last else feats
                out.append(feats.permute(0, 3, 1, 2).contiguous())
            if i == chosen[-1]:
                break
        return out
