"""WebDataset shards: the writer and its index, distinct shards for every rank and worker, a fixed
epoch, seeded reshuffles, exact mid-epoch resume, and `vitlab train` from shards end to end."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import TINY_MODEL, VITLAB, resume, weights_of
from tests.test_trainer_state import CtrlCAtCheck, write_image_folder
from vitlab.cli.main import main
from vitlab.config import DataConfig, load_run_config
from vitlab.data import BatchAugment, Preprocessing, load_split, make_loader
from vitlab.data.datasets import DatasetError, train_val_split
from vitlab.data.download import find_fashion_mnist
from vitlab.data.shards import ShardSplit
from vitlab.data.stream import _replay, _shuffled
from vitlab.data.writer import write_shards
from vitlab.train import run as run_mod
from vitlab.train.run import TrainingStopped, train

SHARDS, PER_SHARD = 8, 16
PRE = Preprocessing((8, 8), 3, (0.5,) * 3, (0.5,) * 3)
AUG = BatchAugment(DataConfig(crop_padding=1, hflip=0.5), PRE, 3)


def png(rng: np.random.Generator, label: int) -> bytes:
    colour = [(200, 40, 40), (40, 200, 40), (40, 40, 200)][label]
    pixels = np.clip(rng.normal(colour, 50, size=(8, 8, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def balanced(tmp_path_factory) -> Path:
    """SHARDS shards of PER_SHARD samples each, keys s{shard}-{i}, with no index (counted)."""
    import webdataset as wds

    root = tmp_path_factory.mktemp("balanced")
    rng = np.random.default_rng(0)
    for s in range(SHARDS):
        with wds.TarWriter(str(root / f"part-{s:02d}.tar")) as w:
            for i in range(PER_SHARD):
                label = (s + i) % 3
                w.write({"__key__": f"s{s}-{i:02d}", "png": png(rng, label), "cls": b"%d" % label})
    return root


def epoch_keys(
    split, epoch: int, start: int = 0, rank: int = 0, world: int = 1, workers: int = 2
) -> tuple[list[str], list[torch.Tensor]]:
    """The sample keys and images of an epoch's batches from `start`: batches of 16, buffer 10."""
    batch, buffer = 16, 10
    loader = make_loader(split, batch, PRE, augment=AUG, shuffle=True, seed=3, rank=rank,
                         world=world, workers=workers, buffer=buffer)  # fmt: skip
    loader.record = []
    images = [x for x, _ in loader.iterate(epoch, start)]
    return loader.record, images


def test_replay_reaches_the_shuffles_state() -> None:
    """The resume replay, on positions alone, leaves the generator, buffer and read position where
    the shuffle itself is after that many samples, at any point (mid-buffer, in the final flush,
    in a second pass)."""
    import random

    for emitted in (0, 1, 9, 25, 30, 31, 45):
        rng = random.Random(5)
        out = []
        for _ in range(2):
            out += list(_shuffled(rng, 8, iter(range(30)), []))
        rng2 = random.Random(5)
        p, buf, c = _replay(rng2, 8, 30, emitted)
        rest = list(_shuffled(rng2, 8, iter(range(c, 30)), list(buf)))
        if p == 0:
            rest += list(_shuffled(rng2, 8, iter(range(30)), []))
        assert out[emitted:] == rest, emitted


def test_ranks_and_workers_read_distinct_shards_and_cover_the_epoch(balanced: Path) -> None:
    split = load_split(f"wds:{balanced}/part-{{00..07}}.tar", "train")
    assert len(split) == SHARDS * PER_SHARD and split.classes == ["0", "1", "2"]
    everything = {f"s{s}-{i:02d}" for s in range(SHARDS) for i in range(PER_SHARD)}
    orders = []
    for epoch in (0, 1):
        ranks = [epoch_keys(split, epoch, rank=r, world=2, workers=2)[0] for r in range(2)]
        assert len(ranks[0]) == len(ranks[1]) == 64  # 8 global batches of 16, 8 a rank
        assert set(ranks[0]).isdisjoint(ranks[1]) and set(ranks[0]) | set(ranks[1]) == everything
        shards = [{k.split("-")[0] for k in keys} for keys in ranks]
        assert shards[0].isdisjoint(shards[1]) and len(shards[0]) == 4
        orders.append((ranks[0], shards[0]))
    assert orders[0][0] != orders[1][0]  # reshuffled: samples, and which rank reads which shard
    # one process with in-process reading: the same epoch, every sample once
    keys, _ = epoch_keys(split, 0, workers=0)
    assert sorted(keys) == sorted(everything)


def test_mid_epoch_resume_is_exact(balanced: Path) -> None:
    """Resumed at batch 3 (with 2 workers: a stream mid-buffer), the batches are an uninterrupted
    epoch's from batch 3 on, samples and augmentation alike: none repeated, none skipped."""
    split = load_split(f"wds:{balanced}/part-{{00..07}}.tar", "train")
    keys, images = epoch_keys(split, 1)
    for start in (3, 6):
        rest, rest_images = epoch_keys(split, 1, start=start)
        assert rest == keys[start * 16 :]
        assert all(torch.equal(a, b) for a, b in zip(images[start:], rest_images, strict=True))
    assert len(set(keys)) == len(keys) == 128


