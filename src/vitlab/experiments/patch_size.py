"""Experiment `patch-size` (paper Fig. 5, Table 6): ViTs with patch sides 2, 4, 7 and 14 on 28x28
images, the hybrid and a ResNet-18, trained the same number of steps; test accuracy against the
training compute each used (vitlab cost's forward MACs x 2 FLOPs x 3 for forward and backward x
the images seen), and the compute-accuracy frontier."""

from __future__ import annotations

from pathlib import Path

from vitlab.analysis.cnn_cost import stage_costs, stem_cost
from vitlab.analysis.cost import forward_macs
from vitlab.experiments import plots
from vitlab.experiments.arms import SHOTS, Arm, Context, model_config
from vitlab.experiments.base import Experiment, Summary, by_group
from vitlab.experiments.verdict import FLOOR_TEXT, accuracy_floor, patch_size_verdict
from vitlab.models.registry import ModelConfig, family_of

NAME = "patch-size"
CNN = "ResNet-18"
PATCHES = (2, 4, 7, 14)
# label -> (slug, throughput class, overrides, is a ViT)
MODELS = {
    **{f"ViT patch {p}": (f"vit-p{p}", f"vit_p{p}", ["model.name=vit_nano_patch4_28",
        "model.stem=patch", f"model.patch_size={p}"], True) for p in PATCHES},
    "hybrid (ResNet stem)": ("hybrid", "hybrid", ["model.name=vit_nano_r_s4_28"], True),
    CNN: ("resnet18", "resnet18", ["model.name=resnet18_28"], False),
}  # fmt: skip


def arms(ctx: Context) -> list[Arm]:
    plan = ctx.plan(NAME)
    return [
        ctx.arm(
            NAME,
            slug,
            label,
            seed,
            kind,
            [*overrides, *(plan.model if vit else plan.cnn)],
            info={"model": label},
        )  # fmt: skip
        for seed in ctx.seed_list(NAME)
        for label, (slug, kind, overrides, vit) in MODELS.items()
    ]


def model_macs(cfg: ModelConfig) -> int:
    """Forward multiply-accumulates of one image, as `vitlab cost` counts them."""
    if family_of(cfg) == "cnn":
        _, stem = stem_cost(cfg)
        return stem + sum(s.macs for s in stage_costs(cfg)) + cfg.num_features * cfg.num_classes
    return forward_macs(cfg)


def summarize(ctx: Context, rows: list[dict], out: Path) -> Summary:
    top1, few = by_group(rows, "top1"), by_group(rows, f"fewshot{SHOTS}")
    first = {r["group"]: r for r in rows}
    macs = {g: model_macs(model_config(ctx.out / first[g]["arm"])) for g in top1}
    flops = {g: 6.0 * macs[g] * first[g]["images_seen"] for g in top1}
    points = {g: (flops[g], top1[g]) for g in top1}
    front = plots.frontier(points, out / "frontier.png", "test top-1 against training compute")
    table = [
        [
            g,
            f"{macs[g] / 1e6:.2f}",
            f"{flops[g]:.3g}",
            top1[g].text(),
            few[g].text(),
            "yes" if g in front else "",
            str(top1[g].n),
        ]  # fmt: skip
        for g in top1
    ]
    floor = accuracy_floor(rows[0]["test_images"], top1.values())
    verdict = patch_size_verdict({g: p for g, p in points.items() if g != CNN}, points[CNN], floor)
    return Summary(
        [
            "model",
            "forward MMACs / image",
            "training FLOPs",
            "test top-1 (%)",
            f"{SHOTS}-shot (%)",
            "on the frontier",
            "seeds",
        ],  # fmt: skip
        table,
        verdict,
        [
            (
                "frontier.png",
                "test top-1 against training FLOPs (log), the compute-accuracy "
                "frontier as a step line",
            )
        ],  # fmt: skip
        [
            "Every arm trains the same steps of the same batch (the same images seen); its "
            "training FLOPs = 3 (forward + backward) x 2 x forward MACs x images seen.",
            FLOOR_TEXT,
        ],
        {"training_flops": flops, "forward_macs": macs, "frontier": front},
    )


EXPERIMENT = Experiment(
    name=NAME,
    title="Patch size and compute (Fig. 5, Table 6)",
    source="paper Fig. 5 and Table 6 (JFT-300M pre-training, transfer accuracy against "
    "pre-training exaFLOPs)",
    claim="At the same training compute the ViTs are more accurate than the ResNets (ViT uses "
    "about 2-4x less compute for the same performance); hybrids help at small budgets.",
    paper=[
        (
            "§4.4, Fig. 5 (5-dataset transfer average)",
            "ViT reaches the ResNets' accuracy with about 2-4x less pre-training compute",
        ),
        (
            "§4.4, Fig. 5",
            "hybrids slightly beat ViT at small compute; the gap vanishes for larger models",
        ),
    ],  # fmt: skip
    arms=arms,
    summarize=summarize,
)
