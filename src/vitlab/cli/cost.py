"""`vitlab cost`: the paper's cost argument for one model (see vitlab.analysis.cost; a Swin's per
stage, vitlab.analysis.swin_cost; a CNN's, vitlab.analysis.cnn_cost), and attention cost against
image size (--scaling, vitlab.analysis.scaling)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from vitlab.analysis.cost import DEFAULT_PATCH_SIZES, cost_report, format_cost_report
from vitlab.analysis.scaling import (
    DEFAULT_PLOT,
    DEFAULT_SIDES,
    attention_scaling,
    format_scaling,
    plot_path,
    plot_scaling,
)
from vitlab.cli.eval import positive_int_list
from vitlab.config import load_run_config
from vitlab.formats.base import READ_SUFFIXES, CheckpointError
from vitlab.formats.vitlab import vitlab_weights
from vitlab.models.checkpoint import as_stated, infer_config, read_source
from vitlab.models.registry import (
    ModelConfig,
    UnknownModelError,
    config_of,
    family_of,
    named_config,
    resolve_name,
    with_overrides,
)
from vitlab.validation import json_text

log = logging.getLogger(__name__)
DEFAULTS = ",".join(map(str, DEFAULT_PATCH_SIZES))
SIDES = ",".join(map(str, DEFAULT_SIDES))


def parse_size(text: str) -> int | tuple[int, int]:
    """'224' -> 224; '224x320' -> (224, 320)."""
    try:
        parts = [int(v) for v in text.lower().split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size like 224 or 224x320, got {text!r}"
        ) from None
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return parts[0], parts[1]
    raise argparse.ArgumentTypeError(f"expected a size like 224 or 224x320, got {text!r}")


CONFIG_SUFFIXES = (".yaml", ".yml")


def read_model(
    text: str, img_size: int | tuple[int, int] | None = None
) -> tuple[str | ModelConfig, str | None]:
    """MODEL as given on the command line, and the label its report goes under (None: its
    registered name). A path that exists gives the model config it holds, labelled by the path:
    a run config file (.yaml / .yml: the registered config with the file's model overrides, or
    with finetune.from its source's architecture; classes and channels are those the file sets,
    else the model's, not looked up in the data), a run folder (the config of its best, else last
    checkpoint; its config.yaml before the first one), or a checkpoint file or folder of any
    format vitlab reads (a vitlab file's config, else the architecture inferred from the
    tensors). Other text is a registered name or alias; a path holding no model that is also a
    registered name is taken as the name.
    `img_size` (--img-size) is a checkpoint's trained size where its tensors fit it and state
    none (a Swin's tables: no size guessed and warned of)."""
    path = Path(text).expanduser()
    if not path.exists():
        if path.suffix.lower() in (*CONFIG_SUFFIXES, *READ_SUFFIXES):
            raise ValueError(
                f"no file {text}: expected a run config, a checkpoint or a registered model name"
            )
        return text, None
    try:
        return config_at(path, img_size), text
    except CheckpointError as e:
        try:
            return resolve_name(text), None
        except UnknownModelError:
            raise ValueError(f"{text} holds no model vitlab reads: {e}") from None


def config_at(path: Path, img_size: int | tuple[int, int] | None = None) -> ModelConfig:
    """The model config a run config file, a run folder or a checkpoint holds (read_model)."""
    if path.is_dir() and vitlab_weights(path) is None and (path / "config.yaml").is_file():
        path = path / "config.yaml"  # a run before its first checkpoint
    if path.suffix.lower() in CONFIG_SUFFIXES:
        from vitlab.train.build import finetune_source

        run = load_run_config(str(path))
        try:  # a fine-tuning run trains its source's architecture, the model.* keys on top
            base = finetune_source(run)[1] if run.finetune.from_ else None
        except CheckpointError as e:  # a preset's source not trained yet
            log.warning("finetune.from cannot be read (%s): the cost of model.name=%s instead, "
                        "which a fine-tuning run does not use", e, run.model.name)  # fmt: skip
            base = None
        return config_of(run.model) if base is None else with_overrides(base, run.model.overrides)
    src = read_source(path)
    cfg = infer_config(src, img_size)
    return cfg if img_size is not None else as_stated(src, cfg)  # as it loads


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cost",
        help="per-layer cost by patch size (a Swin's and a CNN's per stage), parameters, "
        "crossover length",
        description="Reproduce the paper's cost argument for MODEL's width and heads: for each "
        "patch size, the patch tokens N, attention MACs (2 N^2 D; 3 N^2 D with relative position "
        "embeddings), linear MACs (4 N D^2 + 2 N D M, "
        "= 12 N D^2 when M = 4D), the attention share, and one layer's attention matrix size in "
        "fp32 bytes (heads x T^2 x 4, T = N + prefix tokens); then the model's parameters counted "
        "from the real module, by part with shares; then the crossover length N = 2D + M (= 6D; "
        "(4D + 2M) / 3 with relative position embeddings). "
        "For a Swin (Swin-T ...): per stage the map's tokens N, window tokens M^2 (clamped to the "
        "map), windows per image, blocks, width C, heads, attention MACs (2 N M^2 C per block) and "
        "linear MACs (qkv, proj, MLP, patch merging), one block's attention matrices, parameters; "
        "then the patch embedding, head and totals. For a CNN (resnet18 ...): per stage the map, "
        "its stride, channels, blocks, convolution and downsample MACs (k k C_in C_out H W) and "
        "parameters; then the stem, head and totals. --scaling instead tabulates attention MACs "
        "against the image side beside a second model (--vs) and plots them log-log.",
    )
    p.add_argument(
        "model",
        help="registered name or alias, e.g. B/16, vit_base_patch16_384 or Swin-T; or a path, "
        "its report labelled by the path: a run config (configs/fashion-mnist-95.yaml: the "
        "registered model with the file's model overrides; with finetune.from, the source's "
        "architecture with them), a run folder (its checkpoint's "
        "model), or a checkpoint file or folder of any format vitlab loads",
    )
    p.add_argument(
        "--img-size",
        type=parse_size,
        default=None,
        metavar="S",
        help="input side (or HxW) instead of the model's own; also changes the parameter count "
        "(position embeddings)",
    )
    p.add_argument(
        "--patch-sizes",
        type=positive_int_list,
        default=None,
        metavar="P,P,...",
        help=f"patch sides for the per-layer table (default: those of {DEFAULTS} that tile the "
        "image, and the model's own)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    scaling = p.add_argument_group("attention against image size")
    scaling.add_argument(
        "--scaling",
        action="store_true",
        help="instead of the report: attention MACs at each side of --sides for MODEL and --vs "
        "(a Swin's windows grow linearly with the tokens, a ViT's global attention "
        "quadratically), with growth and ratio, plotted log-log into --out",
    )
    scaling.add_argument(
        "--vs",
        default=None,
        metavar="MODEL",
        help="the model to compare with, named or a path as MODEL (default: B/16 for a Swin, "
        "Swin-T for a ViT)",
    )
    scaling.add_argument(
        "--sides",
        type=positive_int_list,
        default=None,
        metavar="S,S,...",
        help=f"square image sides, multiples of both models' patch sizes (default {SIDES})",
    )
    scaling.add_argument(
        "--out",
        default=None,
        metavar="PATH",
        help=f"where the PNG plot goes (default ./{DEFAULT_PLOT}; PATH.png for a PATH without "
        f"a suffix, {DEFAULT_PLOT} inside an existing folder or PATH/); the path written is "
        "printed",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.scaling:
        return run_scaling(args)
    given = [o for o, v in (("--vs", args.vs), ("--sides", args.sides), ("--out", args.out)) if v]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        raise ValueError(f"{', '.join(given)} {verb} to --scaling only")
    model, label = read_model(args.model, args.img_size)
    report = cost_report(model, args.img_size, args.patch_sizes, label)
    print(json_text(report) if args.json else format_cost_report(report))
    return 0


def run_scaling(args: argparse.Namespace) -> int:
    if args.img_size is not None or args.patch_sizes is not None:
        raise ValueError("--scaling takes image sides from --sides, not --img-size/--patch-sizes")
    plot = plot_path(args.out or Path(DEFAULT_PLOT))  # a path it cannot write: an error first
    model, label = read_model(args.model)
    if args.vs:
        vs, vs_label = read_model(args.vs)
    else:
        vs, vs_label = "B/16" if family_of(named_config(model)[1]) == "swin" else "Swin-T", None
    result = attention_scaling(model, vs, args.sides or DEFAULT_SIDES, (label, vs_label))
    path = plot_scaling(result, plot)
    if args.json:
        print(json_text({**result, "plot": str(path)}))
    else:
        print(f"{format_scaling(result)}\nPlot (log-log): {path}")
    return 0
