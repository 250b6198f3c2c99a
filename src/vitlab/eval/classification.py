"""Classification metrics: loss, top-1, top-5, per-class accuracy and the confusion matrix, and a
distilled model's (DeiT) top-1 of each head alone, summed over all ranks under torchrun."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch import Tensor, nn

from vitlab.runtime import Dist, all_reduce_, eval_mode


def distilled_heads(model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """A distilled ViT's (DeiT) class head and distillation head logits, each (B, num_classes),
    on (B, C, H, W) images: forward() returns only their average."""
    tokens = model.forward_features(x, head_only=True)  # class and distillation token first
    return model.head(tokens[:, 0]), model.head_dist(tokens[:, 1])


def is_distilled(model: nn.Module) -> bool:
    """Whether `model` has a DeiT distillation head beside its class head."""
    return isinstance(getattr(model, "head_dist", None), nn.Linear)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    num_classes: int,
    device: torch.device,
    autocast: AbstractContextManager | None = None,
    d: Dist | None = None,
) -> dict:
    """Metrics of `model` over every batch: {"loss", "top1", "top5", "per_class", "confusion",
    "num_images"} (accuracies in [0, 1]; top5 is top-k with k = min(5, num_classes); per_class
    is a list, None for a class without images; confusion[true][predicted]), and
    for a distilled model (DeiT), whose prediction averages two heads, "top1_cls" and "top1_dist":
    each head's alone. Samples labelled below 0 (the loaders' padding, which keeps ranks stepping
    together) run through the model but are not counted."""
    distilled = is_distilled(model)
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device)
    # loss sum, top-5 hits, images, class head hits, distillation head hits
    totals = torch.zeros(5, dtype=torch.float64, device=device)
    k = min(5, num_classes)
    with eval_mode(model):  # each submodule's own mode back after, errors too
        for x, y in batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            counted = y >= 0
            with autocast or nullcontext():
                if distilled:
                    by_cls, by_dist = distilled_heads(model, x)
                    logits = (by_cls + by_dist) / 2  # as forward_head
                    totals[3] += (by_cls.argmax(dim=1) == y)[counted].sum()
                    totals[4] += (by_dist.argmax(dim=1) == y)[counted].sum()
                else:
                    logits = model(x)
            logits = logits.float()
            if not counted.all():
                logits, y = logits[counted], y[counted]
            totals[0] += nn.functional.cross_entropy(logits, y, reduction="sum")
            totals[1] += (logits.topk(k, dim=1).indices == y[:, None]).any(dim=1).sum()
            totals[2] += len(y)
            pred = logits.argmax(dim=1)
            confusion.index_put_(
                (y, pred), torch.ones_like(y, dtype=torch.float64), accumulate=True
            )
    if d is not None and d.enabled:
        all_reduce_(confusion)
        all_reduce_(totals)
    n = max(totals[2].item(), 1.0)
    per_class_total = confusion.sum(dim=1)
    per_class = [  # None: no image of that class was evaluated (not 0%, which means all wrong)
        hits / total if total else None
        for hits, total in zip(confusion.diagonal().tolist(), per_class_total.tolist(), strict=True)
    ]
    heads = {"top1_cls": totals[3].item() / n, "top1_dist": totals[4].item() / n}
    return {
        "loss": totals[0].item() / n,
        "top1": confusion.diagonal().sum().item() / n,
        **(heads if distilled else {}),
        "top5": totals[1].item() / n,
        "per_class": per_class,
        "confusion": confusion.long().tolist(),
        "num_images": int(totals[2].item()),
    }


def top5_name(num_classes: int) -> str:
    """What "top5" is for `num_classes` classes: top-5, or top-k for fewer than 5 (always 100%)."""
    return f"top-{min(5, num_classes)}"


def top5_text(num_classes: int, top5: float, gap: str = "   ") -> str:
    """'<gap>top-5 12.34%' for a report line; nothing for one class, whose top-1 is its top-k."""
    return "" if num_classes < 2 else f"{gap}{top5_name(num_classes)} {100 * top5:.2f}%"


def format_confusion(confusion: list[list[int]], classes: list[str]) -> str:
    """The confusion matrix as text: rows are true classes, columns predictions (by index)."""
    names = [f"{i:>2} {c[:12]}" for i, c in enumerate(classes)]
    label = max(len(n) for n in names)
    cell = max(3, *(len(str(v)) for row in confusion for v in row))
    lines = [" " * label + " " + " ".join(f"{i:>{cell}}" for i in range(len(classes)))]
    for name, row in zip(names, confusion, strict=True):
        lines.append(f"{name:<{label}} " + " ".join(f"{v:>{cell}}" for v in row))
    return "\n".join(lines)


def save_confusion_png(
    confusion: list[list[int]], classes: list[str], path: Path, title: str
) -> None:
    """Row-normalised confusion matrix as a heat map with counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cm = torch.tensor(confusion, dtype=torch.float64)
    norm = cm / cm.sum(dim=1, keepdim=True).clamp(min=1)
    k = len(classes)
    size = max(5.0, 0.45 * k + 2)
    fig, ax = plt.subplots(figsize=(size, size))
    im = ax.imshow(norm.numpy(), cmap="Blues", vmin=0, vmax=1)
    if k <= 30:
        ax.set_xticks(range(k), classes, rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(k), classes, fontsize=8)
        for i in range(k):
            for j in range(k):
                if cm[i, j]:
                    color = "white" if norm[i, j] > 0.5 else "black"
                    ax.text(j, i, int(cm[i, j]), ha="center", va="center", fontsize=7, color=color)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
