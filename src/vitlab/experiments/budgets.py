"""The budgets `vitlab reproduce` runs at, and how they were sized.

Every arm trains a fixed number of optimizer steps of a fixed batch (data-scale, pos-embed, mpp:
the same steps for every arm of an experiment; patch-size: the steps that spend one of its
compute levels, training FLOPs = 3 x 2 x forward MACs x images seen), then is tested on
`test_images` test images (a seeded per-class share; all of them where None).

The time estimates (arm_seconds) assume float32 on 2 AVX2-only CPU cores, where these models train
about half as fast as on the project's 2-core Xeon with AMX bf16. The rates are half the lowest
training throughput the arms reached in the `fast` run of 2026-11-30 on that Xeon (bf16, shared
with other jobs; BENCHMARKS.md, "The paper in miniature (issue 15)", from each arm's
metrics.jsonl), rounded down:

    model (28x28 grey)          measured bf16 (img/s)     assumed fp32 AVX2 (TRAIN_IMG_S)
    ViT nano, patch 2           309                       150
    ViT nano, patch 4           1,050-1,910               520
    ViT nano, patch 7           3,220                     1,600
    ViT nano, patch 14          5,810                     2,900
    hybrid (vit_nano_r_s4_28)   670-1,140                 330
    ResNet-18, small stem       89-152                    45

Against the measured run they are 2-4x slow, a margin for other load. Evaluation (the run's test
split in float32, then the last checkpoint's test top-1 and 5-shot features in one more pass)
runs at EVAL_SPEEDUP x the training rate (2.4x measured for the ResNet); a fixed start-up per arm
and a per-epoch cost (checkpoint writes) are added. tests/test_reproduce.py checks that every
experiment's `fast` estimate is at most 15 minutes, `full` at most 90, and `all --budget fast` at
most 75.
"""

from __future__ import annotations

from dataclasses import dataclass

BUDGETS = ("smoke", "fast", "full")
LIMIT_S = {"smoke": 60.0, "fast": 15 * 60.0, "full": 90 * 60.0}
ALL_FAST_LIMIT_S = 75 * 60.0

# training images per second, float32 on 2 AVX2 cores: half the lowest bf16 rate measured (above)
TRAIN_IMG_S = {
    "vit_p2": 150.0,
    "vit_p4": 520.0,
    "vit_p7": 1600.0,
    "vit_p14": 2900.0,
    "hybrid": 330.0,
    "resnet18": 45.0,
}
EVAL_SPEEDUP = 2.0  # a float32 forward pass against a training step (measured 2.4x, ResNet-18)
START_S = 5.0  # per arm: data, model, the final curves.png and results
EPOCH_S = {"resnet18": 0.8}  # per epoch: checkpoint writes (ResNet-18: ~180 MB), else 0.05


@dataclass(frozen=True)
class Plan:
    """What one experiment does at one budget."""

    steps: int  # optimizer steps of every arm (fine-tuning, for mpp; patch-size: none)
    batch: int
    seeds: int  # default --seeds
    pretrain_steps: int = 0  # mpp: the pre-training runs'
    levels: tuple[float, ...] = ()  # patch-size: training FLOPs of every arm, one run per level
    sizes: tuple[int, ...] = ()  # data-scale: training images per arm
    model: tuple[str, ...] = ()  # overrides every ViT arm takes (smoke: one layer)
    cnn: tuple[str, ...] = ()  # overrides every ResNet arm takes (smoke: 8x8 inputs)
    test_images: int | None = None  # instead of the budget's


@dataclass(frozen=True)
class Budget:
    name: str
    test_images: int | None  # None: the whole test split
    fewshot_seeds: int  # draws of the 5-shot subset
    analysis_images: int  # inside: images for attention distance and rollout
    plans: dict[str, Plan]  # `inside` has none: it analyses pos-embed's runs


TINY = ("model.depth=1",)
TINY_CNN = ("model.img_size=8",)  # a ResNet-18 step on 28x28 takes ~0.5 s at batch 16
SIZES = (1_000, 3_000, 10_000, 30_000, 60_000)

