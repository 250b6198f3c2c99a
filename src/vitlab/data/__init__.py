"""Datasets by name, augmentation and loaders."""

from vitlab.data.datasets import (
    ArraySplit,
    DatasetError,
    DatasetInfo,
    dataset_info,
    label_subset,
    load_split,
    train_val_split,
)
from vitlab.data.folders import FolderSplit
from vitlab.data.loader import make_loader
from vitlab.data.transforms import BatchAugment, Preprocessing
from vitlab.data.workers import loader_options

__all__ = [
    "ArraySplit",
    "BatchAugment",
    "DatasetError",
    "DatasetInfo",
    "FolderSplit",
    "Preprocessing",
    "dataset_info",
    "label_subset",
    "loader_options",
    "load_split",
    "make_loader",
    "train_val_split",
]
