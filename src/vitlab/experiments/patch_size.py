"""Experiment `patch-size` (paper Fig. 5, Table 6): ViTs with patch sides 2, 4, 7 and 14 on 28x28
images, the hybrid and a ResNet-18 (ImageNet stem: 4x the patch-4 ViT's FLOPs an image on 28x28,
where the small stem's are 58x, so that it takes 100+ steps at the largest `full` level), each
trained at the same two or three levels of training compute (training FLOPs = 3 for forward and
backward x 2 FLOPs per MAC x vitlab cost's forward MACs of one image x the images seen): an arm's
steps are the level / (its FLOPs per image x the batch). Test accuracy against compute, the
compute-accuracy frontier, and a verdict at matched compute."""

from __future__ import annotations

from pathlib import Path

from vitlab.analysis.cnn_cost import stage_costs, stem_cost
from vitlab.analysis.cost import forward_macs
from vitlab.experiments import plots
from vitlab.experiments.arms import SHOTS, Arm, Context
from vitlab.experiments.base import Experiment, Summary, by_group
from vitlab.experiments.verdict import (
    FLOOR_TEXT,
    MIN_STEPS,
    accuracy_floor,
    patch_size_verdict,
)
from vitlab.models.registry import ModelConfig, family_of

NAME = "patch-size"
CNN, HYBRID = "ResNet-18", "hybrid (ResNet stem)"
PATCHES = (2, 4, 7, 14)
OFF_LEVEL = 0.1  # an arm whose training FLOPs miss its level by more is flagged in the report
# label -> (slug, throughput class, overrides, is a ViT, patch side of a plain ViT)
MODELS = {
    **{f"ViT patch {p}": (f"vit-p{p}", f"vit_p{p}", ["model.name=vit_nano_patch4_28",
        "model.stem=patch", f"model.patch_size={p}"], True, p) for p in PATCHES},
    HYBRID: ("hybrid", "hybrid", ["model.name=vit_nano_r_s4_28"], True, None),
    CNN: ("resnet18-std", "resnet18_std", ["model.name=resnet18_28", "model.small_stem=false"],
          False, None),
}  # fmt: skip


def model_macs(cfg: ModelConfig) -> int:
    """Forward multiply-accumulates of one image, as `vitlab cost` counts them."""
    if family_of(cfg) == "cnn":
        _, stem = stem_cost(cfg)
        return stem + sum(s.macs for s in stage_costs(cfg)) + cfg.num_features * cfg.num_classes
    return forward_macs(cfg)


def training_flops(cfg: ModelConfig) -> int:
    """Training FLOPs of one image: 3 (forward + backward) x 2 FLOPs per MAC x forward MACs."""
    return 6 * model_macs(cfg)


def steps_for(level: float, flops_per_image: float, batch: int) -> int:
    """Optimizer steps of `batch` images that spend `level` training FLOPs (at least one)."""
    return max(1, round(level / (flops_per_image * batch)))


def level_name(i: int) -> str:
    return f"C{i + 1}"


def arms(ctx: Context) -> list[Arm]:
    """Every model at every compute level, for every seed. A run is named by its model and
    steps, so two levels that come to the same steps (the smoke budget's) share one run."""
    plan = ctx.plan(NAME)
    overrides = {label: [*ov, *(plan.model if vit else plan.cnn)]
                 for label, (_, _, ov, vit, _) in MODELS.items()}  # fmt: skip
    cost = {label: training_flops(ctx.model_config(ov)) for label, ov in overrides.items()}
    out = []
    for seed in ctx.seed_list(NAME):
        for i, level in enumerate(plan.levels):
            for label, (slug, kind, _, _, patch) in MODELS.items():
                steps = steps_for(level, cost[label], plan.batch)
                info = {"model": label, "patch": patch, "level": level_name(i),
                        "compute": level, "flops_per_image": cost[label],
                        "training_flops": cost[label] * steps * plan.batch}  # fmt: skip
                out.append(ctx.arm(NAME, f"{slug}-s{steps}", f"{label} @ {level_name(i)}", seed,
                                   kind, overrides[label], steps=steps, info=info))  # fmt: skip
    return out


