"""Experiment `pos-embed` (paper Table 8, App. D.4): the same ViT and budget with no positions,
learned 1-D, learned 2-D, relative and fixed 2-D sin-cos position embeddings (the last one the
paper does not test), compared by 5-shot linear accuracy as the paper does."""

from __future__ import annotations

from pathlib import Path

from vitlab.experiments import plots
from vitlab.experiments.arms import SHOTS, Arm, Context
from vitlab.experiments.base import Experiment, Summary, by_group, seeds_text
from vitlab.experiments.verdict import FLOOR_TEXT, accuracy_floor, pos_embed_verdict

NAME = "pos-embed"
MODEL = ("model.name=vit_nano_patch4_28", "model.stem=patch")  # the paper's linear patch embedding
# (config value, label, the paper's ViT-B/16 ImageNet 5-shot linear accuracy)
KINDS = (
    ("none", "none", 0.61382),
    ("learned", "learned 1-D", 0.64206),
    ("learned_2d", "learned 2-D", 0.64001),
    ("relative", "relative", 0.64032),
    ("sincos2d", "sin-cos 2-D", None),
)
IN_RULE = ("learned 1-D", "learned 2-D", "relative")  # the paper's kinds with positions


def arms(ctx: Context, experiment: str = NAME, kinds: tuple = KINDS) -> list[Arm]:
    """Every kind x seed (`inside` asks for the learned 1-D ones under its own plan's name)."""
    plan = ctx.plan(experiment)
    return [
        ctx.arm(
            NAME,
            kind,
            label,
            seed,
            "vit_p4",
            [*MODEL, f"model.pos_embed={kind}", *plan.model],
            steps=plan.steps,
        )  # fmt: skip
        for seed in ctx.seed_list(experiment)
        for kind, label, _ in kinds
    ]


def summarize(ctx: Context, rows: list[dict], out: Path) -> Summary:
    few, top1 = by_group(rows, f"fewshot{SHOTS}"), by_group(rows, "top1")
    paper = {label: value for _, label, value in KINDS}
    table = [
        [
            g,
            "-" if paper[g] is None else f"{100 * paper[g]:.2f}",
            few[g].text(),
            top1[g].text(),
            seeds_text(few[g]),
        ]  # fmt: skip
        for g in few
    ]
    floor = accuracy_floor(rows[0]["test_images"], [few[k] for k in ("none", *IN_RULE)])
    verdict = pos_embed_verdict(few["none"], {k: few[k] for k in IN_RULE}, floor)
    plots.bars(few, out / "fewshot.png", f"{SHOTS}-shot linear accuracy (%)",
               "position embeddings: 5-shot linear accuracy")  # fmt: skip
    plots.bars(top1, out / "top1.png", "test top-1 (%)", "position embeddings: test top-1")
    return Summary(
        [
            "position embedding",
            "paper 5-shot (%)",
            "ours 5-shot (%)",
            "ours test top-1 (%)",
            "seeds",
        ],  # fmt: skip
        table,
        verdict,
        [
            ("fewshot.png", f"{SHOTS}-shot linear accuracy per kind, seed spread as error bars"),
            ("top1.png", "test top-1 per kind"),
        ],  # fmt: skip
        [
            "sin-cos 2-D is reported but not part of the rule: the paper does not test it.",
            FLOOR_TEXT,
        ],  # fmt: skip
    )


EXPERIMENT = Experiment(
    name=NAME,
    title="Position embeddings (Table 8)",
    source="paper Table 8 and App. D.4 (ViT-B/16, ImageNet 5-shot linear)",
    claim="Without position embeddings the ViT is clearly worst, while learned 1-D, learned 2-D "
    "and relative position embeddings perform about the same.",
    paper=[(label, f"{100 * v:.3f}%") for _, label, v in KINDS if v is not None],
    arms=arms,
    summarize=summarize,
    metric=f"{SHOTS}-shot linear accuracy",
)
