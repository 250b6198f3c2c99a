"""`vitlab cost` for a Swin Transformer: per stage, the map, its windows and what one forward pass
multiplies there, counted as the model computes it (swin_layers), plus the parameters of the real
module.

Stage i has a map of N = h w tokens (the patch grid halved i times, rounding up), width C, heads h,
MLP width M_mlp and a window of M^2 = Mh Mw tokens (the configured window clamped to the map). A
block pads the map at the bottom and right to whole windows, Np = Hp Wp tokens in Np / M^2 windows,
and runs attention and its qkv / proj on the padded map; the MLP runs on the N real tokens:
    attention products (QK^T and AV), per block:   2 Np M^2 C        (= 2 N M^2 C without padding)
    linear layers, per block:                      4 Np C^2 + 2 N C M_mlp   (qkv, proj; MLP)
    patch merging into stage i > 0:                N (4 C_{i-1}) C
    patch embedding:                               N_0 P^2 C_in C;  head: C_last x classes
    attention matrices of one block, per image:    windows x heads x (M^2)^2 fp32 numbers
Only matrix products are counted (as torch.utils.flop_counter counts them): Swin-T at 224 is
4,490,566,656 MACs; fvcore (timm's table: 4.51 G) also counts the LayerNorms.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from vitlab.analysis.tables import byte_size, human, table
from vitlab.models.registry import ModelConfig, named_config
from vitlab.models.swin import SwinConfig, SwinTransformer


@dataclass
class SwinStageCost:
    stage: int
    grid: list[int]  # (h, w): the stage's map
    tokens: int  # N = h w
    padded_grid: list[int]  # (Hp, Wp): the map padded to whole windows
    window: list[int]  # (Mh, Mw), clamped to the map
    window_tokens: int  # M^2 = Mh Mw
    shift: list[int]  # the shifted blocks' roll; 0 along an axis the window covers
    windows: int  # per image: Np / M^2
    blocks: int
    width: int  # C
    heads: int
    mlp_dim: int
    stride: int  # input pixels per token side: P 2^i
    attention_macs_per_block: int  # 2 Np M^2 C
    linear_macs_per_block: int  # 4 Np C^2 + 2 N C M_mlp
    merge_macs: int  # patch merging into the stage (0 for the first)
    attention_macs: int  # all blocks
    linear_macs: int  # all blocks and the patch merging
    attention_share: float
    attention_matrix_bytes: int  # one block, one image, fp32
    params: int  # the stage's module: patch merging and blocks


def stage_cost(cfg: SwinConfig, i: int, params: int = 0) -> SwinStageCost:
    """What stage i of `cfg` computes per image; `params` is recorded as given (the module's
    count, swin_param_breakdown)."""
    spec = cfg.stage(i)
    (h, w), (hp, wp), (mh, mw) = spec.grid, spec.padded, spec.window
    n, n_pad, m2, c = h * w, hp * wp, mh * mw, spec.embed_dim
    attention = 2 * n_pad * m2 * c
    linear = 4 * n_pad * c * c + 2 * n * c * spec.mlp_dim
    merge = n * 4 * cfg.stage_dims[i - 1] * c if i else 0
    blocks = cfg.depths[i]
    stage_attention, stage_linear = blocks * attention, blocks * linear + merge
    return SwinStageCost(
        stage=i,
        grid=[h, w],
        tokens=n,
        padded_grid=[hp, wp],
        window=[mh, mw],
        window_tokens=m2,
        shift=list(spec.shift),
        windows=n_pad // m2,
        blocks=blocks,
        width=c,
        heads=spec.num_heads,
        mlp_dim=spec.mlp_dim,
        stride=cfg.patch_size * 2**i,
        attention_macs_per_block=attention,
        linear_macs_per_block=linear,
        merge_macs=merge,
        attention_macs=stage_attention,
        linear_macs=stage_linear,
        attention_share=stage_attention / (stage_attention + stage_linear),
        attention_matrix_bytes=(n_pad // m2) * spec.num_heads * m2 * m2 * 4,
        params=params,
    )


def swin_attention_macs(cfg: SwinConfig) -> int:
    """The attention products (QK^T and AV) of one forward pass, all blocks: sum of 2 Np M^2 C."""
    return sum(stage_cost(cfg, i).attention_macs for i in range(cfg.num_stages))


def swin_param_breakdown(model: SwinTransformer) -> dict[str, int]:
    """Parameters counted from the module: patch_embed, stage_0 ... (patch merging, blocks and their
    relative-position tables), norm, head, total."""
    counts = {"patch_embed": 0, **{f"stage_{i}": 0 for i in range(len(model.layers))}}
    counts |= {"norm": 0, "head": 0}
    for name, p in model.named_parameters():
        part = name.split(".")[0]
        if part == "layers":
            part = f"stage_{name.split('.')[1]}"
        counts[part] += p.numel()
    counts["total"] = sum(counts.values())
    return counts


def swin_cost_report(
    model: str | ModelConfig,
    img_size: int | tuple[int, int] | None = None,
    label: str | None = None,
) -> dict:
    """Everything `vitlab cost` prints for a Swin (a registered name or a config, under `label`
    where given), as a JSON-ready dict. The window stays the configured one at another img_size
    (as SwinTransformer.set_image_size without window_size); each stage clamps it to its map. The
    module is built on the meta device."""
    overrides = {} if img_size is None else {"img_size": img_size}
    name, cfg = named_config(model, label, **overrides)
    if not isinstance(cfg, SwinConfig):
        raise ValueError(f"{name} is not a Swin Transformer (see vitlab.analysis.cost_report)")
    with torch.device("meta"):
        params = swin_param_breakdown(SwinTransformer(cfg))
    stages = [stage_cost(cfg, i, params[f"stage_{i}"]) for i in range(cfg.num_stages)]
    gh, gw = cfg.grid
    patch_macs = gh * gw * cfg.patch_size**2 * cfg.in_chans * cfg.embed_dim
    head_macs = cfg.num_features * cfg.num_classes
    attention = sum(s.attention_macs for s in stages)
    total = patch_macs + attention + sum(s.linear_macs for s in stages) + head_macs
    return {
        "model": name,
        "family": "swin",
        "img_size": list(cfg.img_hw),
        "patch_size": cfg.patch_size,
        "window_size": list(cfg.window_hw),
        "embed_dim": cfg.embed_dim,
        "depths": list(cfg.depths),
        "num_heads": list(cfg.num_heads),
        "mlp_ratio": cfg.mlp_ratio,
        "in_chans": cfg.in_chans,
        "num_classes": cfg.num_classes,
        "params": params,
        "params_share": {k: v / params["total"] for k, v in params.items() if k != "total"},
        "patch_embed": {"grid": [gh, gw], "tokens": gh * gw, "macs": patch_macs},
        "stages": [asdict(s) for s in stages],
        "head_macs": head_macs,
        "attention_macs": attention,
        "linear_macs": total - attention,
        "forward_macs": total,
    }


def format_swin_cost_report(report: dict) -> str:
    """The Swin report as readable text tables."""
    h, w = report["img_size"]
    mh, mw = report["window_size"]
    depths = ", ".join(map(str, report["depths"]))
    heads = ", ".join(map(str, report["num_heads"]))
    lines = [
        f"{report['model']}: {h}x{w} image, patch {report['patch_size']}, window {mh}x{mw}, "
        f"C={report['embed_dim']}, depths ({depths}), heads ({heads}), "
        f"MLP ratio {report['mlp_ratio']:g}",
        "",
        "Cost by stage, per image (MACs; attention 2 N M^2 C per block, linear qkv + proj "
        "4 N C^2 + MLP 2 N C M_mlp per block, plus patch merging):",
    ]
    header = ["stage", "map", "tokens N", "window", "M^2", "windows", "blocks", "C", "heads"]
    header += ["attention", "linear", "attn share", "attn matrix fp32", "params"]
    pe = report["patch_embed"]
    params = report["params"]
    rows = [["patch embed", "x".join(map(str, pe["grid"])), f"{pe['tokens']:,}"]]
    rows[0] += [""] * 6 + ["", human(pe["macs"]), "", "", f"{params['patch_embed']:,}"]
    for s in report["stages"]:
        rows.append(
            [
                str(s["stage"]),
                "x".join(map(str, s["grid"])),
                f"{s['tokens']:,}",
                "x".join(map(str, s["window"])),
                str(s["window_tokens"]),
                f"{s['windows']:,}",
                str(s["blocks"]),
                str(s["width"]),
                str(s["heads"]),
                human(s["attention_macs"]),
                human(s["linear_macs"]),
                f"{100 * s['attention_share']:.1f}%",
                byte_size(s["attention_matrix_bytes"]) + " /block",
                f"{s['params']:,}",
            ]
        )
    rows.append(["norm + head"] + [""] * 9 + [human(report["head_macs"]), "", ""])
    rows[-1].append(f"{params['norm'] + params['head']:,}")
    total, attention = report["forward_macs"], report["attention_macs"]
    rows.append(["total"] + [""] * 8 + [human(attention), human(report["linear_macs"])])
    rows[-1] += [f"{100 * attention / total:.1f}%", "", f"{params['total']:,}"]
    lines += table(header, rows)
    for s in report["stages"]:
        if s["padded_grid"] != s["grid"]:
            lines.append(
                f"stage {s['stage']}: the {s['grid'][0]}x{s['grid'][1]} map is padded to "
                f"{s['padded_grid'][0]}x{s['padded_grid'][1]} (whole windows); attention, qkv and "
                f"proj run on the padded tokens, as the model computes them."
            )
        if s["window"] != report["window_size"]:
            lines.append(
                f"stage {s['stage']}: the window is clamped to the {s['grid'][0]}x{s['grid'][1]} "
                f"map (shift {s['shift'][0]}x{s['shift'][1]})."
            )
    lines += [
        "",
        f"Forward pass: {human(total)}MACs per image ({human(2 * total)}FLOPs), matrix products "
        f"only; attention {human(attention)}MACs. Parameters: {params['total']:,}.",
    ]
    return "\n".join(lines)