def test_the_order_does_not_depend_on_the_worker_count(balanced: Path) -> None:
    """Streams are a function of shards and ranks alone: workers=0 and 2 deliver the same samples
    in the same order with the same augmentation, and a resume with another worker count (1) is
    an uninterrupted epoch's remainder."""
    split = load_split(f"wds:{balanced}/part-{{00..07}}.tar", "train")
    keys, images = epoch_keys(split, 1, workers=0)
    keys2, images2 = epoch_keys(split, 1, workers=2)
    assert keys2 == keys and len(set(keys)) == 128
    assert all(torch.equal(a, b) for a, b in zip(images, images2, strict=True))
    rest, rest_images = epoch_keys(split, 1, start=3, workers=1)
    assert rest == keys[3 * 16 :]
    assert all(torch.equal(a, b) for a, b in zip(images[3:], rest_images, strict=True))


def test_fewer_workers_than_asked_are_said(balanced: Path, caplog) -> None:
    """8 shards make 8 streams; 3 workers cannot share them evenly, so 2 serve them: said."""
    split = load_split(f"wds:{balanced}/part-{{00..07}}.tar", "train")
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        loader = make_loader(split, 16, PRE, augment=AUG, shuffle=True, workers=3)
        assert loader.workers == 2
        assert "data.workers=3: 2 DataLoader worker(s) serve this process's 8 shard" in caplog.text
        caplog.clear()
        assert make_loader(split, 16, PRE, augment=AUG, shuffle=True, workers=4).workers == 4
        assert "DataLoader worker" not in caplog.text
        default = make_loader(split, 16, PRE, augment=AUG, shuffle=True, workers=3,
                              workers_chosen=False)  # fmt: skip
        assert default.workers == 2 and "DataLoader worker" not in caplog.text  # nothing asked


