"""The paper's cost argument (VIT_REFERENCE.md §3): per-layer attention and linear MACs as the
patch size changes, the parameter breakdown of the real module, and the crossover length.

Per encoder layer with N patch tokens, width D, MLP width M (class token left out of N):
    attention products (QK^T and AV):      2 N^2 D             (3 N^2 D with relative positions:
                                                                q against each offset's vector)
    linear layers (qkv, out, MLP):         4 N D^2 + 2 N D M   (= 12 N D^2 when M = 4D)
    crossover (both equal):                N = 2D + M          (= 6D when M = 4D; relative
                                                                positions: (4D + 2M) / 3)
    attention matrix of one layer:         heads x T^2 fp32 numbers, T = N + prefix tokens

A hybrid's ResNet stem (models/stems.py) is counted conv by conv on its "SAME"-padded maps and
reported as its own part, `backbone`, in the parameters and the forward MACs; a conv stem (early
convolutions) is counted conv by conv as part of `patch_embed`, its 1x1 projection included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vitlab.analysis.cnn_cost import cnn_cost_report, format_cnn_cost_report
from vitlab.analysis.swin_cost import format_swin_cost_report, swin_cost_report
from vitlab.analysis.tables import byte_size, human, table
from vitlab.models.registry import ModelConfig, family_of, named_config
from vitlab.models.stems import (
    conv_stem_channels,
    conv_stem_depths,
    resnet_channels,
    resnet_stride,
)
from vitlab.models.vit import VisionTransformer, ViTConfig

DEFAULT_PATCH_SIZES = (4, 8, 14, 16, 28, 32, 56)
PARAM_GROUPS = ("patch_embed", "cls_token", "pos_embed", "blocks", "norm", "pre_logits", "head")
_GROUP_OF = {"dist_token": "cls_token", "fc_norm": "norm", "head_dist": "head"}


@dataclass
class LayerCost:
    patch_size: int
    tokens: int  # N, patch tokens
    attention_macs: int
    linear_macs: int
    attention_share: float
    attention_matrix_bytes: int


def products(cfg: ViTConfig) -> int:
    """T x T x D products of one attention layer: QK^T and AV, and with relative position
    embeddings the queries against each offset's vector (pos_embed.py's bias)."""
    return 3 if cfg.pos_embed == "relative" else 2


def crossover(cfg: ViTConfig) -> int:
    """Patch tokens N at which one layer's attention products cost its linear layers' MACs."""
    return round((4 * cfg.embed_dim + 2 * cfg.mlp_dim) / products(cfg))


def layer_cost(cfg: ViTConfig, patch_size: int) -> LayerCost:
    """One encoder layer's cost for `cfg`'s width, MLP and heads at another patch size (the image
    is tiled by whole patches; a remainder narrower than a patch is dropped, as the conv does)."""
    h, w = cfg.img_hw
    n = (h // patch_size) * (w // patch_size)
    d, m = cfg.embed_dim, cfg.mlp_dim
    attention = products(cfg) * n * n * d
    linear = 4 * n * d * d + 2 * n * d * m
    t = n + cfg.num_prefix_tokens
    return LayerCost(
        patch_size=patch_size,
        tokens=n,
        attention_macs=attention,
        linear_macs=linear,
        attention_share=attention / (attention + linear) if n else 0.0,
        attention_matrix_bytes=cfg.num_heads * t * t * 4,
    )


def param_breakdown(model: VisionTransformer) -> dict[str, int]:
    """Parameters counted from the module, by part; relative-position tables count as pos_embed,
    a distillation token with the class token, fc_norm with norm and head_dist with head; a
    hybrid's CNN is `backbone` (its 1x1 projection stays patch_embed)."""
    hybrid = model.config.stem == "resnet"
    counts = dict.fromkeys((("backbone",) if hybrid else ()) + PARAM_GROUPS, 0)
    for name, p in model.named_parameters():
        group = "pos_embed" if "rel_pos" in name else name.split(".")[0]
        group = "backbone" if name.startswith("patch_embed.backbone.") else group
        group = _GROUP_OF.get(group, group)
        counts[group] += p.numel()
    counts["total"] = sum(counts.values())
    return counts


def matrix_products(model: torch.nn.Module, x: torch.Tensor) -> Counter[tuple[int, int, int]]:
    """(M, K, N) -> how often model(x) multiplies an M x K matrix by a K x N one (mm and addmm:
    the linear layers as the model runs them, a ViT's last block with its rows cut and a large
    batch in parts under glibc's default allocator: chunks.batch_chunk), inference,
    recorded below autograd by a dispatch mode (module hooks would change what a ViT computes,
    and FlopCounterMode sets global ones)."""
    seen: Counter[tuple[int, int, int]] = Counter()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                a, b = args[-2:]
                seen[(a.shape[0], a.shape[1], b.shape[1])] += 1
            return func(*args, **(kwargs or {}))

    with Record(), torch.no_grad():
        model.eval()(x)
    return seen


