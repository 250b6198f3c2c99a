"""The ViTConfig a ViT state dict (in vitlab's names) was trained with, read from its tensors and
the hints its format states; models.checkpoint dispatches here for ViTs.

From the tensors: width, depth, MLP, patch, prefix tokens (class and distillation tokens),
pooling (fc_norm, no class token), pre-logits, layer scale, qkv bias, classes, a hybrid's ResNet
stem (models.hybrid_checkpoint), and the patch grid from the position table (a square grid with or
without the prefix tokens' rows, or the size the caller names). The heads are in no tensor: the
format's config, the paper's count for its widths, else a head width of 64 (warned).
"""

from __future__ import annotations

import logging
import math

from torch import Tensor

from vitlab.config import ConfigError
from vitlab.formats.base import CheckpointError, Source, pass_key
from vitlab.models.hybrid_checkpoint import infer_resnet_stem
from vitlab.models.vit import ViTConfig

log = logging.getLogger(__name__)
HEADS = pass_key("num_heads") + "; to `vitlab train finetune.from=` model.num_heads=N"
# heads of the paper's widths (Ti, S, B, L, H): every released checkpoint of these widths uses them
_PAPER_HEADS = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}


def read_stated_size(src: Source) -> None:
    """The image size a timm config.json states, moved from src.hints to src.stated_size, when
    the position table is a square grid of another size: timm builds the model at the stated size
    and resamples the table to it (vision_transformer.checkpoint_filter_fn), so the table is read
    at its own size and the model resized after loading (noted). Left in the hints when the table
    fits it, or fits no square grid (infer_vit_config says what), and for a hybrid."""
    s, size = src.state, src.hints.get("img_size")
    table, patch = s.get("pos_embed.weight"), s.get("patch_embed.proj.weight")
    if size is None or table is None or patch is None or patch.ndim != 4:
        return
    if any(k.startswith("patch_embed.backbone.") for k in s):  # a hybrid: its stem's stride
        return
    rows, p = table.shape[1], patch.shape[-1]
    prefix = int("cls_token" in s) + int("dist_token" in s)
    h, w = (size, size) if isinstance(size, int) else size
    n = (h // p) * (w // p)
    square = _square_grid(rows, prefix)
    if rows in (n, n + prefix) or square is None:
        return
    side = math.isqrt(square[0]) * p
    src.stated_size = src.hints.pop("img_size")
    src.notes.append(
        f"config.json states img_size {h}x{w}, but the position table is a {side}x{side} image's "
        f"grid: read at {side} (timm builds the model at {h}x{w}, resampling the table)"
    )


def infer_vit_config(src: Source, img_size: int | tuple[int, int] | None = None) -> ViTConfig:
    s, hints, where = src.state, dict(src.hints), src.where

    def need(key: str) -> Tensor:
        if key not in s:
            raise CheckpointError(f"{where}: no {key} tensor, so not a complete ViT checkpoint")
        return s[key]

    patch = need("patch_embed.proj.weight")
    if patch.ndim != 4:
        raise CheckpointError(
            f"{where}: patch_embed.proj.weight has shape {tuple(patch.shape)}, expected a conv "
            "kernel (D, C, P, P)"
        )
    d, chans, p, _ = patch.shape
    stem = infer_resnet_stem(s, where) or {}  # a hybrid: channels and stride from its ResNet
    if stem:
        chans, p = stem.pop("in_chans"), stem.pop("patch_size")
    depth = len({k.split(".")[1] for k in s if k.startswith("blocks.")})
    for i in range(depth):
        need(f"blocks.{i}.norm1.weight")
    mlp = need("blocks.0.mlp.fc1.weight").shape[0] if depth else 4 * d
    class_token, distilled = "cls_token" in s, "dist_token" in s
    prefix = int(class_token) + int(distilled)
    fc_norm = "fc_norm.weight" in s
    if not fc_norm:
        need("norm.weight")
    heads = hints.pop("num_heads", None) or _PAPER_HEADS.get(d)
    if heads is None:
        if d % 64:
            raise CheckpointError(f"{where}: cannot tell the number of heads of width {d}: {HEADS}")
        heads = d // 64
        log.warning("%s: assuming num_heads=%d (head width 64); if not, %s", where, heads, HEADS)
    no_embed_class, pos_kind = False, "learned"
    img = hints.pop("img_size", None)
    if "pos_embed.weight" in s:
        rows = s["pos_embed.weight"].shape[1]
        square = _square_grid(rows, prefix)
        if img is None and img_size is not None:  # the size asked for, if the table is its
            img = _asked_grid(rows, prefix, p, img_size, square)
        if img is not None:
            h, w = (img, img) if isinstance(img, int) else img
            n = (h // p) * (w // p)
            if rows not in (n, n + prefix):
                raise CheckpointError(
                    f"{where}: position table has {rows} rows; a {h}x{w} image in patches of "
                    f"{p} has {n} (+{prefix} prefix)"
                )
            no_embed_class = rows == n and prefix > 0
        elif square is None:
            raise CheckpointError(
                f"{where}: position table of {rows} rows fits no square grid: pass "
                f"img_size=(H, W), the size it was trained at (`vitlab cost --img-size HxW`; "
                f"`vitlab convert SRC DST img_size=[H,W]` writes a checkpoint that states it)"
            )
        else:
            n, no_embed_class = square
            if no_embed_class:  # or a non-square grid of rows - prefix patches, with prefix rows
                k = math.isqrt(rows)
                src.notes.append(
                    f"the position table's {rows} rows are read as a {k}x{k} grid without "
                    f"rows for the prefix tokens (no_embed_class); weights trained on a "
                    f"non-square grid of {rows - prefix} patches need img_size=(H, W)"
                )
            img = math.isqrt(n) * p
    else:
        pos_kind, img = "none", img if img is not None else img_size  # nothing to resample
        if img is None:
            raise CheckpointError(
                f"{where}: no position table to read the image size from: {pass_key('img_size')}"
            )
    rep = s["pre_logits.fc.weight"].shape[0] if "pre_logits.fc.weight" in s else None
    num_classes = s["head.weight"].shape[0] if "head.weight" in s else 0
    pool = hints.pop("pool", None) or ("gap" if fc_norm or not class_token else "token")
    fields = dict(
        img_size=img,
        patch_size=p,
        in_chans=chans,
        num_classes=num_classes,
        embed_dim=d,
        depth=depth,
        num_heads=heads,
        mlp_dim=mlp,
        class_token=class_token,
        pool=pool,
        pos_embed=pos_kind,
        representation_size=rep,
        no_embed_class=no_embed_class,
        fc_norm=fc_norm,
        distilled=distilled,
        layer_scale=1e-5 if "blocks.0.ls1.gamma" in s else None,
        qkv_bias="blocks.0.attn.qkv.bias" in s or depth == 0,
        **stem,
    )
    fields.update({k: v for k, v in hints.items() if v is not None})
    try:
        return ViTConfig(**fields)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{where}: the tensors describe no valid ViT: {e}") from None


def _square_grid(rows: int, prefix: int) -> tuple[int, bool] | None:
    """A position table of `rows` rows read as a square grid: (patches, no_embed_class), with
    `prefix` rows before the grid's, else (when there are prefix tokens) without them; None when
    neither is square."""
    side = math.isqrt(rows - prefix) if rows > prefix else -1
    if side * side == rows - prefix:
        return rows - prefix, False
    if math.isqrt(rows) ** 2 == rows:
        return rows, prefix > 0
    return None


def _asked_grid(
    rows: int, prefix: int, p: int, img_size: int | tuple[int, int], square: tuple | None
):
    """`img_size` when a position table of `rows` rows (`square`: its square reading) can only
    be its grid: a square grid with its prefix rows is that grid, to be resampled to `img_size`
    (another grid of as many patches would scramble it); one square only without its prefix rows
    is taken as `img_size`'s grid with prefix rows when it has that many; a table that fits no
    square grid, as either reading. None: not `img_size`'s."""
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    n = (h // p) * (w // p)
    if square is not None:
        return img_size if square[1] and rows == n + prefix else None
    return img_size if rows in (n, n + prefix) else None
