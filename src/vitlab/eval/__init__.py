"""Evaluators: each takes a model and a loader and returns a dict of metrics."""

from vitlab.eval.classification import evaluate, save_confusion_png

__all__ = ["evaluate", "save_confusion_png"]