def resnet_macs(img_hw: tuple[int, int], in_chans: int, width: int, depths: tuple[int, ...]) -> int:
    """Conv MACs of a hybrid's ResNet (models/stems.py) on an image: every stride-2 layer halves
    the map, rounding up ("SAME"); a unit's 1x1 conv1 runs before its stride, the rest after."""
    h, w = (-(-s // 2) for s in img_hw)  # after the 7x7/2 root conv
    macs = h * w * 49 * in_chans * width
    h, w, c_in = -(-h // 2), -(-w // 2), width  # after the 3x3/2 max-pool
    for i, (units, c) in enumerate(zip(depths, resnet_channels(width, depths))):
        mid = c // 4
        for j in range(units):
            stride = 2 if i and not j else 1
            macs += h * w * c_in * mid  # conv1
            h, w = -(-h // stride), -(-w // stride)
            macs += h * w * (9 * mid * mid + mid * c)  # conv2, conv3
            macs += h * w * c_in * c if j == 0 else 0  # the projected shortcut
            c_in = c
    return macs


def forward_macs(cfg: ViTConfig) -> int:
    """Matrix-product MACs of one forward pass at cfg's own patch size (timm's "GFLOPs")."""
    return sum(macs_by_part(cfg).values())


def macs_by_part(cfg: ViTConfig) -> dict[str, int]:
    """forward_macs by part: a hybrid's CNN (`backbone`), the patch embedding (a stem's
    projection), the encoder blocks, the pre-logits layer and head(s)."""
    n, t, d = cfg.num_patches, cfg.num_patches + cfg.num_prefix_tokens, cfg.embed_dim
    parts = {}
    patch = n * cfg.patch_size**2 * cfg.in_chans * d
    if cfg.stem == "resnet":
        parts["backbone"] = resnet_macs(cfg.img_hw, cfg.in_chans, cfg.stem_width, cfg.stem_depths)
        patch = n * resnet_channels(cfg.stem_width, cfg.stem_depths)[-1] * d
    if cfg.stem == "conv":  # per stage a 3x3 stride-2 conv and stride-1 ones, then the 1x1
        h, w = cfg.img_hw
        patch, c = 0, cfg.in_chans
        stages = conv_stem_depths(cfg.patch_size, cfg.stem_depths)
        for convs, out in zip(stages, conv_stem_channels(cfg.stem_width, stages)):
            h, w = (h + 1) // 2, (w + 1) // 2
            patch += h * w * 9 * (c * out + (convs - 1) * out * out)
            c = out
        patch += n * c * d
    per_layer = products(cfg) * t * t * d + 4 * t * d * d + 2 * t * d * cfg.mlp_dim
    width = cfg.representation_size or d
    heads = 2 if cfg.distilled else 1
    head = d * cfg.representation_size if cfg.representation_size else 0
    head += heads * width * cfg.num_classes
    return {**parts, "patch_embed": patch, "blocks": cfg.depth * per_layer, "head": head}


def default_patch_sizes(cfg: ViTConfig) -> list[int]:
    """The sizes of DEFAULT_PATCH_SIZES that tile the model's image, and the model's own."""
    h, w = cfg.img_hw
    fits = {p for p in DEFAULT_PATCH_SIZES if h % p == 0 and w % p == 0}
    return sorted(fits | {cfg.patch_size})


def cost_report(
    model: str | ModelConfig,
    img_size: int | tuple[int, int] | None = None,
    patch_sizes: Sequence[int] | None = None,
    label: str | None = None,
) -> dict:
    """Everything `vitlab cost` prints, as a JSON-ready dict; patch_sizes defaults to
    default_patch_sizes. `model` is a registered name or alias, or a config (a run's or a
    checkpoint's: `vitlab cost` reads them), reported under `label` where given (named_config).
    The model is built on the meta device, so even H/14 costs no memory. A Swin's report is
    swin_cost_report's (per stage, at its own patch size), a CNN's cnn_cost_report's (per
    stage)."""
    overrides = {} if img_size is None else {"img_size": img_size}
    name, cfg = named_config(model, label, **overrides)
    if family_of(cfg) == "cnn":
        if patch_sizes is not None:
            raise ValueError(f"patch sizes apply to ViTs; {name} is a CNN")
        return cnn_cost_report(model, img_size, label)
    if family_of(cfg) == "swin":
        if patch_sizes is not None:
            raise ValueError(
                f"patch sizes apply to ViTs; {name}'s cost is reported per stage "
                f"at its own patch size {cfg.patch_size}"
            )
        return swin_cost_report(model, img_size, label)
    if patch_sizes is None:
        patch_sizes = default_patch_sizes(cfg)
    for p in patch_sizes:
        if p <= 0 or p > min(cfg.img_hw):
            raise ValueError(f"patch size {p} does not fit a {cfg.img_hw[0]}x{cfg.img_hw[1]} image")
    with torch.device("meta"):
        params = param_breakdown(VisionTransformer(cfg))
    stem = {}
    if cfg.stem == "resnet":
        stem["stem"] = {
            "kind": "resnet",
            "width": cfg.stem_width,
            "depths": list(cfg.stem_depths),
            "stride": resnet_stride(cfg.stem_depths),
            "channels": resnet_channels(cfg.stem_width, cfg.stem_depths)[-1],
        }
    elif cfg.stem == "conv":
        depths = conv_stem_depths(cfg.patch_size, cfg.stem_depths)
        stem["stem"] = {
            "kind": "conv",
            "width": cfg.stem_width,
            "depths": list(depths),
            "stride": cfg.patch_size,
            "channels": conv_stem_channels(cfg.stem_width, depths)[-1],
        }
    return {
        "model": name,
        "img_size": list(cfg.img_hw),
        "patch_size": cfg.patch_size,
        "embed_dim": cfg.embed_dim,
        "mlp_dim": cfg.mlp_dim,
        "num_heads": cfg.num_heads,
        "depth": cfg.depth,
        "num_prefix_tokens": cfg.num_prefix_tokens,
        "params": params,
        "params_share": {k: v / params["total"] for k, v in params.items() if k != "total"},
        "per_layer": [asdict(layer_cost(cfg, p)) for p in patch_sizes],
        "crossover_tokens": crossover(cfg),
        "attention_products": products(cfg),
        "forward_macs": forward_macs(cfg),
        "macs_by_part": macs_by_part(cfg),
        **stem,
    }


def format_cost_report(report: dict) -> str:
    """The report as readable text tables."""
    if report.get("family") == "swin":
        return format_swin_cost_report(report)
    if report.get("family") == "cnn":
        return format_cnn_cost_report(report)
    h, w = report["img_size"]
    d, m, heads = report["embed_dim"], report["mlp_dim"], report["num_heads"]
    products = report.get("attention_products", 2)  # 3 with relative position embeddings
    lines = [
        f"{report['model']}: {h}x{w} image, width D={d}, MLP M={m}, {heads} heads, "
        f"{report['depth']} layers",
        "",
        f"Cost of one encoder layer by patch size (MACs; attention {products}N^2D, linear "
        "4ND^2 + 2NDM):",
    ]
    rows = [
        [
            str(r["patch_size"]),
            f"{r['tokens']:,}",
            human(r["attention_macs"]),
            human(r["linear_macs"]),
            f"{100 * r['attention_share']:.1f}%",
            byte_size(r["attention_matrix_bytes"]),
        ]
        for r in report["per_layer"]
    ]
    header = ["patch", "tokens N", "attention", "linear", "attn share", "attn matrix fp32"]
    lines += table(header, rows)
    lines += ["", f"Parameters (patch size {report['patch_size']}):"]
    params, share = report["params"], report["params_share"]
    rows = [[k, f"{params[k]:,}", f"{100 * share[k]:.2f}%"] for k in share]
    rows.append(["total", f"{params['total']:,}", "100.00%"])
    lines += table(["part", "params", "share"], rows)
    n = report["crossover_tokens"]
    side = (h * w / n) ** 0.5
    formula = "2D + M" if products == 2 else "(4D + 2M) / 3"
    lines += [
        "",
        f"Crossover: attention costs as much as the linear layers at N = {formula} = {n:,} tokens "
        f"(a patch side of {side:.1f} px on {h}x{w}).",
        f"Forward pass: {human(report['forward_macs'])}MACs per image "
        f"({human(2 * report['forward_macs'])}FLOPs), by part:",
    ]
    total = report["forward_macs"]
    rows = [[k, human(v), f"{100 * v / total:.2f}%"] for k, v in report["macs_by_part"].items()]
    lines += table(["part", "MACs", "share"], rows)
    stem = report.get("stem")
    if stem and stem["kind"] == "resnet":
        lines.append(
            f"backbone: the hybrid's ResNet stem, units {stem['depths']} from width "
            f"{stem['width']}, stride {stem['stride']}, {stem['channels']:,} channels projected "
            f"to D by patch_embed."
        )
    elif stem and stem["kind"] == "conv":
        lines.append(
            f"patch_embed: a conv stem, 3x3 convs per stride-2 stage {stem['depths']} from width "
            f"{stem['width']}, stride {stem['stride']}, {stem['channels']:,} channels projected "
            f"to D by a 1x1 conv."
        )
    return "\n".join(lines)