def summarize(ctx: Context, rows: list[dict], out: Path) -> Summary:
    top1, few = by_group(rows, "top1"), by_group(rows, f"fewshot{SHOTS}")
    first = {r["group"]: r for r in rows}
    levels = list(dict.fromkeys(r["level"] for r in rows))  # cheapest first
    at = {(first[g]["model"], first[g]["level"]): g for g in top1}
    curves = {label: [(first[at[label, lv]]["training_flops"], top1[at[label, lv]])
                      for lv in levels] for label in MODELS}  # fmt: skip
    compute = [first[at[CNN, lv]]["compute"] for lv in levels]
    front = plots.compute_curves(curves, out / "frontier.png",
                                 "test top-1 against training compute", compute)  # fmt: skip
    table = []
    for lv in levels:
        for label in MODELS:
            g, r = at[label, lv], first[at[label, lv]]
            table.append([lv, label, f"{r['flops_per_image'] / 6e6:.2f}",
                          f"{r['steps']} x {r['batch']}", f"{r['passes']:.3g}",
                          f"{r['training_flops']:.3g}", top1[g].text(), few[g].text(),
                          "yes" if (label, levels.index(lv)) in front else "",
                          str(top1[g].n)])  # fmt: skip
    vits = {p: {lv: top1[at[label, lv]] for lv in levels}
            for label, (*_, p) in MODELS.items() if p is not None}  # fmt: skip
    cnn = {lv: top1[at[CNN, lv]] for lv in levels}
    judged = [*cnn.values(), *(s for v in vits.values() for s in v.values())]  # not the hybrid
    n = rows[0]["test_images"]  # each part's floor at the mean of the arms it compares
    floor = accuracy_floor(n, judged)
    vit_floor = accuracy_floor(n, judged[len(cnn) :])  # the slopes': the ViTs alone
    steps = {(p if p is not None else "cnn"): {lv: first[at[label, lv]]["steps"] for lv in levels}
             for label, (*_, vit, p) in MODELS.items() if p is not None or not vit}  # fmt: skip
    off = [f"{g} ({r['training_flops'] / r['compute'] - 1:+.0%})" for g, r in first.items()
           if abs(r["training_flops"] / r["compute"] - 1) > OFF_LEVEL]  # fmt: skip
    best_vit = {lv: max(s[lv].mean for s in vits.values()) for lv in levels}
    ratio = (
        first[at[CNN, levels[0]]]["flops_per_image"]
        / first[at["ViT patch 4", levels[0]]]["flops_per_image"]
    )
    hybrid = [f"{lv} {100 * (top1[at[HYBRID, lv]].mean - best_vit[lv]):+.2f}" for lv in levels]
    named = ", ".join(f"{lv} = {c:.3g} FLOPs" for lv, c in zip(levels, compute))
    return Summary(
        [
            "level",
            "model",
            "forward MMACs / image",
            "steps x batch",
            "passes over the set",
            "training FLOPs",
            "test top-1 (%)",
            f"{SHOTS}-shot (%)",
            "on the frontier",
            "seeds",
        ],  # fmt: skip
        table,
        patch_size_verdict(vits, cnn, floor, steps, ratio, vit_floor),
        [
            (
                "frontier.png",
                "test top-1 against training FLOPs (log), one line per model through its "
                "compute levels; the compute-accuracy frontier (the best accuracy reached at "
                "that compute or less) as a black step line",
            )
        ],  # fmt: skip
        [
            f"Compute levels (dotted in the plot): {named}. Each arm trains the steps that "
            f"spend its level, steps = level / (training FLOPs per image x batch), rounded (at "
            f"least one step: the training FLOPs column gives what each spent); training FLOPs "
            f"per image = 3 (forward + backward) x 2 x `vitlab cost`'s forward MACs. The ResNet "
            f"(ResNet-18 with the ImageNet stem, a stride-2 7x7 convolution and max-pooling: "
            f"{ratio:.3g}x the patch-4 ViT's FLOPs an image; the small stem that data-scale "
            f"uses keeps the full resolution in its first stage and costs many times that, too "
            f"much to train at these levels) took "
            f"{', '.join(str(n) for n in steps['cnn'].values())} steps at {', '.join(levels)}; "
            f"the rule's first part judges only the levels where it took at least {MIN_STEPS} "
            f"steps (fewer leave a model barely trained), against the best ViT that did too.",
            f"Arms whose training FLOPs differ from their level by more than {OFF_LEVEL:.0%} (a "
            f"whole number of steps, at least one): {', '.join(off) or 'none'}.",
            "The rule compares the plain ViTs (patches 2-14) and the ResNet. The hybrid is "
            "reported, not judged: the paper finds hybrids slightly ahead of ViTs at small "
            "compute. Hybrid - best plain ViT test top-1 (pp): " + ", ".join(hybrid) + ".",
            FLOOR_TEXT,
        ],
        {
            "levels": dict(zip(levels, compute)),
            "frontier": [f"{label} @ {levels[i]}" for label, i in front],
        },
    )


EXPERIMENT = Experiment(
    name=NAME,
    title="Patch size and compute (Fig. 5, Table 6)",
    source="paper Fig. 5 and Table 6 (JFT-300M pre-training, transfer accuracy against "
    "pre-training exaFLOPs)",
    claim="Patch size trades compute for accuracy: a smaller patch costs more compute per image, "
    "and its accuracy against larger patches improves as the training compute grows (in the "
    "paper it ends ahead); and at equal training compute a ViT is more accurate than the ResNet.",
    paper=[
        (
            "Table 6",
            "halving the patch side (ViT-B/32 -> B/16) costs about 4x the pre-training compute "
            "and gains accuracy",
        ),
        (
            "§4.4, Fig. 5 (5-dataset transfer average)",
            "ViTs reach the ResNets' accuracy with about 2-4x less pre-training compute",
        ),
        (
            "§4.4, Fig. 5",
            "hybrids slightly beat ViT at small compute; the gap vanishes for larger models",
        ),
    ],  # fmt: skip
    arms=arms,
    summarize=summarize,
)
