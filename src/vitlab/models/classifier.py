"""timm's names for a model's classifier and inputs, shared by vitlab's families: `num_classes`,
`get_classifier()`, `classifier` (the layer at the family's `classifier_name`) and
`pretrained_cfg` (what timm.data.resolve_data_config reads). Code written for timm models
(`model.num_classes`, `model.get_classifier()`, timm's data pipeline) runs on vitlab's."""

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

    @property
    def pretrained_cfg(self) -> dict:
        """timm's: the inputs `.preprocessing` says (`timm.data.resolve_data_config(model=m)`
        and `create_transform(**that)` then prepare images as vitlab does); without one (a model
        built, not loaded), its input size only, timm's defaults for the rest."""
        pre = getattr(self, "preprocessing", None)
        known = pre.timm_data_config() if pre is not None else {}
        hw = self.config.img_hw
        return {**known, "input_size": (self.config.in_chans, *hw), "num_classes": self.num_classes}

    default_cfg = pretrained_cfg  # timm's earlier name
