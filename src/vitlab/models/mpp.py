"""Masked patch prediction (the paper's §4.6 and appendix B.1.2): self-supervised pre-training of a
ViT without labels, as BERT's masked language modelling carried over to patches.

    corrupt   share `corrupt` of each image's patch embeddings, drawn without replacement; of
              those, `mask` replaced by a learned [mask] embedding, `random` by the embedding of
              another patch of the batch, the rest left as they are (the paper: 50%; 80/10/10)
    predict   from each corrupted patch's output token, by one linear layer, its
              mean_color  3-bit mean colour: each channel's mean over the patch (pixels in [0, 1])
                          quantised to `bits` bits, one class of 2^(bits*C) (512 for RGB, 8 gray)
              patch_l2    its pixels as the model sees them (normalised by the dataset's statistics)
    loss      cross-entropy (mean_color) or mean squared error (patch_l2), over corrupted patches

The head and the [mask] embedding live under `mpp.` in the state dict; a ViT read from such a
checkpoint (vitlab.formats.vitlab) leaves them out, so fine-tuning starts from the encoder alone.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from vitlab.config import ConfigError, MPPConfig
from vitlab.models.vit import VisionTransformer, ViTConfig
from vitlab.runtime import random_stream

log = logging.getLogger(__name__)
PREFIX = "mpp."  # state-dict names of the pre-training parts


def mean_color_classes(pixels: Tensor, patch: int, bits: int) -> Tensor:
    """(B, C, H, W) pixels in [0, 1] -> (B, N) classes, patches in row-major order: channel c's
    mean over the patch quantised to q_c = min(floor(mean * 2^bits), 2^bits - 1), and the class
    sum_c q_c * 2^(bits * (C - 1 - c)) (the first channel most significant). The pixels are read
    as 8-bit values (the nearest of 0, 1/255, ..., 1: an image's own, whatever float error the
    normalisation's round trip added) and the floor taken on their integer sums, exactly: a mean
    on a class edge (0.5 of 0 and 255 halves) is the class above, not below by a rounding."""
    levels = 2**bits
    values = (pixels.float().clamp(0.0, 1.0) * 255).round()
    sums = F.avg_pool2d(values, patch, divisor_override=1).long()  # (B, C, H/P, W/P), exact
    q = (sums * levels).div(255 * patch * patch, rounding_mode="floor").clamp_(0, levels - 1)
    c = pixels.shape[1]
    weights = levels ** torch.arange(c - 1, -1, -1, device=pixels.device)
    return (q * weights.view(1, c, 1, 1)).sum(dim=1).flatten(1)


def patch_pixels(images: Tensor, patch: int) -> Tensor:
    """(B, C, H, W) -> (B, N, C*P*P): each patch's values, channel-major, patches row-major."""
    return F.unfold(images.float(), patch, stride=patch).transpose(1, 2)


class Corruption(NamedTuple):
    """Which patches one draw corrupts, as (B, N) masks; `masked` and `replaced` are subsets of
    `corrupted`, the rest of it is left unchanged."""

    corrupted: Tensor
    masked: Tensor
    replaced: Tensor


def draw_corruption(
    batch: int,
    patches: int,
    cfg: MPPConfig,
    device: torch.device | str,
    generator: torch.Generator | None = None,
) -> Corruption:
    """round(corrupt * N) patches per image (at least one), uniformly without replacement; each of
    them masked with probability `mask`, replaced with probability `random`. Drawn from
    `generator`, else from the default random stream."""
    k = max(1, round(cfg.corrupt * patches))
    order = torch.rand(batch, patches, device=device, generator=generator).argsort(dim=1)
    corrupted = torch.zeros(batch, patches, dtype=torch.bool, device=device)
    corrupted.scatter_(1, order[:, :k], True)
    u = torch.rand(batch, patches, device=device, generator=generator)
    masked = corrupted & (u < cfg.mask)
    replaced = corrupted & (u >= cfg.mask) & (u < cfg.mask + cfg.random)
    return Corruption(corrupted, masked, replaced)


class MPPHead(nn.Module):
    """The [mask] embedding and the linear prediction layer."""

    def __init__(self, dim: int, outputs: int) -> None:
        super().__init__()
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.head = nn.Linear(dim, outputs)
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def corrupt(
        self, emb: Tensor, plan: Corruption, generator: torch.Generator | None = None
    ) -> Tensor:
        """(B, N, D) patch embeddings with the plan's patches masked or replaced (by the
        uncorrupted embedding of a uniformly drawn other patch of the batch)."""
        b, n, d = emb.shape
        out = torch.where(plan.masked[..., None], self.mask_token.to(emb.dtype), emb)
        where = plan.replaced.flatten().nonzero().squeeze(1)  # flat indices into (B*N)
        if where.numel():
            other = torch.randint(
                0, b * n - 1, (where.numel(),), device=emb.device, generator=generator
            )
            other += (other >= where).long()  # any patch but itself
            out = out.reshape(b * n, d).index_copy(0, where, emb.reshape(b * n, d)[other])
            out = out.reshape(b, n, d)
        return out


class MaskedPatchViT(VisionTransformer):
    """A ViT (without classifier) with the masked-patch-prediction head. forward(images) ->
    (predictions, targets) of the corrupted patches: (M, 2^(bits*C)) logits and (M,) classes for
    mean_color, (M, C*P*P) values and targets for patch_l2 (M: corrupted patches in the batch)."""

    def __init__(
        self,
        config: ViTConfig,
        mpp: MPPConfig,
        mean: tuple[float, ...],
        std: tuple[float, ...],
    ) -> None:
        if config.num_classes != 0:
            raise ConfigError(
                f"masked patch prediction trains no classifier: model.num_classes must be 0, got "
                f"{config.num_classes}"
            )
        if config.representation_size:  # its weights would get no gradient (DDP refuses that)
            raise ConfigError(
                f"masked patch prediction predicts from patch tokens and has no use for the "
                f"pre-logits layer (representation_size={config.representation_size}): set "
                f"model.representation_size=null"
            )
        if mpp.target == "mean_color" and mpp.bits * config.in_chans > 12:
            raise ConfigError(
                f"mpp.bits={mpp.bits} with {config.in_chans} channels makes "
                f"2^{mpp.bits * config.in_chans} colour classes; at most 2^12 (e.g. 3 bits x 3 "
                f"channels = 512, the paper's)"
            )
        if config.stem != "patch":
            log.warning(
                "masked patch prediction with stem=%s: its receptive fields overlap neighbouring "
                "patches, so their tokens carry part of a corrupted patch's pixels",
                config.stem,
            )
        super().__init__(config)
        self.mpp_config = mpp
        c, p = config.in_chans, config.patch_size
        outputs = 2 ** (mpp.bits * c) if mpp.target == "mean_color" else c * p * p
        self.mpp = MPPHead(config.embed_dim, outputs)
        self.register_buffer("pixel_mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    def no_weight_decay(self) -> set[str]:
        return super().no_weight_decay() | {"mpp.mask_token"}

    def targets(self, images: Tensor) -> Tensor:
        """(B, N) mean-colour classes or (B, N, C*P*P) pixel targets of model-input images."""
        p = self.config.patch_size
        if self.mpp_config.target == "patch_l2":
            return patch_pixels(images, p)
        pixels = (images.float() * self.pixel_std + self.pixel_mean).clamp(0.0, 1.0)
        return mean_color_classes(pixels, p, self.mpp_config.bits)

    def forward(
        self,
        images: Tensor,
        scored: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Predictions and targets of the corrupted patches of the images that `scored` (B,)
        marks (default: all); the corruption is drawn from `generator` (default: this thread's
        random_stream, else the default random stream)."""
        generator = random_stream() if generator is None else generator
        targets = self.targets(images)
        plans: list[Corruption] = []

        def corrupt(emb: Tensor) -> Tensor:
            b, n = emb.shape[:2]
            plans.append(draw_corruption(b, n, self.mpp_config, emb.device, generator))
            return self.mpp.corrupt(emb, plans[0], generator)

        tokens = self.forward_features(images, corrupt)[:, self.num_prefix_tokens :]
        if self.fc_norm is not None:  # the final LayerNorm of a model that normalises after pooling
            tokens = self.fc_norm(tokens)
        chosen = plans[0].corrupted
        if scored is not None:
            chosen = chosen & scored[:, None]
        return self.mpp.head(tokens[chosen]), targets[chosen]


def mpp_loss(predictions: Tensor, targets: Tensor, target: str) -> tuple[Tensor, Tensor | None]:
    """(loss, number of corrupted patches predicted right; None for regression)."""
    if target == "patch_l2":
        return F.mse_loss(predictions.float(), targets), None
    loss = F.cross_entropy(predictions.float(), targets)
    return loss, (predictions.argmax(dim=1) == targets).sum()
