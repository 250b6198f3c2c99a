"""Hugging Face datasets offline: save_to_disk folders and parquet files the test writes, their
columns found or named, and `vitlab train` from a parquet file end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import TINY_MODEL
from vitlab.config import load_run_config
from vitlab.data import load_split
from vitlab.data.datasets import DatasetError
from vitlab.train.run import train


def table(n: int, image: str = "image", label: str = "label", class_label: bool = True):
    """n 8x8 RGB images, 3 classes of noise around a colour."""
    import datasets

    rng = np.random.default_rng(n)
    colours = [(200, 40, 40), (40, 200, 40), (40, 40, 200)]
    labels = [i % 3 for i in range(n)]
    images = [
        Image.fromarray(np.clip(rng.normal(colours[y], 50, (8, 8, 3)), 0, 255).astype(np.uint8))
        for y in labels
    ]
    kind = datasets.ClassLabel(names=["red", "green", "blue"]) if class_label else None
    features = datasets.Features({image: datasets.Image(), label: kind or datasets.Value("int64")})
    return datasets.Dataset.from_dict({image: images, label: labels}, features=features)


def test_save_to_disk_and_parquet_columns_found_or_named(tmp_path: Path) -> None:
    table(50).save_to_disk(str(tmp_path / "saved"))
    train = load_split(f"hf:{tmp_path / 'saved'}", "train")
    test = load_split(f"hf:{tmp_path / 'saved'}", "test")  # one split: a seeded 20% carved
    assert (len(train), len(test)) == (40, 10) and train.classes == ["red", "green", "blue"]
    assert set(train.rows.tolist()).isdisjoint(test.rows.tolist()) and train.in_chans == 3
    assert train.read(0)[:8] == b"\x89PNG\r\n\x1a\n"
    table(12, "picture", "y", class_label=False).to_parquet(str(tmp_path / "odd.parquet"))
    with pytest.raises(DatasetError, match="no label column found .* set data.label_key"):
        load_split(f"hf:{tmp_path / 'odd.parquet'}", "all")
    odd = load_split(f"hf:{tmp_path / 'odd.parquet'}", "all", keys=(None, "y"))  # image: by type
    assert len(odd) == 12 and odd.classes == ["0", "1", "2"]
    with pytest.raises(DatasetError, match="data.image_key=photo: no such column"):
        load_split(f"hf:{tmp_path / 'odd.parquet'}", "all", keys=("photo", "y"))
    with pytest.raises(DatasetError, match="cannot load the Hugging Face dataset"):
        load_split(f"hf:{tmp_path / 'missing.parquet'}", "train")


def test_train_from_parquet_files(tmp_path: Path, monkeypatch) -> None:
    """Trains from a parquet file with data.test another; every loader's workers are ended
    (train's after training, validation's after each evaluation, test's after testing)."""
    from vitlab.data.loader import FolderLoader

    closed, close = [], FolderLoader.close
    monkeypatch.setattr(FolderLoader, "close", lambda self: closed.append(self) or close(self))
    table(90).to_parquet(str(tmp_path / "train.parquet"))
    table(30).to_parquet(str(tmp_path / "test.parquet"))
    cfg = load_run_config(None, [*TINY_MODEL, f"data.name=hf:{tmp_path / 'train.parquet'}",
                                 f"data.test=hf:{tmp_path / 'test.parquet'}", "data.workers=1",
                                 "train.batch_size=16", "train.epochs=1"])  # fmt: skip
    run = train(cfg, out=tmp_path / "run")
    result = json.loads((run / "results.json").read_text())
    assert result["top1"] is not None and result["num_images"] == 30
    assert len({id(x) for x in closed}) == 3 and all(x._loader is None for x in closed)