BUDGET = {
    # every experiment end to end in seconds: tiny models, a few steps, small subsets
    "smoke": Budget(
        "smoke",
        test_images=50,
        fewshot_seeds=1,
        analysis_images=2,
        plans={
            "pos-embed": Plan(steps=3, batch=16, seeds=1, model=TINY),
            # both sets seen whole (6 x 16 = 96 images), so that the rule runs
            "data-scale": Plan(
                steps=6, batch=16, seeds=1, sizes=(48, 96), model=TINY, cnn=TINY_CNN
            ),
            # 1-10 steps: patch 2 and 4, the hybrid and the ResNet take one step at both levels
            # (more compute than either), one run each
            "patch-size": Plan(
                steps=0, batch=16, seeds=1, levels=(1e8, 2e8), model=TINY, cnn=TINY_CNN
            ),
            "mpp": Plan(steps=2, batch=16, seeds=1, pretrain_steps=3, model=TINY),
        },
    ),
    # each experiment <= 15 min on 2 AVX2 cores in fp32 (arm_seconds, with the rates above), all
    # five <= 75 (inside reuses pos-embed's runs): estimated 8.9, 10.6, 12.1, 1.8 alone and 9.1
    # min, 40.7 in all
    "fast": Budget(
        "fast",
        test_images=2_000,
        fewshot_seeds=3,
        analysis_images=16,
        plans={
            # 10 arms x 23,040 images at 520 img/s
            "pos-embed": Plan(steps=180, batch=128, seeds=2),
            # 15 arms x 3,072 images; the ResNet's five (at 45 img/s, ~70 s of training and ~45 s
            # of evaluation each on 1,000 test images) are most of it: sets of more than 3,072
            # images are not seen whole, which the report says
            "data-scale": Plan(steps=48, batch=64, seeds=1, sizes=SIZES, test_images=1_000),
            # 6 models x 2 levels; the ResNet takes 3 and 9 steps of 64 there (its 2.7 training
            # GFLOPs an image are 58x the patch-4 ViT's), patch 14 1,920 and 5,795 (the costliest)
            "patch-size": Plan(steps=0, batch=64, seeds=1, levels=(5.3e11, 1.6e12)),
            # per seed 2 x 40,960 pre-training + 3 x 12,800 fine-tuning images at 520 img/s
            "mpp": Plan(steps=100, batch=128, seeds=2, pretrain_steps=320),
        },
    ),
    # each experiment <= 90 min: estimated 55.3, 83.8, 82.0, 11.1 alone and 37.6 min
    "full": Budget(
        "full",
        test_images=None,
        fewshot_seeds=5,
        analysis_images=32,
        plans={
            "pos-embed": Plan(steps=800, batch=128, seeds=3),
            # 12,800 images an arm: the sets of 1k-10k seen whole, 30k and 60k not (one pass over
            # 60k, ~940 steps, would take the ResNet's arms alone ~3.7 h at 45 img/s), so the
            # verdict compares 1k-10k; the ResNet's ten arms are most of the time
            "data-scale": Plan(steps=200, batch=64, seeds=2, sizes=SIZES, test_images=5_000),
            # 6 models x 3 levels (ratio ~3); at the largest the ResNet sees 1,984 images (31
            # steps), patch 4 ~114,000, patch 14 1.25M (~440 s, the costliest arm)
            "patch-size": Plan(
                steps=0, batch=64, seeds=2, levels=(5.3e11, 1.6e12, 5.4e12), test_images=5_000
            ),
            "mpp": Plan(steps=200, batch=128, seeds=3, pretrain_steps=1_000),
        },
    ),
}


def get_budget(name: str) -> Budget:
    if name not in BUDGET:
        raise ValueError(f"unknown budget {name!r}: choose one of {', '.join(BUDGETS)}")
    return BUDGET[name]


def arm_seconds(kind: str, images_seen: int, epochs: int, eval_images: int) -> float:
    """Estimated wall-clock seconds of one arm on 2 AVX2 cores in float32."""
    rate = TRAIN_IMG_S[kind]
    return (
        START_S
        + images_seen / rate
        + eval_images / (EVAL_SPEEDUP * rate)
        + epochs * EPOCH_S.get(kind, 0.05)
    )