def test_evaluation_with_fewer_shards_than_ranks_pads(balanced: Path) -> None:
    """A validation split of 1 shard on 2 ranks: rank 1 reads nothing and yields padding batches
    (labels PADDING), as many as rank 0's real ones; training still refuses it."""
    from vitlab.data.loader import PADDING

    split = load_split(f"wds:{balanced}/part-00.tar", "train")
    ranks = [list(make_loader(split, 5, PRE, rank=r, world=2, workers=1)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 4  # 16 samples in batches of 5
    assert sum(len(y) for _, y in ranks[0]) == 16 and all((y >= 0).all() for _, y in ranks[0])
    assert all((y == PADDING).all() for _, y in ranks[1])
    with pytest.raises(DatasetError, match="1 training shard for 2 processes"):
        make_loader(split, 4, PRE, shuffle=True, augment=AUG, world=2)


def test_empty_shards_and_uneven_deals_are_named(balanced: Path, caplog, monkeypatch) -> None:
    """A training shard of no samples is refused (a stream of them would wait forever). Batch b
    comes from stream b % K: 4 shards of 40 samples in batches of 16 (10 an epoch: 3, 3, 2, 2
    a stream) repeat 16 samples and leave 16 unseen, which was not warned of (the streams held
    equal shares); 12 equal shards for 8 streams (1 or 2 each, and 2 or 1 batches) deal
    exactly, which was. A carve of 1 shard in 2 for val_fraction=0.1 is warned about."""
    import logging

    from vitlab.data.shards import ShardSplit

    urls = [f"{balanced}/part-{s:02d}.tar" for s in range(8)]
    with pytest.raises(DatasetError, match="part-03.tar holds no samples"):
        make_loader(ShardSplit(urls, [16, 16, 16, 0, 16, 16, 16, 16], ["0"]), 16, PRE,
                    shuffle=True, augment=AUG)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        make_loader(ShardSplit(urls, [16] * 8, ["0"]), 16, PRE, shuffle=True, augment=AUG)
        assert not caplog.records
        make_loader(ShardSplit(urls + urls[:4], [16] * 12, ["0"]), 16, PRE, shuffle=True,
                    augment=AUG)  # fmt: skip
        assert not caplog.records
        make_loader(ShardSplit(urls[:4], [40] * 4, ["0"]), 16, PRE, shuffle=True, augment=AUG)
        assert "in an epoch of 160 samples, 16 repeat and 16 are not seen" in caplog.text
        caplog.clear()  # the real shards (8 of 16) in batches of 6: 21 an epoch, 3 or 2 a stream
        loader = make_loader(load_split(f"wds:{balanced}/part-{{00..07}}.tar", "train"), 6, PRE,
                             shuffle=True, augment=AUG, buffer=4)  # fmt: skip
        assert "in an epoch of 126 samples, 10 repeat and 12 are not seen" in caplog.text
        loader.record = []
        list(loader.iterate(0, 0))
        assert len(loader.record) == 126 and len(set(loader.record)) == 126 - 10  # as it said
        train_val_split(ShardSplit(urls[:2], [16, 16], ["0"]), 0.1, 0)
        assert "carves 50% of the samples for data.val_fraction=0.1" in caplog.text
        for rank in (0, 1):  # torchrun's other ranks find the same: rank 0 alone says it (each
            caplog.clear()  # rank said it)
            monkeypatch.setenv("RANK", str(rank))
            make_loader(ShardSplit(urls[:3], [40] * 3, ["0"]), 8, PRE, shuffle=True,
                        augment=AUG, rank=rank, world=2)  # fmt: skip
            train_val_split(ShardSplit(urls[:2], [16, 16], ["0"]), 0.1, 0)
            said = caplog.text.count("repeat and"), caplog.text.count("carves 50%")
            assert said == ((1, 1) if rank == 0 else (0, 0)), caplog.text


def test_fractions_of_shards_are_refused_by_their_key(balanced: Path) -> None:
    """Shards cannot be subset by label: the error names the key that asked for it (the test
    share's data.test_fraction, not data.label_fraction) with its value."""
    from vitlab.train.build import load_data

    name = f"wds:{balanced}/part-{{00..05}}.tar"
    test = f"wds:{balanced}/part-{{06..07}}.tar"
    for key in ("label_fraction", "test_fraction"):
        cfg = load_run_config(None, [*TINY_MODEL, f"data.name={name}", f"data.test={test}",
                                     "data.val_fraction=0", f"data.{key}=0.5"])  # fmt: skip
        with pytest.raises(DatasetError, match=rf"data\.{key}=0\.5"):
            load_data(cfg)


def test_in_process_batches_seed_no_cuda_generator(balanced: Path, tmp_path, monkeypatch) -> None:
    """workers=0: each batch's draws are seeded on the CPU generator alone (fork_rng(devices=[])
    restores only that one), for shards and image files alike."""
    calls = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(seed))
    split = load_split(f"wds:{balanced}/part-{{00..01}}.tar", "train")
    epoch_keys(split, 0, workers=0)
    files = load_split(f"imagefolder:{write_image_folder(tmp_path / 'im', 3)}", "all")
    assert calls == [] and len(list(make_loader(files, 8, PRE, workers=0))) == 2  # 9 images


def test_an_undecodable_sample_is_named_with_its_shard(tmp_path: Path, caplog) -> None:
    """In training and in evaluation, an image that does not decode is named with the shard
    that holds it (the sample's key alone before: 'x (a shard's sample)')."""
    import webdataset as wds

    rng = np.random.default_rng(0)
    for s in range(2):
        with wds.TarWriter(str(tmp_path / f"b-{s}.tar")) as w:
            for i in range(4):
                image = b"\x89PNG\r\n\x1a\n cut" if (s, i) == (1, 2) else png(rng, i % 2)
                w.write({"__key__": f"s{s}-{i}", "png": image, "cls": b"%d" % (i % 2)})
    split = load_split(f"wds:{tmp_path}/b-{{0..1}}.tar", "train")
    named = f"cannot read image s1-2 of {tmp_path}/b-1.tar"
    for training in (True, False):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vitlab"):
            loader = make_loader(split, 4, PRE, shuffle=training,
                                 augment=AUG if training else None, workers=0)  # fmt: skip
            batches = list(loader.iterate(0, 0) if training else loader)
        assert sum(len(y) for _, y in batches) == 8 and named in caplog.text, caplog.text


def test_writer_index_and_errors(tmp_path: Path, balanced: Path) -> None:
    root = write_image_folder(tmp_path / "images", per_class=10)
    (root / "class1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    jpeg = io.BytesIO()
    Image.new("RGB", (32, 32), (9, 99, 199)).save(jpeg, format="JPEG")
    (root / "class2" / "cut.jpg").write_bytes(jpeg.getvalue()[:200])  # a truncated JPEG
    assert main(["data", "shard", f"imagefolder:{root}", str(tmp_path / "shards"),
                 "--shard-size", "2KB", "--no-progress", "--workers", "2"]) == 0  # fmt: skip
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert index["classes"] == ["class0", "class1", "class2"] and index["in_chans"] == 3
    splits = index["splits"]
    counts = {n: s["count"] for n, s in splits.items()}
    # 30 good images and 2 that do not decode, carved 80/20 before the writer checks them
    assert (
        sum(counts.values()) == 30 and splits["train"]["skipped"] + splits["test"]["skipped"] == 2
    )
    assert len(splits["train"]["shards"]) > 2 and not list((tmp_path / "shards").glob(".*"))
    for shard in splits["train"]["shards"] + splits["test"]["shards"]:  # the files' sizes, tar
        assert shard["bytes"] == (tmp_path / "shards" / shard["name"]).stat().st_size  # included
    # the same data, the same bytes: checked in this process or by two workers
    write_shards(f"imagefolder:{root}", tmp_path / "again", 2000, progress=False, workers=0)
    for shard in splits["train"]["shards"] + splits["test"]["shards"]:
        name = shard["name"]
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "shards" / name).read_bytes()
    from vitlab.data import writer

    def fails_at_12(*args):  # a worker error or a Ctrl-C mid-split
        for n, sample in enumerate(real_samples(*args)):
            if n == 12:
                raise KeyboardInterrupt
            yield sample

    real_samples = writer.samples
    with pytest.MonkeyPatch.context() as m:
        m.setattr(writer, "samples", fails_at_12)
        with pytest.raises(KeyboardInterrupt):
            write_shards(f"imagefolder:{root}", tmp_path / "cut", 2000, progress=False, workers=0)
        (tmp_path / "mine").mkdir()  # a folder the user made is kept, empty
        with pytest.raises(KeyboardInterrupt):
            write_shards(f"imagefolder:{root}", tmp_path / "mine", 2000, progress=False, workers=0)
    assert not (tmp_path / "cut").exists()  # no shard, no .tmp, nor the folder the call made
    assert list((tmp_path / "mine").iterdir()) == []
    write_shards(f"imagefolder:{root}", tmp_path / "cut", 2000, progress=False, workers=0)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / ".train-000000.tar.tmp").write_bytes(b"")  # a killed writer's remains
    with pytest.raises(DatasetError, match="interrupted"):
        write_shards(f"imagefolder:{root}", tmp_path / "half", progress=False, workers=0)
    with pytest.raises(DatasetError, match="already holds shards"):
        write_shards(f"imagefolder:{root}", tmp_path / "again", progress=False, workers=0)
    train = load_split(f"wds:{tmp_path / 'shards'}", "train")
    assert len(train) == 25 and train.classes == index["classes"]
    kept, val = train_val_split(train, 0.2, 0)
    assert set(kept.urls).isdisjoint(val.urls) and len(kept) + len(val) == 25
    with pytest.raises(DatasetError, match="data.test"):
        load_split(f"wds:{balanced}/part-{{00..07}}.tar", "test")
    with pytest.raises(DatasetError, match="does not exist"):
        load_split(f"wds:{balanced}/nope-{{0..1}}.tar", "train")


