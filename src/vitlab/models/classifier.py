"""timm's names for a model's classifier, shared by vitlab's families: `num_classes`,
`get_classifier()` and `classifier` (the layer at the family's `classifier_name`). Code written
for timm models (`model.num_classes`, `model.get_classifier()`) runs on vitlab's."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn


class ClassifierApi:
    """Mixed into an nn.Module with a `config` holding `num_classes`."""

    config: Any
    classifier_name: ClassVar[str]  # the classifier's module path: "head", "head.fc", "fc"

    @property
    def num_classes(self) -> int:
        """The classes the logits are of; 0: no classifier, forward() gives pooled features."""
        return self.config.num_classes

    @property
    def classifier(self) -> nn.Module:
        """The layer that makes the logits (nn.Identity without classes)."""
        return self.get_submodule(self.classifier_name)  # type: ignore[attr-defined]

    def get_classifier(self) -> nn.Module | tuple[nn.Module, nn.Module]:
        """As timm's: the classifier layer; a distilled ViT's (class head, distillation head)."""
        dist = getattr(self, "head_dist", None)
        return self.classifier if dist is None else (self.classifier, dist)
