"""Experiment `mpp` (paper §4.6, App. B.1.2): masked patch prediction on every training image
(no labels), then fine-tuning on 10% of the labels, against training on those 10% from scratch
and against supervised pre-training on all the labelled images before the same fine-tuning."""

from __future__ import annotations

from pathlib import Path

from vitlab.experiments import plots
from vitlab.experiments.arms import LAST, SHOTS, Arm, Context
from vitlab.experiments.base import Experiment, Summary, by_group
from vitlab.experiments.verdict import FLOOR_TEXT, accuracy_floor, mpp_verdict

NAME = "mpp"
LABELLED = 0.1  # the fine-tuning share of the training split
MODEL = ("model.name=vit_nano_patch4_28", "model.stem=patch")  # linear patches: see README (MPP)
SCRATCH, MPP, SUPERVISED = "from scratch", "MPP pre-trained", "supervised pre-trained"


def arms(ctx: Context) -> list[Arm]:
    plan = ctx.plan(NAME)
    total = len(ctx.train_split)
    few = round(LABELLED * total)
    model = [*MODEL, *plan.model]
    out = []
    for seed in ctx.seed_list(NAME):

        def source(slug: str, seed: int = seed) -> str:
            """A pre-training arm's last checkpoint, relative to the --out folder."""
            return f"{NAME}/{slug}-seed{seed}/checkpoints/{LAST}"

        out += [
            ctx.arm(NAME, "mpp-pretrain", "MPP pre-training", seed, "vit_p4",
                    [*model, "train.objective=mpp"], steps=plan.pretrain_steps, classifier=False),
            ctx.arm(NAME, "sup-pretrain", "supervised pre-training", seed, "vit_p4", model,
                    steps=plan.pretrain_steps),
            ctx.arm(NAME, "scratch", SCRATCH, seed, "vit_p4", model, size=few),
            ctx.arm(NAME, "mpp-finetune", MPP, seed, "vit_p4", [], size=few,
                    source=source("mpp-pretrain")),
            ctx.arm(NAME, "sup-finetune", SUPERVISED, seed, "vit_p4", [], size=few,
                    source=source("sup-pretrain")),
        ]  # fmt: skip
    return out


def summarize(ctx: Context, rows: list[dict], out: Path) -> Summary:
    top1, few = by_group(rows, "top1"), by_group(rows, f"fewshot{SHOTS}")
    first = {r["group"]: r for r in rows}
    paper = {SCRATCH: "77.9 (ViT-B/16, ImageNet only)", MPP: "79.9", SUPERVISED: "~83.9 (+4)"}
    table = []
    for g, s in top1.items():
        r = first[g]
        kind = "masked-colour accuracy (best)" if g == "MPP pre-training" else "test top-1"
        table.append([g, f"{r['images']:,}", f"{r['steps']} x {r['batch']}", kind, s.text(),
                      few[g].text() if g in few else "-", paper.get(g, "-"), str(s.n)])  # fmt: skip
    compared = {g: top1[g] for g in (SCRATCH, MPP, SUPERVISED)}
    plots.bars(compared, out / "top1.png", "test top-1 (%)",
               f"fine-tuned on {LABELLED:.0%} of the labels")  # fmt: skip
    return Summary(
        [
            "arm",
            "training images",
            "steps x batch",
            "metric",
            "ours (%)",
            f"{SHOTS}-shot (%)",
            "paper ImageNet top-1 (%)",
            "seeds",
        ],  # fmt: skip
        table,
        mpp_verdict(*compared.values(), accuracy_floor(rows[0]["test_images"], compared.values())),
        [("top1.png", "test top-1 after fine-tuning on 10% of the labels")],
        [
            f"Pre-training (masked patch prediction without labels, or supervised) uses every "
            f"training image; fine-tuning and the scratch arm use a seeded {LABELLED:.0%} of every "
            f"class (each seed its own), for the same steps, starting from the pre-training "
            f"arms' last checkpoints. The MPP pre-training's masked-colour accuracy is its run's "
            f"own (its best checkpoint, by training loss). The paper pre-trains on JFT-300M, "
            f"compares on ImageNet.",
            FLOOR_TEXT,
        ],
    )


EXPERIMENT = Experiment(
    name=NAME,
    title="Masked patch prediction (§4.6)",
    source="paper §4.6 and App. B.1.2 (ViT-B/16 pre-trained on JFT-300M, ImageNet fine-tuning)",
    claim="Self-supervised masked patch prediction pre-training improves on training from "
    "scratch, but stays behind supervised pre-training.",
    paper=[
        ("MPP pre-trained ViT-B/16, ImageNet", "79.9%"),
        ("against training from scratch", "+2%"),
        ("against supervised pre-training", "-4%"),
    ],  # fmt: skip
    arms=arms,
    summarize=summarize,
)
