"""The Vision Transformer (Dosovitskiy et al., ICLR 2021, Eq. 1-4) and its typed config.

tokens  = [x_class ; patches E] + E_pos          (B, T, D), T = prefix + N
tokens  = Block(tokens) x depth                  pre-LN MSA and MLP, both residual
tokens  = LN(tokens)                             forward_features() returns this
pooled  = tokens[:, 0] (token) | mean of patch tokens (gap)
logits  = head(pre_logits(pooled))               forward_head()

Variants of the checkpoints people bring: positions for the patches only, added before the prefix
tokens are joined (`no_embed_class`, DeiT-3 / big_vision); the final LayerNorm after pooling
(`fc_norm`, timm's avg-pooled models); a DeiT distillation token with its own head, whose logits
are averaged with the class token's (`distilled`); per-channel residual scales (`layer_scale`).
The paper's hybrid (§3.1) is `stem="resnet"`: tokens from a BiT ResNet's feature map
(models/stems.py), patch_size being the ResNet's stride.

forward() with pool='token' computes in the last block only the prefix tokens' rows, all the
head reads (forward_features' head_only): the same logits, less work. In float32 CPU inference
under glibc's default allocator the blocks take a large batch in parts (chunks.batch_chunk).
The analyses' view of the blocks (forward_intermediates) is models.intermediates'.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from vitlab.config import ConfigError, check_keys, pair, validate
from vitlab.models.chunks import batch_chunk
from vitlab.models.classifier import ClassifierApi
from vitlab.models.indices import positive
from vitlab.models.intermediates import IntermediatesApi
from vitlab.models.layers import Block, LayerNorm, lecun_normal_
from vitlab.models.packed import watched
from vitlab.models.patch_embed import PatchEmbed
from vitlab.models.pos_embed import POS_EMBEDS, timm_table_name
from vitlab.models.stems import ConvStem, ResNetStem, stem_problem

PoolKind = Literal["token", "gap"]
PosEmbedKind = Literal["learned", "learned_2d", "relative", "sincos2d", "none"]
ActKind = Literal["gelu", "gelu_tanh"]
StemKind = Literal["patch", "conv", "resnet"]


@dataclass
class ViTConfig:
    """Everything that defines a ViT's architecture. Defaults are ViT-B/16 at 224 for ImageNet."""

    img_size: int | tuple[int, int] = 224  # one side, or (height, width)
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000  # 0: no classifier, forward() returns pooled features
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    class_token: bool = True
    pool: PoolKind = "token"
    pos_embed: PosEmbedKind = "learned"
    representation_size: int | None = None  # pre-logits Linear + tanh (the pre-training head)
    dropout: float = 0.0
    attn_dropout: float = 0.0
    drop_path: float = 0.0  # stochastic depth of the last block; linear from 0 over depth
    act: ActKind = "gelu"  # "gelu_tanh" is the JAX reference's GELU
    norm_eps: float = 1e-6
    qkv_bias: bool = True
    no_embed_class: bool = False  # positions cover the patches only, added before the prefix
    fc_norm: bool = False  # final LayerNorm after pooling instead of over all tokens (timm `avg`)
    distilled: bool = False  # DeiT: a distillation token after the class token, and its own head
    layer_scale: float | None = None  # CaiT / DeiT-3 per-channel residual scale, its initial value
    # "conv": log2(P) stride-2 3x3 convs (more per stage: stem_depths), then 1x1 to D (a small
    # hybrid); "resnet": the paper's hybrid, BiT's ResNet-v2 (models/stems.py) with stride P,
    # then 1x1 to D
    stem: StemKind = "patch"
    stem_width: int = 32  # conv: first layer's channels, doubling; resnet: root's (BiT R50: 64)
    # resnet: units per stage, e.g. (3, 4, 9), P = 4 * 2^(S-1); conv: 3x3 convs per stride-2 stage
    # (the first strided), one number per stage, e.g. (2, 2) at P=4; () is one conv a stage
    stem_depths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        validate(self)
        h, w = self.img_hw
        p = self.patch_size
        positive(img_size=self.img_size, patch_size=p, in_chans=self.in_chans, mlp_dim=self.mlp_dim,
                 embed_dim=self.embed_dim, num_heads=self.num_heads)  # fmt: skip
        negative = {k: v for k, v in (("depth", self.depth), ("num_classes", self.num_classes))
                    if v < 0}  # fmt: skip
        if negative:
            raise ConfigError("; ".join(f"{k} must be >= 0, got {v}" for k, v in negative.items()))
        if h % p or w % p:
            raise ConfigError(f"img_size {h}x{w} is not a multiple of patch_size {p}")
        if self.embed_dim % self.num_heads:
            raise ConfigError(
                f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}"
            )
        if self.pool == "token" and not self.class_token:
            raise ConfigError("pool='token' needs class_token=True; use pool='gap' without it")
        if self.pos_embed == "learned_2d" and self.embed_dim % 2:
            raise ConfigError(
                f"pos_embed='learned_2d' needs an even embed_dim, got {self.embed_dim}"
            )
        if self.pos_embed == "sincos2d" and self.embed_dim % 4:
            raise ConfigError(
                f"pos_embed='sincos2d' needs embed_dim divisible by 4, got {self.embed_dim}"
            )
        if self.representation_size is not None and self.representation_size <= 0:
            raise ConfigError(
                f"representation_size must be positive, got {self.representation_size}"
            )
        for name in ("dropout", "attn_dropout", "drop_path"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.norm_eps <= 0:
            raise ConfigError(f"norm_eps must be positive, got {self.norm_eps}")
        if self.stem == "conv" and (p & (p - 1) or p < 2 or self.stem_width <= 0):
            raise ConfigError(
                f"stem='conv' needs a power-of-two patch_size >= 2 and stem_width > 0, got "
                f"patch_size {p}, stem_width {self.stem_width}"
            )
        problem = stem_problem(self.stem, self.stem_width, self.stem_depths, p)
        if problem:
            raise ConfigError(problem)
        if self.distilled and not (self.class_token and self.pool == "token"):
            raise ConfigError("distilled=True needs class_token=True and pool='token'")
        if self.distilled and (self.fc_norm or self.representation_size):
            raise ConfigError("distilled=True has no fc_norm and no representation_size")

    @property
    def img_hw(self) -> tuple[int, int]:
        return pair(self.img_size)

    @property
    def grid(self) -> tuple[int, int]:
        h, w = self.img_hw
        return h // self.patch_size, w // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + int(self.distilled)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def replace(self, **changes: object) -> ViTConfig:
        """A copy with `changes` applied; unknown keys and wrong types raise ConfigError."""
        check_keys(ViTConfig, changes.keys())
        return dataclasses.replace(self, **changes)


class PreLogits(nn.Module):
    """The paper's pre-training head hidden layer: Linear(D, R) -> tanh."""

    def __init__(self, dim: int, representation_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, representation_size)
        self.act = nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.fc(x))