def _images(spec: str) -> list[bytes]:
    """The encoded images of a split's samples, in order (the writer renames the keys)."""
    split = load_split(spec, "train")
    return [data for s in range(len(split.urls)) for _, data, _ in split.read(s)]


@pytest.mark.parametrize("buffer", [20, 10_000])  # 20: the window slides; 10,000: one shuffle
def test_resharding_a_pattern_writes_its_train_split_in_a_seeded_mix(
    tmp_path, balanced, buffer, monkeypatch
) -> None:
    """wds:PATTERN names one split: it is written as train only (it used to fail on the test
    split). The samples come out once each, in an order that --seed sets and that mixes the
    shards (it used to copy them in order); an output folder inside an image folder is refused
    before anything is written (it was scanned as one more class)."""
    from vitlab.data import writer

    monkeypatch.setattr(writer, "SHUFFLE_BUFFER", buffer)
    pattern = f"wds:{balanced}/part-{{00..07}}.tar"
    index = write_shards(pattern, tmp_path / "a", 2000, seed=0, progress=False)
    assert list(index["splits"]) == ["train"] and index["splits"]["train"]["count"] == 128
    inputs = _images(pattern)
    shard_of = {data: i // PER_SHARD for i, data in enumerate(inputs)}  # every image differs
    first = _images(f"wds:{tmp_path / 'a'}")
    assert sorted(first) == sorted(inputs) and first != inputs
    mixed = len({shard_of[d] for d in first[:PER_SHARD]})  # input shards in one shard's worth
    assert mixed >= (4 if buffer > len(inputs) else 2), mixed  # a 20-sample window spans 2-3
    write_shards(pattern, tmp_path / "b", 2000, seed=1, progress=False)
    again = _images(f"wds:{tmp_path / 'b'}")
    assert sorted(again) == sorted(first) and again != first
    root = write_image_folder(tmp_path / "images", per_class=2)
    with pytest.raises(DatasetError, match="is inside the image folder"):
        write_shards(f"imagefolder:{root}", root / "shards", progress=False, workers=0)
    assert not (root / "shards").exists()
    # beside train/ and test/, which alone are read, it is no class
    split = tmp_path / "split"
    for part in ("train", "test"):
        write_image_folder(split / part, per_class=2)
    index = write_shards(f"imagefolder:{split}", split / "shards", 2000, progress=False, workers=0)
    assert index["classes"] == ["class0", "class1", "class2"]


def test_a_label_that_is_no_class_index_names_its_sample(tmp_path: Path) -> None:
    import webdataset as wds

    (tmp_path / "s").mkdir()
    rng = np.random.default_rng(0)
    with wds.TarWriter(str(tmp_path / "s" / "p-0.tar")) as w:
        w.write({"__key__": "good", "png": png(rng, 0), "cls": b"0"})
        w.write({"__key__": "bad", "png": png(rng, 1), "cls": b"-1"})
    with pytest.raises(DatasetError, match=r"sample bad in .*p-0.tar: its label -1 is not a class"):
        split = load_split(f"wds:{tmp_path / 's'}/p-{{0..0}}.tar", "train")  # counted: read
        list(split.read(0))


def test_an_index_naming_a_command_as_a_shard_runs_nothing(tmp_path: Path, monkeypatch) -> None:
    """A shard named pipe:CMD in index.json ran CMD in a shell (webdataset's pipe: scheme) for
    every command reading wds:FOLDER, or an index at a URL (a QA pass). An index names shards by
    path or URL; a command runs only where it is typed (wds:pipe:CMD)."""
    import json

    root = write_image_folder(tmp_path / "images", per_class=2)
    write_shards(f"imagefolder:{root}", tmp_path / "shards", 1500, progress=False, workers=0)
    good = load_split(f"wds:{tmp_path / 'shards'}", "train")
    marker = tmp_path / "ran"
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    first = index["splits"]["train"]["shards"][0]
    real = first["name"]
    for name in (f"pipe:touch {marker}; cat {tmp_path / 'shards' / real}",
                 f"ais://bucket/{real}"):  # fmt: skip
        first["name"] = name
        (tmp_path / "shards" / "index.json").write_text(json.dumps(index))
        with pytest.raises(DatasetError, match="names a shard .*: an index names its shards by "
                                               "path or file, http, https, gs URL"):  # fmt: skip
            load_split(f"wds:{tmp_path / 'shards'}", "train")
        assert not marker.exists()
    for entry in ([real], {"name": real}, {"name": 5, "count": 1}):
        index["splits"]["train"]["shards"][0] = entry
        (tmp_path / "shards" / "index.json").write_text(json.dumps(index))
        with pytest.raises(DatasetError, match="is not a vitlab shard index: a shard entry"):
            load_split(f"wds:{tmp_path / 'shards'}", "train")
    index["splits"]["train"]["shards"][0] = first
    monkeypatch.chdir(tmp_path / "shards")  # wds:. : a name joined to "." is itself (a review)
    for name in ("ais:bucket/x.tar", "./-", "scp:127.0.0.1:1/x.tar"):
        first["name"] = name
        (tmp_path / "shards" / "index.json").write_text(json.dumps(index))
        with pytest.raises(DatasetError, match="names a shard"):
            load_split("wds:.", "train")
    first["name"] = str(tmp_path / "shards" / real)  # an absolute path: read
    (tmp_path / "shards" / "index.json").write_text(json.dumps(index))
    assert load_split(f"wds:{tmp_path / 'shards'}", "train").counts == good.counts


def test_shards_by_url_over_http_and_file(tmp_path: Path, balanced: Path) -> None:
    """Shards a local HTTP server serves (webdataset's gopen: curl): the index's URL, and a
    pattern of URLs counted from the index beside them; file:// patterns without an index are
    counted by reading them. Each reads the same samples as the local files."""
    import functools
    import http.server
    import shutil
    import threading

    root = write_image_folder(tmp_path / "images", per_class=8)
    write_shards(f"imagefolder:{root}", tmp_path / "served", 1500, progress=False, workers=0)
    local = load_split(f"wds:{tmp_path / 'served'}", "train")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/served"
    try:
        if shutil.which("curl") is None:
            pytest.skip("webdataset opens http:// URLs with curl, which is not installed")
        by_index = load_split(f"wds:{base}/index.json", "train")
        assert by_index.urls == [f"{base}/{Path(u).name}" for u in local.urls]
        assert by_index.counts == local.counts and by_index.classes == local.classes
        n = len(local.urls)
        pattern = load_split(f"wds:{base}/train-{{000000..{n - 1:06d}}}.tar", "train")
        assert pattern.counts == local.counts and pattern.classes == local.classes
        assert [list(pattern.read(i)) for i in range(n)] == [list(local.read(i)) for i in range(n)]
        with pytest.raises(DatasetError, match="cannot read shard index .*404: File not found"):
            load_split(f"wds:{base}/nothing/index.json", "train")
    finally:
        server.shutdown()
    with pytest.raises(DatasetError, match="cannot read shard index http://no-such-host.invalid"):
        load_split("wds:http://no-such-host.invalid/index.json", "train")  # not curl's retries
    counted = load_split(f"wds:file://{balanced}/part-{{00..07}}.tar", "train")
    # re-sharded, a sample whose bytes are another format (a BMP under .png) is stored as PNG
    import webdataset as wds

    bmp = io.BytesIO()
    Image.new("RGB", (6, 5), (10, 200, 30)).save(bmp, format="BMP")
    with wds.TarWriter(str(tmp_path / "odd-0.tar")) as w:
        for i in range(4):
            w.write({"__key__": f"k{i}", "png": bmp.getvalue(), "cls": b"0"})
    from vitlab.data.writer import samples

    odd = load_split(f"wds:{tmp_path}/odd-{{0..0}}.tar", "train")
    stored = list(samples(odd, 0, 3, workers=0))
    assert [(ext, why) for _, ext, _, why in stored] == [("png", None)] * 4
    assert all(data.startswith(b"\x89PNG") for data, *_ in stored)
    assert counted.counts == [PER_SHARD] * SHARDS and counted.classes == ["0", "1", "2"]


def test_train_from_shards_interrupted_mid_epoch_resumes_exactly(tmp_path, monkeypatch) -> None:
    """`vitlab train` from shards the writer made, workers reading them, Ctrl-C mid-epoch 2 and
    --resume: the weights equal an uninterrupted run's bit for bit."""
    root = write_image_folder(tmp_path / "images", per_class=40)
    write_shards(f"imagefolder:{root}", tmp_path / "shards", shard_size=3000, progress=False)
    common = [*TINY_MODEL, f"data.name=wds:{tmp_path / 'shards'}", "data.workers=2",
              "data.hflip=0.5", "data.shuffle_buffer=20", "train.batch_size=16",
              "train.epochs=2", "train.precision=fp32", "data.val_fraction=0.2"]  # fmt: skip
    cfg = load_run_config(None, common)
    straight = train(cfg, out=tmp_path / "straight")
    assert json.loads((straight / "results.json").read_text())["top1"] is not None
    monkeypatch.setattr(run_mod, "StopFlag", CtrlCAtCheck)
    with pytest.raises(TrainingStopped, match="stopped at epoch 2"):
        train(cfg, out=tmp_path / "stopped")
    monkeypatch.undo()
    resumed = resume(tmp_path / "stopped")
    for which in ("last", "best"):
        a, b = weights_of(straight, which), weights_of(resumed, which)
        assert all(torch.equal(a[k], b[k]) for k in a), which


def test_two_rank_ddp_reads_distinct_shards_and_trains(tmp_path: Path, balanced: Path) -> None:
    """Under torchrun (2 ranks, gloo): each rank's DataLoader workers read shards no other rank
    reads, together every sample of the epoch once; and `vitlab train` trains from them."""
    import subprocess

    from tests.helpers import TORCHRUN, kill_tree, one_thread_env

    root = Path(__file__).resolve().parents[1]
    spec = {"shards": f"{balanced}/part-{{00..07}}.tar", "out": str(tmp_path)}
    args = [*TORCHRUN, "-m", "tests.test_shards", json.dumps(spec)]
    proc = subprocess.Popen(args, cwd=root, env=one_thread_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        stdout, stderr = kill_tree(proc)
        pytest.fail(f"torchrun hung: {stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    ranks = [json.loads((tmp_path / f"keys{r}.json").read_text()) for r in range(2)]
    everything = {f"s{s}-{i:02d}" for s in range(SHARDS) for i in range(PER_SHARD)}
    assert set(ranks[0]).isdisjoint(ranks[1]) and set(ranks[0]) | set(ranks[1]) == everything
    assert {k.split("-")[0] for k in ranks[0]}.isdisjoint(k.split("-")[0] for k in ranks[1])
    assert json.loads((tmp_path / "run" / "results.json").read_text())["top1"] is not None


def rank_worker(spec: dict) -> None:
    """One torchrun rank: its epoch-0 sample keys (2 DataLoader workers), then a short DDP run."""
    import os

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    split = load_split(f"wds:{spec['shards']}", "train")
    keys, _ = epoch_keys(split, 0, rank=rank, world=world, workers=2)
    (Path(spec["out"]) / f"keys{rank}.json").write_text(json.dumps(keys))
    cfg = load_run_config(None, [*TINY_MODEL, f"data.name=wds:{spec['shards']}",
                                 f"data.test=wds:{spec['shards']}", "data.workers=2",
                                 "data.val_fraction=0", "train.batch_size=16",
                                 "train.epochs=1", "train.precision=fp32"])  # fmt: skip
    train(cfg, out=Path(spec["out"]) / "run")


if __name__ == "__main__":
    import sys

    rank_worker(json.loads(sys.argv[1]))


def test_shard_sizes_and_keys_that_do_not_apply_are_refused(tmp_path, balanced, capsys) -> None:
    """0 once wrote one shard per sample, 1e400 raised OverflowError, '.MB' a bare float error."""
    from vitlab.data.writer import parse_size

    assert parse_size("1GB") == 10**9 and parse_size("2.5e3") == 2500 and parse_size("2kb") == 2000
    for bad in ("0", "0MB", "1e400", ".MB", "1e", "-5MB", "5XB"):
        with pytest.raises(ValueError, match="a positive number of bytes with a unit"):
            parse_size(bad)
    assert main(["data", "shard", "digits", str(tmp_path / "s"), "--shard-size", "0"]) == 2
    assert "got '0'" in capsys.readouterr().err and not (tmp_path / "s").exists()
    assert main(["data", "shard", "digits", str(tmp_path / "s"), "--image-key", "img"]) == 2
    assert "name an hf: dataset's columns" in capsys.readouterr().err  # once ignored
    for where in (["-q", "data", "shard"], ["data", "shard", "-q"]):  # the second: refused
        assert main([*where, "digits", str(tmp_path / "s"), "--shard-size", "0"]) == 2
        err = capsys.readouterr().err
        assert "got '0'" in err and "unrecognized arguments" not in err, err
    (tmp_path / "afile").write_text("mine")  # DST a file, or under one: "[Errno 17] File exists"
    for dst in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        assert main(["data", "shard", "digits", str(dst), "--no-progress"]) == 2
        assert f"{tmp_path / 'afile'} is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "mine"
    pattern = f"wds:{balanced}/part-{{00..07}}.tar"  # shards' extensions: the keys apply
    args = ["data", "shard", pattern, str(tmp_path / "w"), "--no-progress", "--workers", "1"]
    assert main([*args, "--image-key", "png", "--label-key", "cls"]) == 0


def test_eval_takes_shards_named_by_a_pattern_as_its_test_images(balanced: Path, tmp_path, capsys):
    """`vitlab eval CKPT --data wds:PATTERN` was refused ("set data.test", which eval has no way
    to set): the pattern's shards are the images evaluated, every one, scored as the model's own
    argmax over them (read here from the tar files with PIL)."""
    import tarfile

    from tests.helpers import tiny_checkpoint
    from vitlab import load_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "c", img_size=8, in_chans=3, num_classes=3)
    model, meta = load_checkpoint(ckpt)
    images, labels = [], []
    for s in range(SHARDS):
        with tarfile.open(balanced / f"part-{s:02d}.tar") as tar:
            files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name in sorted(n for n in files if n.endswith(".png")):
            images.append(torch.from_numpy(np.array(Image.open(io.BytesIO(files[name])))))
            labels.append(int(files[name.removesuffix("png") + "cls"]))
    batch = torch.stack(images).permute(0, 3, 1, 2)
    with torch.no_grad():
        right = (model(meta.preprocessing.batch(batch)).argmax(1) == torch.tensor(labels)).sum()
    pattern = f"wds:{balanced}/part-{{00..07}}.tar"
    assert main(["eval", str(ckpt), "--data", pattern, "--out", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_images"] == SHARDS * PER_SHARD == len(labels)
    assert result["top1"] == pytest.approx(right.item() / len(labels))


def test_a_shard_url_curl_cannot_read_is_said_in_words() -> None:
    """webdataset reads http(s) shards through curl and fails with its arguments and a Pipe
    object (a QA run, offline: "OSError: ((['curl', '--connect-timeout', '30', ...],), {...}):
    exit 6 (read) {}"); the error names curl's exit code and what it means."""
    from vitlab.data.shards import _reason

    raw = OSError("((['curl', '--connect-timeout', '30', '--retry', '30', '-f', '-s', '-L', "
                  "'https://example.invalid/train-0000.tar'],), {'bufsize': 8192}): exit 6 "
                  "(read) {}")  # fmt: skip
    assert _reason(raw) == "curl exit 6 (could not resolve the host), after curl's retries"
    assert _reason(ValueError("bad tar")) == "ValueError: bad tar"
    if shutil.which("curl") is None:
        pytest.skip("webdataset reads http(s) shards with curl, which is not installed")
    split = ShardSplit(["http://127.0.0.1:9/x.tar"], [1], ["a"])  # refused: curl does not retry
    with pytest.raises(DatasetError, match=r"x.tar: curl exit 7 \(could not connect to the "
                       r"host\)$"):  # fmt: skip
        list(split.read(0))


def test_a_damaged_remote_shard_fails_at_once(served) -> None:
    """A shard URL serving 20 MB that are no tar: tarfile fails on its header while curl is still
    sending into the pipe; waiting for curl's exit there hung (a review caught it)."""
    import threading

    if shutil.which("curl") is None:
        pytest.skip("webdataset reads http(s) shards with curl, which is not installed")
    folder, url = served
    (folder / "x.tar").write_bytes(np.random.default_rng(0).bytes(20 << 20))
    errors: list[Exception] = []

    def read() -> None:
        try:
            list(ShardSplit([f"{url}x.tar"], [1], ["a"]).read(0))
        except Exception as e:
            errors.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=60)
    assert not reader.is_alive(), "the read hangs"
    assert isinstance(errors[0], DatasetError) and "cannot read shard" in str(errors[0])
    assert "Pipe object" not in str(errors[0])  # tarfile's words, not webdataset's repr


def signal_group_when(proc: subprocess.Popen, ready, signum: int, timeout: float = 120) -> str:
    """Send `signum` to proc's whole process group (as a terminal's Ctrl-C or a scheduler does,
    reaching the loader's workers too) once ready() holds; proc's stderr after it ends."""
    try:
        deadline = time.monotonic() + timeout
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):  # ended first: its stderr says why
            os.killpg(proc.pid, signum)
        return proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.skipif(find_fashion_mnist(None) is None, reason="Fashion-MNIST files not installed")
def test_sigterm_to_the_group_while_sharding_with_workers_says_one_line(tmp_path: Path) -> None:
    """The loader's workers died of the signal before the command's clean-up, whose loader then
    printed a traceback ("DataLoader worker ... is killed by signal: Terminated")."""
    dst = tmp_path / "shards"
    proc = subprocess.Popen(
        [*VITLAB, "data", "shard", "fashion-mnist", str(dst), "--shard-size", "200KB",
         "--workers", "2", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    err = signal_group_when(proc, lambda: any(dst.glob("train-*.tar")), signal.SIGTERM)
    assert proc.returncode == 143 and err.strip().endswith("vitlab data: terminated"), err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert not dst.exists()  # shards without their index, and the folder made for them: removed


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_group_stops_training_once_with_loader_workers(tmp_path, signum) -> None:
    """Each loader worker ran the run's stop handler too on Ctrl-C: "stop requested" three times
    with two workers; a SIGTERM killed the workers, and the run failed mid-step ("DataLoader
    worker ... is killed by signal"), unsaved. The stop: saved, exit 128 + the signal."""
    folder = write_image_folder(tmp_path / "images")
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [*VITLAB, "train", *TINY_MODEL, f"data.name=imagefolder:{folder}", "data.workers=2",
         "train.epochs=200", "train.batch_size=8", "train.threads=1", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    err = signal_group_when(proc, lambda: (out / "checkpoints/last").is_dir(), signum)
    assert proc.returncode == 128 + signum and "checkpoint saved" in err, err
    assert err.count("stop requested") == 1, err


def test_quiet_hides_the_sharding_bar_and_one_shard_is_said_so(tmp_path: Path, capsys) -> None:
    """-q hides progress bars (its help says so); `data shard`'s took only --no-progress."""
    assert main(["data", "shard", "digits", str(tmp_path / "a"), "--shard-size", "10MB"]) == 0
    assert "sharding digits" in capsys.readouterr().err  # the bar, without -q
    assert main(["-q", "data", "shard", "digits", str(tmp_path / "b"), "--shard-size", "10MB"]) == 0
    out, err = capsys.readouterr()
    index = json.loads((tmp_path / "b" / "index.json").read_text())
    assert len(index["splits"]["test"]["shards"]) == 1 and "sharding" not in err, err
    assert f"test: {index['splits']['test']['count']:,} samples in 1 shard\n" in out, out


def test_a_truncated_shard_is_said_in_words_and_a_failed_write_leaves_no_folder(
    tmp_path: Path, capsys
) -> None:
    """A cut local shard was said as tarfile's error tuple with a BufferedReader's repr; a
    write that failed (a damaged source, workers < 0) left the empty DST folder it had made."""
    assert main(["data", "shard", "digits", str(tmp_path / "s"), "--no-progress"]) == 0
    shard = tmp_path / "s" / "train-000000.tar"
    shard.write_bytes(shard.read_bytes()[:3000])  # cut inside its third member
    capsys.readouterr()
    for dst, more in ((tmp_path / "again", []), (tmp_path / "neg", ["--workers", "-1"])):
        source = f"wds:{tmp_path / 's'}" if not more else "digits"
        assert main(["data", "shard", source, str(dst), "--no-progress", *more]) == 2
        err = capsys.readouterr().err
        assert not dst.exists(), err
    assert "got -1" in err
    with pytest.raises(DatasetError, match="cannot read shard .*unexpected end of data") as e:
        count = json.loads((tmp_path / "s" / "index.json").read_text())["splits"]["train"]
        list(ShardSplit([str(shard)], [count["count"]], [str(c) for c in range(10)]).read(0))
    assert "BufferedReader" not in str(e.value) and "(" not in str(e.value), str(e.value)


def test_a_damaged_shard_met_in_a_worker_is_said_in_one_line(tmp_path: Path, capsys) -> None:
    """Training read a cut shard in a DataLoader worker, and PyTorch re-raised its error as
    "Caught DatasetError in DataLoader worker process 0" with the worker's 25-line traceback
    (evaluation said the one line): now the error as the worker raised it, in both loaders."""
    assert main(["data", "shard", "digits", str(tmp_path / "s"), "--no-progress"]) == 0
    shard = tmp_path / "s" / "train-000000.tar"
    shard.write_bytes(shard.read_bytes()[:3000])  # cut inside its third member
    capsys.readouterr()
    args = ["train", "--out", str(tmp_path / "run"), *TINY_MODEL, f"data.name=wds:{tmp_path / 's'}"]
    assert main([*args, "data.workers=1", "data.val_fraction=0", "train.epochs=1"]) == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("vitlab train: error: ")]
    assert said == [f"vitlab train: error: cannot read shard {shard}: ReadError: unexpected end "
                    f"of data, {shard}"], err  # fmt: skip
    assert "Traceback" not in err and "Caught" not in err
    from vitlab.data.workers import LoaderOptions, from_workers

    class Failing(torch.utils.data.Dataset):  # an image-file loader's worker, failing
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int):
            raise DatasetError(f"sample {i}: no label")

    batches = LoaderOptions(workers=1, persistent=False).dataloader(Failing(), batch_size=None)
    with pytest.raises(DatasetError) as e:
        list(from_workers(batches))
    assert str(e.value) == "sample 0: no label"

    def chained():  # any other error comes through as it was, its cause kept
        try:
            raise KeyError("x")
        except KeyError as cause:
            raise RuntimeError("collate failed") from cause
        yield

    with pytest.raises(RuntimeError) as e:
        list(from_workers(chained()))
    assert isinstance(e.value.__cause__, KeyError)  # (raised from None, it was lost)


def test_a_signal_as_a_shard_opens_leaves_no_tmp_file(tmp_path: Path, monkeypatch) -> None:
    """Interrupted between a shard's .tmp file opening and its writer's start, the write left that
    file, and so its folder, which a rerun then refused as an interrupted write's remains."""
    import webdataset as wds

    real, calls = wds.TarWriter, []

    def interrupted_at_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(wds, "TarWriter", interrupted_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        write_shards("digits", tmp_path / "s", 20_000, progress=False, workers=0)
    assert len(calls) == 2 and not (tmp_path / "s").exists()


WORKER_SCRIPT = """
import os, signal, sys, time
import torch
from vitlab.data.workers import LoaderOptions

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):  # the first item: which process, which group; then a stuck read
        if i:
            time.sleep(600)
        return torch.tensor([os.getpid(), os.getpgid(0)])

loader = LoaderOptions(workers=1).dataloader(Slow(), batch_size=None)
print(*next(iter(loader)).tolist(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the main killed (kill -9, the OOM killer) mid-read
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, prctl: Linux")
def test_a_loader_worker_has_its_own_group_and_ends_with_its_parent(tmp_path: Path) -> None:
    """In the command's group, a SIGTERM to it killed the workers first, and training then failed
    mid-step ("DataLoader worker ... is killed by signal"), unsaved. Out of it, a worker stuck in
    a read must still not outlive a main killed with SIGKILL."""
    proc = subprocess.run([sys.executable, "-c", WORKER_SCRIPT], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid, group = map(int, proc.stdout.split())
    assert group == pid != os.getpgid(0)  # a group of its own
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text() if Path(f"/proc/{pid}").exists() else ""
        if "State:\tZ" in status:  # ended, not yet reaped
            break
        time.sleep(0.1)
    state = Path(f"/proc/{pid}/status").read_text() if Path(f"/proc/{pid}").exists() else ""
    assert not state or "State:\tZ" in state, state
