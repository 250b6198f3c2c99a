"""The budgets `vitlab reproduce` runs at, and how they were sized.

Every arm trains a fixed number of optimizer steps of a fixed batch (so arms of one experiment see
the same number of images, whatever their dataset size), then is tested on `test_images` test
images (a seeded per-class share; all of them at `full`). The step counts were sized from the
throughput measured on the project's 2-core CPU (Xeon with AVX512 / AMX, shared with other
work) and taken with margin, so that the limits hold on a machine computing in float32 without
native bf16 (AVX2 only), where these models train about half as fast as with AMX bf16:

    model (28x28 grey)          train step, 2 threads,    whole arm, 1 thread      assumed
                                fp32 / bf16 (img/s)       under load (img/s)       (TRAIN_IMG_S)
    ViT nano, patch 4           906 / 1,080               302                      400
    ViT nano, patch 2           184 / 173                 27                       80
    ViT nano, patch 7           2,483 / 2,170             -                        1,000
    ViT nano, patch 14          (4 tokens)                -                        1,600
    hybrid (vit_nano_r_s4_28)   774 / 761                 200                      300
    ResNet-18, small stem       ~160 bf16 idle (BENCHMARKS.md), 36-65 under load   45
                                                          15.6

("whole arm": the real training loop of a `fast` arm, cut to a few steps, one thread, under
another job's load: a lower bound.) Evaluation (the run's test split in float32, the 5-shot
features) runs at EVAL_SPEEDUP x the training rate: 2.4x measured for the ResNet. arm_seconds()
turns an arm into seconds with these rates and a fixed start-up and per-epoch cost;
tests/test_reproduce.py checks that every experiment's `fast` estimate is at most 15 minutes,
`full` at most 90, and `all --budget fast` at most 75.
"""

from __future__ import annotations

from dataclasses import dataclass

BUDGETS = ("smoke", "fast", "full")
LIMIT_S = {"smoke": 60.0, "fast": 15 * 60.0, "full": 90 * 60.0}
ALL_FAST_LIMIT_S = 75 * 60.0

# training images per second of one step, float32 on 2 AVX2 cores, with margin (see above)
TRAIN_IMG_S = {
    "vit_p2": 80.0,
    "vit_p4": 400.0,
    "vit_p7": 1000.0,
    "vit_p14": 1600.0,
    "hybrid": 300.0,
    "resnet18": 45.0,
}
EVAL_SPEEDUP = 2.0  # a float32 forward pass against a training step (measured 2.4x, ResNet-18)
START_S = 5.0  # per arm: data, model, the final curves.png and results
EPOCH_S = {"resnet18": 0.8}  # per epoch: checkpoint writes (ResNet-18: ~180 MB), else 0.05


@dataclass(frozen=True)
class Plan:
    """What one experiment does at one budget."""

    steps: int  # optimizer steps of every arm (fine-tuning, for mpp)
    batch: int
    seeds: int  # default --seeds
    pretrain_steps: int = 0  # mpp: the pre-training runs'
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
            "data-scale": Plan(
                steps=6, batch=16, seeds=1, sizes=(50, 400), model=TINY, cnn=TINY_CNN
            ),
            "patch-size": Plan(steps=2, batch=16, seeds=1, model=TINY, cnn=TINY_CNN),
            "mpp": Plan(steps=2, batch=16, seeds=1, pretrain_steps=3, model=TINY),
        },
    ),
    # each experiment <= 15 min on 2 AVX2 cores in fp32 (arm_seconds, with the rates above), all
    # five <= 75 (inside reuses pos-embed's runs): estimated 11.3, 10.9, 10.9, 2.3 alone and
    # 11.5 min, 44.6 in all
    "fast": Budget(
        "fast",
        test_images=2_000,
        fewshot_seeds=3,
        analysis_images=16,
        plans={
            # 10 arms x 23,040 images at 400 img/s
            "pos-embed": Plan(steps=180, batch=128, seeds=2),
            # 15 arms x 3,072 images; the ResNet's five (at 45 img/s, ~70 s of training and ~45 s
            # of evaluation each on 1,000 test images) are most of it: sets of more than 3,072
            # images are not seen whole, which the report says
            "data-scale": Plan(steps=48, batch=64, seeds=1, sizes=SIZES, test_images=1_000),
            # 6 arms x 12,800 images: the ResNet ~330 s, patch 2 ~190 s
            "patch-size": Plan(steps=100, batch=128, seeds=1),
            # per seed 2 x 40,960 pre-training + 3 x 12,800 fine-tuning images at 400 img/s
            "mpp": Plan(steps=100, batch=128, seeds=2, pretrain_steps=320),
        },
    ),
    # each experiment <= 90 min: estimated 71.5, 74.3, 72.7, 14.3 alone and 47.9 min
    "full": Budget(
        "full",
        test_images=None,
        fewshot_seeds=5,
        analysis_images=32,
        plans={
            "pos-embed": Plan(steps=800, batch=128, seeds=3),
            # the ResNet's ten arms again most of it (evaluation on 5,000 test images ~110 s each)
            "data-scale": Plan(steps=160, batch=64, seeds=2, sizes=SIZES, test_images=5_000),
            "patch-size": Plan(steps=320, batch=128, seeds=2),
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