class VisionTransformer(ClassifierApi, IntermediatesApi, nn.Module):
    """ViT of the paper's family, built from one ViTConfig."""

    classifier_name = "head"  # and head_dist, a distilled model's second head

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        cfg = self.config = config
        d = cfg.embed_dim
        stem = {"conv": ConvStem, "resnet": ResNetStem}.get(cfg.stem)
        if stem is not None:
            args = (cfg.img_hw, cfg.patch_size, cfg.in_chans, d, cfg.stem_width, cfg.stem_depths)
            self.patch_embed = stem(*args)
        else:
            self.patch_embed = PatchEmbed(cfg.img_hw, cfg.patch_size, cfg.in_chans, d)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if cfg.class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, d)) if cfg.distilled else None
        pos_prefix = 0 if cfg.no_embed_class else cfg.num_prefix_tokens
        self.pos_embed = POS_EMBEDS[cfg.pos_embed](cfg.grid, pos_prefix, d)
        self.register_load_state_dict_pre_hook(timm_table_name)  # timm's `pos_embed` tensor
        self.pos_drop = nn.Dropout(cfg.dropout)
        rates = torch.linspace(0, cfg.drop_path, cfg.depth, device="cpu").tolist()
        self.blocks = nn.ModuleList(Block(cfg, drop_path=r) for r in rates)
        self.norm = nn.Identity() if cfg.fc_norm else LayerNorm(d, eps=cfg.norm_eps)
        self.fc_norm = LayerNorm(d, eps=cfg.norm_eps) if cfg.fc_norm else None
        self.pre_logits = PreLogits(d, cfg.representation_size) if cfg.representation_size else None
        self.num_features = cfg.representation_size or d
        self.head = self._new_head(cfg.num_classes)
        self.head_dist = self._new_head(cfg.num_classes) if cfg.distilled else None
        self.grad_checkpointing = False
        self.preprocessing = None  # a vitlab.preprocessing.Preprocessing when the weights have one
        self.classes: list[str] | None = None  # class names, likewise
        self.init_weights()

    # --- construction ----------------------------------------------------------------------------

    def init_weights(self) -> None:
        """The JAX reference init (VIT_REFERENCE.md §1): Xavier-uniform Dense kernels (q, k, v
        each as its own D x D matrix), zero attention biases, normal(1e-6) MLP biases, LeCun-normal
        patch and pre-logits kernels, zero class token, normal(0.02) positions and distillation
        token, zero heads."""
        if self.dist_token is not None:
            nn.init.normal_(self.dist_token, std=0.02)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if name in ("head", "head_dist"):
                    nn.init.zeros_(m.weight)
                elif name.startswith("pre_logits"):
                    lecun_normal_(m.weight)
                elif name.endswith("attn.qkv"):
                    bound = math.sqrt(6.0 / (m.weight.shape[1] * 2))  # fan_in D + fan_out D
                    nn.init.uniform_(m.weight, -bound, bound)
                else:
                    nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    if ".mlp." in name:
                        nn.init.normal_(m.bias, std=1e-6)
                    else:
                        nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Conv2d):
                if ".stem." in name or ".backbone." in name:  # conv -> norm -> ReLU (timm's)
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                else:
                    lecun_normal_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.LayerNorm, nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _new_head(self, num_classes: int) -> nn.Module:
        if num_classes == 0:
            return nn.Identity()
        ref = self.patch_embed.proj.weight
        head = nn.Linear(self.num_features, num_classes, device=ref.device, dtype=ref.dtype)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        return head

    def reset_classifier(self, num_classes: int) -> None:
        """A zero-initialised head for `num_classes` (0: none); class names of another count go."""
        self.config = self.config.replace(num_classes=num_classes)
        self.head = self._new_head(num_classes)
        self.head_dist = self._new_head(num_classes) if self.head_dist is not None else None
        self.classes = self.classes if len(self.classes or ()) == num_classes else None

    def set_image_size(self, img_size: int | tuple[int, int]) -> None:
        """Change the input resolution (same patch size): position embeddings are resampled to the
        new grid (bicubic, prefix tokens untouched); all other weights are kept."""
        cfg = self.config.replace(img_size=img_size)
        self.patch_embed.set_image_size(cfg.img_hw)
        self.pos_embed.set_grid(cfg.grid)
        for blk in self.blocks:
            if blk.attn.rel_pos is not None:
                blk.attn.rel_pos.set_grid(cfg.grid)
        self.config = cfg
        if self.preprocessing is not None:  # inputs are now resized to the new size
            self.preprocessing = dataclasses.replace(self.preprocessing, img_size=cfg.img_hw)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass instead of storing them."""
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Names of the parameters AdamW should not decay: biases, norm scales, the class token and
        the position embeddings (absolute tables and relative offset tables)."""
        tokens = ("cls_token", "dist_token")
        return {
            name
            for name, p in self.named_parameters()
            if p.ndim <= 1 or name in tokens or name.startswith("pos_embed.") or "rel_pos" in name
        }

    @property
    def num_prefix_tokens(self) -> int:
        return self.config.num_prefix_tokens

    # --- forward ---------------------------------------------------------------------------------

    def _embed(self, x: Tensor, corrupt: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """(B, C, H, W) images -> (B, T, D) tokens with prefix tokens and positions; `corrupt`
        changes the (B, N, D) patch embeddings first (masked patch prediction)."""
        x = self.patch_embed(x)  # (B, N, D)
        if corrupt is not None:
            x = corrupt(x)
        if self.config.no_embed_class:
            x = self.pos_embed(x)
        prefix = [t for t in (self.cls_token, self.dist_token) if t is not None]
        if prefix:
            b = x.shape[0]
            x = torch.cat([t.expand(b, -1, -1).to(x.dtype) for t in prefix] + [x], dim=1)
        if not self.config.no_embed_class:
            x = self.pos_embed(x)
        return self.pos_drop(x)

    def forward_features(
        self,
        x: Tensor,
        corrupt: Callable[[Tensor], Tensor] | None = None,
        head_only: bool = False,
    ) -> Tensor:
        """(B, C, H, W) -> (B, T, D) final tokens (after the last LayerNorm); `corrupt` as in
        _embed. `head_only`: with pool='token', only the prefix tokens forward_head reads
        (B, 1 or 2, D), whose rows alone the last block computes: the same values to float
        rounding (the other rows of its q, output projection and MLP are not needed, nor are the
        keys and values: Attention._first_rows); all tokens with pool='gap'."""
        x = self._embed(x, corrupt)
        rows = self._head_rows() if head_only else None
        cfg = self.config  # the widest activation: qkv's or fc1's output, or relative biases
        relative = cfg.num_heads * x.shape[1] if cfg.pos_embed == "relative" else 0
        widest = max(3 * cfg.embed_dim, cfg.mlp_dim, relative)
        parts = batch_chunk(x, widest, self.blocks, self.norm)
        if parts is None:
            return self._encode(x, rows)
        return torch.cat([self._encode(part, rows) for part in x.tensor_split(parts)])

    def _encode(self, x: Tensor, rows: int | None) -> Tensor:
        """The blocks and final norm over x (B, T, D); the last block's first `rows` rows only."""
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            queries = rows if i == last else None
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, False, queries, use_reentrant=False)[0]
            else:
                x = blk(x, queries=queries)[0]
        return self.norm(x)

    def _head_rows(self) -> int | None:
        """How many leading tokens forward_head reads (the prefix tokens with pool='token'), or
        None: all of them, also where a hook (forward or backward, on a module or global)
        watches the last block or the final norm: it would see fewer rows. FSDP's own hooks
        (fully_shard gathers and frees a block's parameters around its forward, whatever it
        returns) do not count."""
        if self.config.pool != "token" or not self.blocks:
            return None
        if watched(*self.blocks[-1].modules(), self.norm):
            return None
        return self.num_prefix_tokens

    def pool(self, tokens: Tensor) -> Tensor:
        """(B, T, D) -> (B, D): the class token (`token`) or the mean of patch tokens (`gap`)."""
        if self.config.pool == "token":
            return tokens[:, 0]
        return tokens[:, self.num_prefix_tokens :].mean(dim=1)

    def forward_head(self, tokens: Tensor, pre_logits: bool = False) -> Tensor:
        """(B, T, D) tokens -> (B, num_classes) logits, or the (B, num_features) vector before the
        classifier (after the pre-logits layer, where there is one) when `pre_logits`. A
        distilled model averages its two tokens' vectors, or its two heads' logits (DeiT)."""
        if self.head_dist is not None:
            x, x_dist = tokens[:, 0], tokens[:, 1]
            if pre_logits:
                return (x + x_dist) / 2
            return (self.head(x) + self.head_dist(x_dist)) / 2
        x = self.pool(tokens)
        if self.fc_norm is not None:
            x = self.fc_norm(x)
        if self.pre_logits is not None:
            x = self.pre_logits(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) images -> (B, num_classes) logits."""
        return self.forward_head(self.forward_features(x, head_only=True))
