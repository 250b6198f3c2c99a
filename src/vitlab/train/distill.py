"""DeiT's distillation (Touvron et al. 2021, §4; the `distill` section): a student with a
distillation token (model.distilled=true) learns the labels with its class head and a teacher's
predictions with its distillation head, the teacher seeing the same augmented (mixed) batch.

    hard   (1 - a) CE(cls, y) + a CE(dist, argmax teacher)
    soft   (1 - a) CE(cls, y) + a tau^2 KL(softmax(teacher / tau) || softmax(dist / tau))
    none   (1 - a) CE(cls, y) + a CE(dist, y)           no teacher: both heads learn the labels

The KL is summed over classes and averaged over the batch (PyTorch's `batchmean`; DeiT's code
divides the sum by batch x classes instead, K times less). The teacher is any checkpoint
load_checkpoint reads, run frozen in eval mode and never saved with the student.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from vitlab.config import ConfigError, DistillConfig, RunConfig
from vitlab.data.classes import name_order
from vitlab.data.datasets import DatasetError
from vitlab.eval.classification import distilled_heads
from vitlab.formats.base import CheckpointError
from vitlab.models.checkpoint import load_checkpoint
from vitlab.models.registry import ModelConfig, family_of
from vitlab.preprocessing import Preprocessing
from vitlab.runtime import status_file

log = logging.getLogger(__name__)


class TwoHeads(nn.Module):
    """A distilled ViT in training: forward returns (class head, distillation head) logits, each
    (B, num_classes), where the model's own forward averages them. Wrapped by DDP in its place,
    so the forward still runs through DDP's __call__ (gradient sync); its state is the student's
    under `student.`, and training saves the student itself."""

    def __init__(self, student: nn.Module) -> None:
        super().__init__()
        self.student = student

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return distilled_heads(self.student, x)


def distillation_loss(
    cls: Tensor,
    dist: Tensor,
    labels: Tensor,
    teacher: Tensor | None,
    cfg: DistillConfig,
    label_smoothing: float = 0.0,
) -> Tensor:
    """The loss of the two heads' (B, K) logits: the class head against `labels` ((B,) indices or
    (B, K) mixed rows, with label smoothing), the distillation head against the teacher's (B, K)
    logits as cfg.type says, or against the labels when `teacher` is None (see the module)."""
    base = F.cross_entropy(cls.float(), labels, label_smoothing=label_smoothing)
    dist = dist.float()
    if teacher is None:
        extra = F.cross_entropy(dist, labels, label_smoothing=label_smoothing)
    elif cfg.type == "hard":
        extra = F.cross_entropy(dist, teacher.argmax(dim=1))
    else:
        t = cfg.tau
        extra = F.kl_div(
            F.log_softmax(dist / t, dim=1),
            F.log_softmax(teacher.float() / t, dim=1),
            reduction="batchmean",
            log_target=True,
        ) * (t * t)
    return (1.0 - cfg.alpha) * base + cfg.alpha * extra


class Teacher:
    """A frozen classifier: eval mode, no gradients, on the student's device; its logits for the
    student's batches, resized and renormalised to what the teacher's preprocessing expects. Not
    an nn.Module, so nothing recurses into it (train(), state_dict(), DDP)."""

    def __init__(
        self,
        model: nn.Module,
        source: str,
        student: Preprocessing,
        own: Preprocessing,
        device: torch.device,
    ) -> None:
        self.model, self.source = model.eval().requires_grad_(False), source
        self.size = own.img_size if own.img_size != student.img_size else None
        self.mode = own.resampling
        self.shift: tuple[Tensor, Tensor] | None = None  # x_teacher = x * scale + offset
        if (own.mean, own.std) != (student.mean, student.std):
            s_mean, s_std, t_mean, t_std = (
                torch.tensor(v, dtype=torch.float32, device=device).view(1, -1, 1, 1)
                for v in (student.mean, student.std, own.mean, own.std)
            )  # pixels = x * s_std + s_mean, then (pixels - t_mean) / t_std
            self.shift = (s_std / t_std, (s_mean - t_mean) / t_std)
        self.order: Tensor | None = None  # teacher logit index of each student class
        self.notes = []
        if self.size is not None:
            h, w = student.img_size
            th, tw = self.size
            self.notes.append(f"the batches are resized {h}x{w} -> {th}x{tw} ({self.mode})")
        if self.shift is not None:
            self.notes.append(
                f"the batches are renormalised from mean {student.mean} std {student.std} to the "
                f"teacher's mean {own.mean} std {own.std}"
            )
        self.digest = weights_digest(self.model)

    @torch.no_grad()
    def __call__(self, x: Tensor) -> Tensor:
        """(B, C, H, W) student inputs -> (B, K) teacher logits (in the autocast of the caller)."""
        if self.shift is not None:
            scale, offset = self.shift
            x = x * scale + offset
        if self.size is not None:
            x = F.interpolate(x, self.size, mode=self.mode, antialias=self.mode != "nearest-exact")
        logits = self.model(x)
        return logits if self.order is None else logits[:, self.order]


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of a model's state (names and bytes): whether a reloaded teacher is the same."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_teacher(
    source: str, num_classes: int, classes: list[str], pre: Preprocessing, device: torch.device
) -> Teacher:
    """The teacher of distill.teacher=`source` (anything load_checkpoint reads) for a student of
    `num_classes` classes named `classes` that takes inputs as `pre` makes them. A different class
    count or channel count, or class names partly shared, is a ConfigError; another input size or
    normalisation is adapted, the same class names in another order reordered
    (data.classes.name_order; numbered classes, or names none of which are shared: by index, the
    latter with a warning)."""
    try:
        model, meta = load_checkpoint(source, device=device)
    except CheckpointError as e:
        raise CheckpointError(f"distill.teacher: {e}") from None
    own = meta.preprocessing
    if meta.config.num_classes != num_classes:
        raise ConfigError(
            f"distill.teacher {source} predicts {meta.config.num_classes} classes, the student "
            f"{num_classes}: a teacher must classify the student's classes"
        )
    if own.in_chans != pre.in_chans:
        raise ConfigError(
            f"distill.teacher {source} takes {own.in_chans}-channel images, the student's data "
            f"has {pre.in_chans}"
        )
    teacher = Teacher(model, str(source), pre, own, device)
    try:  # where each of the student's classes is among the teacher's
        order, note = name_order(classes, meta.classes, "the student's data and the teacher")
    except DatasetError as e:
        raise ConfigError(f"distill.teacher {source}: {e}") from None
    if note:
        teacher.notes.append(f"warning: {note}")
    if order is not None:
        teacher.order = torch.tensor(order, device=device)
        teacher.notes.append(
            "the teacher's logits are reordered to the data's classes (the same names in another "
            "order)"
        )
    return teacher


def prepare(
    cfg: RunConfig,
    model: ModelConfig,
    classes: list[str],
    pre: Preprocessing,
    device: torch.device,
    sharded: bool,
) -> tuple[bool, Teacher | None]:
    """(whether the run trains two heads, the teacher or None) for a student `model` trained on
    `classes` with inputs as `pre` makes them. A teacher needs a distilled student; a distilled
    student trains on labels, and not under FSDP."""
    distilled = getattr(model, "distilled", False)  # ViTs only
    if cfg.distill != DistillConfig() and not distilled:
        what = "distill.teacher" if cfg.distill.teacher is not None else "the distill section"
        if not hasattr(model, "distilled"):  # a Swin or a CNN: no distillation token to add
            kind = {"swin": "Swin", "cnn": "CNN"}.get(family_of(model), family_of(model))
            raise ConfigError(
                f"{what} trains a student's distillation head, which a {kind} has none of: the "
                "student is a ViT with model.distilled=true"
            )
        raise ConfigError(
            f"{what} trains a student's distillation head: set model.distilled=true (a ViT with "
            f"class-token pooling)"
        )
    if distilled and cfg.train.objective != "classify":
        raise ConfigError(
            f"model.distilled=true trains on labels, not train.objective={cfg.train.objective}"
        )
    if distilled and sharded:
        raise ConfigError(
            "model.distilled=true is not supported with train.strategy=fsdp: use ddp (the "
            "student's two heads are read past the sharded module's forward)"
        )
    if cfg.distill.teacher is None:
        return distilled, None
    return True, load_teacher(cfg.distill.teacher, model.num_classes, classes, pre, device)


def check_resumed(teacher: Teacher | None, digest: str | None) -> None:
    """Warn when the teacher reloaded on resume is not the one the run started with (`digest`,
    saved in the training state)."""
    if teacher is not None and digest is not None and digest != teacher.digest:
        log.warning("distill.teacher %s holds other weights than when the run started: the "
                    "continuation is not exact", teacher.source)  # fmt: skip


def announce(teacher: Teacher | None, cfg: DistillConfig) -> None:
    """What the run distils from, and how the batches are adapted for the teacher (once)."""
    if teacher is None:
        print("distill: no teacher, both heads learn the labels", file=status_file())
        return
    params = sum(p.numel() for p in teacher.model.parameters())
    how = f"{cfg.type}, alpha {cfg.alpha}" + (f", tau {cfg.tau}" if cfg.type == "soft" else "")
    print(f"distill: teacher {teacher.source} ({params:,} params; {how})", file=status_file())
    for note in teacher.notes:
        print(f"distill: {note}", file=status_file())
