"""`vitlab cost` for a CNN baseline (torchvision's ResNets, BiT's ResNet-v2-50): per stage, the
map, its channels and what one forward pass multiplies there, counted as the model computes it
(models.cnn, models.resnetv2), plus the parameters of the real module.

A convolution with a k_h x k_w kernel from C_in to C_out channels (groups 1) that outputs an
H_out x W_out map multiplies k_h k_w C_in C_out H_out W_out times (MACs); a 3x3 stride-2 conv with
padding 1 (and a 1x1 stride-2 one) outputs ceil(H / 2). Per stage i (width w = 64 2^i, stride 2
from the second stage on, in the first block):
    basic block:        3x3 C_in -> w (the stride), 3x3 w -> w
    bottleneck block:   1x1 C_in -> w, 3x3 w -> w (the stride), 1x1 w -> 4w (torchvision's v1.5,
                        and BiT's units, whose SAME padding gives the same ceil(H / 2) maps)
    downsample:         1x1 C_in -> C_out (the stride), where the map or the width changes
    stem:               7x7 stride 2 C_in -> 64, then a 3x3 stride-2 max-pool; small: 3x3 stride 1
    head:               C_last x classes (fc, or BiT's 1x1 head.fc on the pooled map)
Only convolutions and the classifier multiply (as torch.utils.flop_counter counts them);
BatchNorm / GroupNorm, the weight standardisation, ReLU, the residual additions and the pooling
are left out, as in torchvision's published figures (ResNet-18 at 224: 1.81 G, which torchvision
calls GFLOPS).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from vitlab.analysis.tables import human, table
from vitlab.models.cnn import CNN, STEM_WIDTH, CNNConfig
from vitlab.models.registry import ModelConfig, build_model, named_config


@dataclass
class CNNStageCost:
    stage: int
    grid: list[int]  # (h, w): the stage's output map
    stride: int  # input pixels per map pixel
    in_channels: int
    width: int  # w: the 3x3 convs' channels
    channels: int  # C_out
    blocks: int
    conv_macs: int  # the blocks' convolutions, downsample left out
    downsample_macs: int
    macs: int
    params: int  # the stage's module


def _half(n: int) -> int:
    """A side after a stride-2 conv (3x3 padding 1, 1x1 padding 0) or max-pool (3x3 padding 1)."""
    return -(-n // 2)


def stem_cost(cfg: CNNConfig) -> tuple[list[int], int]:
    """The first stage's input map (h, w) and conv1's MACs."""
    (h, w), c = cfg.img_hw, cfg.in_chans
    if cfg.uses_small_stem:
        return [h, w], 9 * c * STEM_WIDTH * h * w
    h, w = _half(h), _half(w)  # conv1, 7x7 stride 2
    return [_half(h), _half(w)], 49 * c * STEM_WIDTH * h * w  # then the max-pool


def stage_costs(cfg: CNNConfig, params: dict[str, int] | None = None) -> list[CNNStageCost]:
    """What each stage of `cfg` computes per image; `params` (cnn_param_breakdown) is recorded as
    given."""
    (h, w), _ = stem_cost(cfg)
    c_in, stride, out = STEM_WIDTH, cfg.stem_stride, []
    for i, depth in enumerate(cfg.depths):
        width, c_out = STEM_WIDTH * 2**i, cfg.stage_dims[i]
        convs = down = 0
        for j in range(depth):
            step = 2 if i and not j else 1
            h2, w2 = (_half(h), _half(w)) if step == 2 else (h, w)
            if cfg.bottleneck:
                convs += c_in * width * h * w + 9 * width * width * h2 * w2
                convs += width * c_out * h2 * w2
            else:
                convs += 9 * c_in * width * h2 * w2 + 9 * width * width * h2 * w2
            if step == 2 or c_in != c_out:
                down += c_in * c_out * h2 * w2
            h, w, c_in = h2, w2, c_out
        stride *= 2 if i else 1
        out.append(
            CNNStageCost(
                stage=i,
                grid=[h, w],
                stride=stride,
                in_channels=STEM_WIDTH if i == 0 else cfg.stage_dims[i - 1],
                width=width,
                channels=c_out,
                blocks=depth,
                conv_macs=convs,
                downsample_macs=down,
                macs=convs + down,
                params=(params or {}).get(stage_names(cfg)[i], 0),
            )
        )
    return out


def stage_names(cfg: CNNConfig) -> list[str]:
    """The stages' module names: layer1 ... layer4, or BiT's stages.0 ... stages.3."""
    return [f"stages.{i}" if cfg.bit else f"layer{i + 1}" for i in range(len(cfg.depths))]


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def cnn_param_breakdown(model: CNN) -> dict[str, int]:
    """Parameters counted from the module: stem (conv1, bn1 or stem.*), each stage by its name
    (stage_names), head (the classifier), total."""
    stages = dict(zip(stage_names(model.config), map(_count, model.stages), strict=True))
    total, head = _count(model), _count(model.classifier)
    return {"stem": total - sum(stages.values()) - head, **stages, "head": head, "total": total}


def cnn_cost_report(
    model: str | ModelConfig,
    img_size: int | tuple[int, int] | None = None,
    label: str | None = None,
) -> dict:
    """Everything `vitlab cost` prints for a CNN (a registered name or a config, under `label`
    where given), as a JSON-ready dict. At another img_size a registered name takes the stem
    create_model(name, img_size=...) gives it (the small one at 32 px and below); a config's
    (a checkpoint's, a run's) stays its own, as ResNet.set_image_size keeps a built model's. The
    module is built on the meta device."""
    name, cfg = named_config(model, label)
    if not isinstance(cfg, CNNConfig):
        raise ValueError(f"{name} is not a CNN (see vitlab.analysis.cost_report)")
    if img_size is not None:
        named = isinstance(model, str) and cfg.small_stem is None  # as create_model builds it
        cfg = cfg.replace(img_size=img_size, small_stem=None if named else cfg.uses_small_stem)
    with torch.device("meta"):
        params = cnn_param_breakdown(build_model(cfg))
    grid, stem_macs = stem_cost(cfg)
    stages = stage_costs(cfg, params)
    head_macs = cfg.num_features * cfg.num_classes
    total = stem_macs + sum(s.macs for s in stages) + head_macs
    return {
        "model": name,
        "family": "cnn",
        "arch": cfg.arch,
        "title": cfg.title,
        "img_size": list(cfg.img_hw),
        "in_chans": cfg.in_chans,
        "num_classes": cfg.num_classes,
        "small_stem": cfg.uses_small_stem,
        "depths": list(cfg.depths),
        "bottleneck": cfg.bottleneck,
        "params": params,
        "params_share": {k: v / params["total"] for k, v in params.items() if k != "total"},
        "stem": {"grid": grid, "stride": cfg.stem_stride, "macs": stem_macs},
        "stage_names": stage_names(cfg),
        "stages": [asdict(s) for s in stages],
        "head_macs": head_macs,
        "forward_macs": total,
    }


def format_cnn_cost_report(report: dict) -> str:
    """The CNN report as readable text tables."""
    h, w = report["img_size"]
    stem = "standard stem (7x7 stride-2 conv, 3x3 stride-2 max-pool)"
    if report["small_stem"]:
        stem = "small stem (3x3 stride-1 conv, no max-pool)"
    kind = "bottleneck" if report["bottleneck"] else "basic"
    lines = [
        f"{report['model']}: {report['title']}, {h}x{w}x{report['in_chans']} image, {stem}, "
        f"{kind} blocks {'-'.join(map(str, report['depths']))}, {report['num_classes']} classes",
        "",
        "Cost by stage, per image (MACs of the convolutions, k_h k_w C_in C_out H_out W_out):",
    ]
    params, st = report["params"], report["stem"]
    header = ["stage", "map", "stride", "channels", "blocks", "convs", "downsample", "MACs"]
    header += ["share", "params"]
    total = report["forward_macs"]
    rows = [["stem", "x".join(map(str, st["grid"])), str(st["stride"]), "64", "", "", ""]]
    rows[0] += [human(st["macs"]), f"{100 * st['macs'] / total:.1f}%", f"{params['stem']:,}"]
    for name, s in zip(report["stage_names"], report["stages"], strict=True):
        rows.append(
            [
                name,
                "x".join(map(str, s["grid"])),
                str(s["stride"]),
                f"{s['in_channels']}->{s['channels']}",
                str(s["blocks"]),
                human(s["conv_macs"]),
                human(s["downsample_macs"]),
                human(s["macs"]),
                f"{100 * s['macs'] / total:.1f}%",
                f"{s['params']:,}",
            ]
        )
    rows.append(["pool + fc"] + [""] * 6 + [human(report["head_macs"])])
    rows[-1] += [f"{100 * report['head_macs'] / total:.1f}%", f"{params['head']:,}"]
    rows.append(["total"] + [""] * 6 + [human(total), "100.0%", f"{params['total']:,}"])
    lines += table(header, rows)
    lines += [
        "",
        f"Forward pass: {human(total)}MACs per image ({human(2 * total)}FLOPs), convolutions and "
        f"the classifier only. Parameters: {params['total']:,}.",
    ]
    return "\n".join(lines)
