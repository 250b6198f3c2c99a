"""Datasets, files and loaders: IDX, CIFAR pickles, image folders, downloads, augmentation."""

from __future__ import annotations

import gzip
import io
import logging
import os
import pickle
import struct
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.config import DataConfig
from vitlab.data import (
    ArraySplit,
    BatchAugment,
    Preprocessing,
    download,
    load_split,
    make_loader,
    train_val_split,
)
from vitlab.data.datasets import DatasetError, read_digits, read_idx
from vitlab.data.folders import folder_files, load_folder_split, read_image, scan_image_folder
from vitlab.data.loader import PADDING, BatchPlan
from vitlab.data.transforms import random_erase, random_hflip, random_shift

FASHION = download.find_fashion_mnist(None)


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_read_idx_and_its_errors(tmp_path: Path) -> None:
    images = np.random.default_rng(0).integers(0, 256, (5, 28, 28))
    write_idx(tmp_path / "x.gz", images)
    assert np.array_equal(read_idx(tmp_path / "x.gz"), images)
    with pytest.raises(DatasetError, match="SHA-256 does not match"):
        read_idx(tmp_path / "x.gz", sha256="0" * 64)
    raw = gzip.decompress((tmp_path / "x.gz").read_bytes())
    (tmp_path / "short.gz").write_bytes(gzip.compress(raw[:-100]))
    with pytest.raises(DatasetError, match="truncated"):
        read_idx(tmp_path / "short.gz")
    (tmp_path / "bad.gz").write_bytes(gzip.compress(b"\x01\x02\x03\x04" + raw[4:]))
    with pytest.raises(DatasetError, match="magic"):
        read_idx(tmp_path / "bad.gz")
    (tmp_path / "notgz.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DatasetError, match="cannot read IDX"):
        read_idx(tmp_path / "notgz.gz")


@pytest.mark.skipif(FASHION is None, reason="Fashion-MNIST files not installed")
def test_real_fashion_mnist_files() -> None:
    train, test = load_split("fashion-mnist", "train"), load_split("fashion-mnist", "test")
    assert train.images.shape == (60000, 1, 28, 28) and test.images.shape == (10000, 1, 28, 28)
    assert train.images.dtype == torch.uint8
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    assert train.classes[9] == "Ankle boot"


@pytest.mark.skipif(FASHION is None, reason="Fashion-MNIST files not installed")
def test_corrupt_fashion_mnist_is_refused(tmp_path: Path) -> None:
    for name, path in FASHION.items():
        (tmp_path / name).write_bytes(path.read_bytes())
    labels = tmp_path / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(gzip.decompress(labels.read_bytes()))
    raw[100] = (raw[100] + 1) % 10
    labels.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(DatasetError, match="corrupt"):
        load_split("fashion-mnist", "test", str(tmp_path))


@pytest.fixture
def no_fashion_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("VITLAB_DATA", raising=False)
    monkeypatch.setattr(download, "DEBIAN_DIR", tmp_path / "debian")
    monkeypatch.setattr(download, "cache_dir", lambda: tmp_path / "cache")
    return tmp_path


def test_missing_fashion_mnist_offline_names_both_ways(no_fashion_anywhere, monkeypatch) -> None:
    open_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(DatasetError) as err:
        load_split("fashion-mnist", "train")
    msg = str(err.value)
    assert "apt-get install dataset-fashion-mnist" in msg and "127.0.0.1:9" in msg
    assert len(os.listdir("/proc/self/fd")) == open_before  # the temp file's descriptor closed
    # where else the files may go, as each command takes it (it offered `vitlab reproduce` and
    # `vitlab train` a --data-dir neither has)
    assert "$VITLAB_DATA, `vitlab train`'s data.dir= or another command's --data-dir" in msg


def test_download_checks_sha256_and_writes_atomically(no_fashion_anywhere, monkeypatch,
                                                      served) -> None:  # fmt: skip
    """A loopback HTTP server stands in for the mirror: right payloads install, a wrong one is
    refused and leaves nothing behind."""
    served, url = served
    rng = np.random.default_rng(0)
    write_idx(served / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (6, 28, 28)))
    write_idx(served / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, (6,)))
    write_idx(served / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (4, 28, 28)))
    write_idx(served / "t10k-labels-idx1-ubyte.gz", rng.integers(0, 10, (4,)))
    digests = {p.name: download.payload_sha256(p) for p in served.iterdir()}
    mask = os.umask(0o002)  # a group-shared data folder: files as any other file written there
    try:
        monkeypatch.setattr(download, "FASHION_MIRROR", url)
        cut = served / "t10k-images-idx3-ubyte.gz"  # a download cut short: once a bare EOFError
        whole = cut.read_bytes()
        cut.write_bytes(whole[: len(whole) // 2])
        monkeypatch.setattr(download, "FASHION_SHA256", digests)
        with pytest.raises(DatasetError, match="the download is incomplete"):
            download.find_or_fetch_fashion_mnist(None)
        cut.write_bytes(whole)
        bad = dict(digests, **{"t10k-labels-idx1-ubyte.gz": "0" * 64})
        monkeypatch.setattr(download, "FASHION_SHA256", bad)
        with pytest.raises(DatasetError, match="does not match"):
            download.find_or_fetch_fashion_mnist(None)
        target = no_fashion_anywhere / "cache" / "fashion-mnist"
        assert not (target / "t10k-labels-idx1-ubyte.gz").exists()
        assert not [p for p in target.iterdir() if p.name.startswith(".")]  # no temp files left
        monkeypatch.setattr(download, "FASHION_SHA256", digests)
        files = download.find_or_fetch_fashion_mnist(None)
        assert sorted(files) == sorted(digests)
        assert all(download.payload_sha256(p) == digests[n] for n, p in files.items())
        assert {p.stat().st_mode & 0o777 for p in files.values()} == {0o664}
    finally:
        os.umask(mask)


def cifar_batch(n: int, seed: int, key: str = "labels") -> bytes:
    rng = np.random.default_rng(seed)
    batch = {
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        key.encode(): rng.integers(0, 10, n).tolist(),
        b"batch_label": b"x",
    }
    return pickle.dumps(batch)


def make_cifar10(folder: Path) -> None:
    folder.mkdir(parents=True)
    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(cifar_batch(4, i))
    (folder / "test_batch").write_bytes(cifar_batch(3, 9))
    names = [f"c{i}".encode() for i in range(10)]
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": names}))


def test_cifar10_from_folder_and_archive(tmp_path: Path) -> None:
    make_cifar10(tmp_path / "a" / "cifar-10-batches-py")
    train = load_split("cifar10", "train", str(tmp_path / "a"))
    test = load_split("cifar10", "test", str(tmp_path / "a"))
    assert train.images.shape == (20, 3, 32, 32) and test.images.shape == (3, 3, 32, 32)
    assert train.classes == [f"c{i}" for i in range(10)]
    raw = pickle.loads(cifar_batch(4, 1))
    assert np.array_equal(train.images[:4].numpy().reshape(4, -1), raw[b"data"])
    assert train.labels[:4].tolist() == raw[b"labels"]  # each image with its own label
    assert test.labels.tolist() == pickle.loads(cifar_batch(3, 9))[b"labels"]
    (tmp_path / "b").mkdir()
    with tarfile.open(tmp_path / "b" / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "a" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    from_tar = load_split("cifar10", "train", str(tmp_path / "b"))
    assert torch.equal(from_tar.images, train.images) and torch.equal(from_tar.labels, train.labels)


def test_cifar100_reads_fine_labels_and_their_names(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    (folder / "train").write_bytes(cifar_batch(5, 1, key="fine_labels"))
    (folder / "test").write_bytes(cifar_batch(2, 2, key="fine_labels"))
    names = [f"f{i}".encode() for i in range(100)]
    (folder / "meta").write_bytes(pickle.dumps({b"fine_label_names": names}))
    train = load_split("cifar100", "train", str(tmp_path))
    raw = pickle.loads(cifar_batch(5, 1, key="fine_labels"))
    assert train.classes == [f"f{i}" for i in range(100)] and len(train) == 5
    assert np.array_equal(train.images.numpy().reshape(5, -1), raw[b"data"])
    assert train.labels.tolist() == raw[b"fine_labels"]
    assert len(load_split("cifar100", "test", str(tmp_path))) == 2


def test_cifar_hostile_pickle_and_missing_files(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    make_cifar10(tmp_path / "cifar-10-batches-py")
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps({b"data": Evil()}))
    with pytest.raises(DatasetError, match="refusing to unpickle builtins.print"):
        load_split("cifar10", "test", str(tmp_path))
    with pytest.raises(DatasetError, match="not found"):  # offline (conftest)
        load_split("cifar100", "test", str(tmp_path / "empty"))
    # a label out of range and a batch missing: said which, where (it said every file missing)
    folder = tmp_path / "cifar-10-batches-py"
    batch = pickle.loads(cifar_batch(3, 9))
    batch[b"labels"][1] = 10
    (folder / "test_batch").write_bytes(pickle.dumps(batch))
    with pytest.raises(DatasetError, match=rf"test_batch \(under {tmp_path}\): labels\[1\] is "
                                           r"10, not a class index 0..9"):  # fmt: skip
        load_split("cifar10", "test", str(tmp_path))
    (folder / "data_batch_5").unlink()
    with pytest.raises(DatasetError, match=rf"{folder} holds CIFAR files but not \['data_b"):
        load_split("cifar10", "train", str(tmp_path))


def test_processes_fetching_one_file_take_turns(tmp_path: Path, monkeypatch) -> None:
    """Two fetches of one file at once (torchrun's ranks, each loading CIFAR): one downloads, the
    other waits for the folder's lock and then finds the file (each downloaded it before)."""
    calls = []

    def slow(url, dest, sha, gzipped):
        calls.append(url)
        time.sleep(0.3)
        dest.write_bytes(b"x")

    monkeypatch.setattr(download, "_download", slow)
    dest = tmp_path / "d" / "a.tar.gz"
    threads = [threading.Thread(target=download.fetch, args=("u", dest, "0", False))
               for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["u"] and dest.read_bytes() == b"x"
    import fcntl  # a file system that refuses an flock on a folder (NFS): downloads all the same

    def refused(fd, op):
        raise OSError(9, "Bad file descriptor")

    monkeypatch.setattr(fcntl, "flock", refused)
    download.fetch("v", tmp_path / "d" / "b.tar.gz", "0", False)
    assert calls == ["u", "v"] and (tmp_path / "d" / "b.tar.gz").is_file()


def test_missing_cifar_is_downloaded_checked_and_read(tmp_path, served, monkeypatch) -> None:
    """Neither the archive nor its folder found: the archive is fetched into the folder CIFAR is
    read from ($VITLAB_DATA here), its SHA-256 checked (a wrong one refused, nothing left), and
    read with the images and labels of the batches it holds; offline, both ways are named."""
    from vitlab.data import cifar

    served, url = served
    monkeypatch.setattr(cifar, "MIRROR", url)
    make_cifar10(tmp_path / "src" / "cifar-10-batches-py")
    archive = served / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    digest = download.file_sha256(archive)
    data = tmp_path / "data"
    monkeypatch.setenv("VITLAB_DATA", str(data))
    monkeypatch.setitem(cifar.ARCHIVES, "cifar10", ("cifar-10-python.tar.gz", "0" * 64))
    with pytest.raises(DatasetError, match="does not match the expected 0000"):
        load_split("cifar10", "test")
    assert not data.exists() or not list(data.iterdir())  # no archive, no temporary file
    monkeypatch.setitem(cifar.ARCHIVES, "cifar10", ("cifar-10-python.tar.gz", digest))
    test = load_split("cifar10", "test")
    assert (data / "cifar-10-python.tar.gz").read_bytes() == archive.read_bytes()
    assert test.labels.tolist() == pickle.loads(cifar_batch(3, 9))[b"labels"]
    raw = pickle.loads(cifar_batch(4, 1))[b"data"]
    assert np.array_equal(load_split("cifar10", "train").images[:4].numpy().reshape(4, -1), raw)
    archive.unlink()  # the site gone: the archive read again from the folder
    assert torch.equal(load_split("cifar10", "test").images, test.images)
    from vitlab.eval.feature_cache import identity

    # a feature cache's key is the files read: fetched first (an empty folder's digest before)
    archive.write_bytes((data / "cifar-10-python.tar.gz").read_bytes())
    fresh = str(tmp_path / "fresh")
    key = identity("cifar10", data_dir=fresh)
    assert (tmp_path / "fresh" / "cifar-10-python.tar.gz").is_file()
    assert key == identity("cifar10", data_dir=fresh)
    monkeypatch.setattr(cifar, "MIRROR", "http://127.0.0.1:9/")  # refused at once
    with pytest.raises(DatasetError) as err:
        load_split("cifar100", "test", str(tmp_path / "empty"))
    msg = str(err.value)
    assert "not found under" in msg and "127.0.0.1:9" in msg and "cifar-100-python.tar.gz" in msg


def make_folder(root: Path) -> None:
    rng = np.random.default_rng(0)
    for cls, mode, size in (
        ("cat", "RGB", (40, 30)),
        ("dog", "L", (20, 50)),
        ("eel", "RGBA", (64, 64)),
    ):
        (root / cls).mkdir(parents=True)
        for i in range(4):
            shape = (size[1], size[0], len(mode)) if mode != "L" else (size[1], size[0])
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(
                root / cls / f"{i}.{'jpg' if mode == 'L' else 'png'}"
            )
    (root / "cat" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (root / "dog" / "notes.txt").write_text("not an image")


def test_image_folder_follows_links_to_folders_once_and_not_into_loops(tmp_path, caplog):
    """A class folder's link to a folder elsewhere is followed (as torchvision's ImageFolder
    does), its images listed under the link's path; links into the dataset's own folder (the
    class folder itself, a sibling class, the dataset above it), to the filesystem's root, to a
    folder holding the link, or to a target followed already, are not, and neither are links to
    nothing: a warning names each kind."""
    make_folder(tmp_path / "imgs")
    elsewhere = tmp_path / "more_cats"
    make_folder(elsewhere)  # as imgs: 5 cat image files (broken.png one of them)
    cat = tmp_path / "imgs" / "cat"
    os.symlink(elsewhere / "cat", cat / "again")  # followed: "again" sorts before "linked"
    os.symlink(elsewhere / "cat", cat / "linked")  # the same target: not twice
    os.symlink(elsewhere, elsewhere / "cat" / "back")  # above a followed target: a loop
    for name, target in (("loop", cat), ("up", tmp_path / "imgs"), ("dog", cat.parent / "dog")):
        os.symlink(target, cat / name)  # into the dataset: listed where they are
    os.symlink(Path(os.sep), cat / "root")
    os.symlink(tmp_path / "nothing", cat / "gone")
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        split = scan_image_folder(tmp_path / "imgs")
    cats = [f for f, y in zip(split.files, split.labels.tolist(), strict=True) if y == 0]
    assert len(cats) == 10 and sum("/cat/again/" in f for f in cats) == 5
    assert len(split) == 18  # 13 of the dataset's own and the 5 followed
    said = [r.getMessage() for r in caplog.records]
    skipped = [m for m in said if "did not follow 6 links" in m]
    named = ("again/back", "cat/dog", "cat/linked", "cat/loop", "cat/root")  # the first five
    assert len(skipped) == 1 and all(n in skipped[0] for n in named) and "..." in skipped[0]
    assert sum("1 links to nothing" in m and "/gone" in m for m in said) == 1


@pytest.mark.parametrize("first", ["inner", "outer"])
def test_links_to_nested_targets_list_every_file_once_in_either_order(tmp_path, first) -> None:
    """Two links of a class, one to a folder inside the other's target: the files came in or
    not by which link's name sorted first (a target above a followed one was skipped whole).
    Now each file is listed once either way, under the first link that reaches it."""
    shared = tmp_path / "shared"
    (shared / "big").mkdir(parents=True)
    for name in ("a.png", "b.png", "big/c.png", "big/d.png"):
        (shared / name).write_bytes(b"png")
    cat = tmp_path / "imgs" / "cat"
    cat.mkdir(parents=True)
    inner, outer = ("a", "b") if first == "inner" else ("b", "a")
    os.symlink(shared / "big", cat / inner)
    os.symlink(shared, cat / outer)
    split = scan_image_folder(tmp_path / "imgs")
    real = sorted(os.path.realpath(f) for f in split.files)
    assert real == sorted(str((shared / n).resolve()) for n in ("a.png", "b.png", "big/c.png",
                                                                  "big/d.png"))  # fmt: skip
    if first == "inner":  # big's files through the inner link, the rest through the outer
        assert sum(f"/cat/{inner}/" in f for f in split.files) == 2


def test_class_folders_linked_into_a_split_are_not_listed(tmp_path, caplog) -> None:
    """A class folder that is itself a link into a split folder (train/eel -> ../test/dog) listed
    those test images in training under its class; one linked to a sibling class, its images
    twice; two class folders, one in each split, linked to the same folder, the same images in
    both splits. None of these is listed now, and each is said; the digest's file list
    (folder_files) leaves them out alike. A class folder linked to a folder outside the splits is
    listed (the dataset's unscanned images/ among them), and so is a link inside a class to such
    a folder."""
    root = tmp_path / "ds"
    for name in ("train/cat/a.png", "train/dog/b.png", "test/cat/t.png", "test/dog/u.png",
                 "images/fox/f.png", "images/owl/o.png", "images/more/m.png"):  # fmt: skip
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"png")
    os.symlink(root / "test" / "dog", root / "train" / "eel")  # a test image to training
    os.symlink(root / "test", root / "train" / "emu")  # the whole test split
    os.symlink(root / "train" / "cat", root / "train" / "gnu")  # a training image twice
    os.symlink(root / "images" / "fox", root / "train" / "fox")  # and from test: in both
    os.symlink(root / "train" / "fox", root / "test" / "fox")  # (a link to that link)
    os.symlink(root / "images" / "owl", root / "train" / "owl")  # not scanned: listed
    os.symlink(root / "images" / "more", root / "train" / "cat" / "more")  # alike
    os.symlink(root, root / "train" / "all")  # holds both splits
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        train = load_folder_split(root, "train", 0)
        test = load_folder_split(root, "test", 0)

    def real(files: list[str]) -> list[str]:
        return sorted(os.path.relpath(os.path.realpath(f), root.resolve()) for f in files)

    assert real(train.files) == ["images/more/m.png", "images/owl/o.png", "train/cat/a.png",
                                 "train/dog/b.png"]  # fmt: skip
    assert real(test.files) == ["test/cat/t.png", "test/dog/u.png"]
    assert train.classes == ["all", "cat", "dog", "eel", "emu", "fox", "gnu", "owl"]
    said = " ".join(r.getMessage() for r in caplog.records)
    for name in ("train/eel", "train/emu", "train/gnu", "train/all", "train/fox", "test/fox"):
        assert f"did not list class folder {root / name}:" in said
    assert sorted(folder_files(root)) == sorted(train.files + test.files)


def test_split_folders_that_are_links_are_listed(tmp_path, caplog) -> None:
    """A split folder that is itself a link is listed, unlabelled ones too (`imagefolder:LINK`,
    `train -> ../store/tr`); a test folder that is the training folder is said; a link in test/
    to a folder that is no training class (never scanned) does not drop a training class linked
    to the same folder; and the digest's file list is what the splits list."""
    for name in ("store/tr/a.png", "store/tr/b.png", "ds/test/t.png", "ext/x.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"png")
    os.symlink(tmp_path / "store" / "tr", tmp_path / "flat")
    assert len(scan_image_folder(tmp_path / "flat")) == 2
    os.symlink(tmp_path / "store" / "tr", tmp_path / "ds" / "train")
    assert len(load_folder_split(tmp_path / "ds", "train", 0)) == 2
    assert len(load_folder_split(tmp_path / "ds", "test", 0)) == 1
    assert sorted(map(os.path.basename, folder_files(tmp_path / "ds"))) == ["a.png", "b.png",
                                                                             "t.png"]  # fmt: skip
    root = tmp_path / "cls"
    for name in ("train/cat/a.png", "test/cat/t.png", "test/extra/e.png"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"png")
    os.symlink(tmp_path / "ext", root / "train" / "dog")
    os.symlink(tmp_path / "ext", root / "test" / "other")  # not a class: never listed
    train, test = (load_folder_split(root, s, 0) for s in ("train", "test"))
    assert sum(f.endswith("/train/dog/x.png") for f in train.files) == 1 and len(test) == 1
    assert sorted(folder_files(root)) == sorted(train.files + test.files)
    (tmp_path / "same").mkdir()
    os.symlink(root / "train", tmp_path / "same" / "train")
    os.symlink(root / "train", tmp_path / "same" / "test")  # the training folder as test/
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        assert len(load_folder_split(tmp_path / "same", "test", 0)) == 2
    assert any("the test split's images are training images" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_a_link_to_itself_is_skipped_not_an_unreadable_folder(tmp_path, caplog) -> None:
    """A link to itself (`zz -> zz`: DirEntry.is_dir raises ELOOP) is a link to nothing: beside
    the class folders it no longer switches off the check of two class folders linked to one
    folder (train/fox and test/fox were both listed), and inside a class folder it no longer
    ends that folder's listing as "could not read". Where train/ has no class folders, test/'s
    own are its classes, in the digest's list as in the scan."""
    root = tmp_path / "ds"
    for name in ("train/cat/a.png", "train/cat/b.png", "test/cat/t.png", "ext/fox/f.png"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"png")
    for split in ("train", "test"):
        os.symlink(root / "ext" / "fox", root / split / "fox")
    os.symlink("zz", root / "test" / "zz")
    os.symlink("aa", root / "train" / "cat" / "aa")  # sorts before the images
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        train, test = (load_folder_split(root, s, 0) for s in ("train", "test"))
    assert sorted(map(os.path.basename, train.files)) == ["a.png", "b.png"] and len(test) == 1
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "links to nothing (or to themselves)" in said and "could not read" not in said
    beside = str(root / "test" / "zz")  # the digest covers files beside the class folders too
    assert sorted(set(folder_files(root)) - {beside}) == sorted(train.files + test.files)
    flat = tmp_path / "flat"  # train/ unlabelled, test/ with classes of its own
    for name in ("train/u.png", "test/cat/t.png", "ext/x.png"):
        (flat / name).parent.mkdir(parents=True, exist_ok=True)
        (flat / name).write_bytes(b"png")
    os.symlink(flat / "ext", flat / "test" / "c1")
    os.symlink(flat / "ext", flat / "test" / "c2")  # both dropped: one folder, two classes
    test = load_folder_split(flat, "test", 0)
    assert sorted(folder_files(flat)) == sorted(load_folder_split(flat, "train", 0).files
                                                 + test.files)  # fmt: skip
    assert [os.path.basename(f) for f in test.files] == ["t.png"]


def test_links_to_listed_files_are_not_listed_again(tmp_path, caplog) -> None:
    """A link to a file in the other split (train/cat/t2.png -> ../../test/cat/t.png) gave a
    test image to training; one to a file of another class or a class folder's link target, an
    image twice under two labels. None is listed now, and they are named; links to files outside
    the listed folders (a pool of images, relative or absolute, a link to a link) are listed
    under their own names, and the digest's list is what the splits list."""
    root = tmp_path / "ds"
    for name in ("train/cat/a.png", "train/dog/b.png", "test/cat/t.png", "pool/p.png",
                 "pool/q.png", "ext/owl/o.png"):  # fmt: skip
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"png")
    os.symlink(root / "ext" / "owl", root / "train" / "owl")  # a class folder's target
    os.symlink("../../test/cat/t.png", root / "train" / "cat" / "t2.png")  # the test split
    os.symlink(root / "train" / "dog" / "b.png", root / "train" / "cat" / "b2.png")  # a class
    os.symlink("../../ext/owl/o.png", root / "train" / "dog" / "o2.png")  # a linked target
    os.symlink("../../pool/p.png", root / "train" / "dog" / "p.png")  # outside: listed
    os.symlink(root / "pool" / "q.png", root / "pool" / "q2.png")
    os.symlink(root / "pool" / "q2.png", root / "test" / "cat" / "q.png")  # a link to a link
    os.symlink(root / "train" / "cat" / "t2.png", root / "pool" / "back.png")  # ends in test/
    os.symlink(root / "pool" / "back.png", root / "train" / "dog" / "back.png")
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        train, test = (load_folder_split(root, s, 0) for s in ("train", "test"))

    def names(split) -> list[str]:
        return sorted(os.path.relpath(f, root) for f in split.files)

    assert names(train) == ["train/cat/a.png", "train/dog/b.png", "train/dog/p.png",
                            "train/owl/o.png"]  # fmt: skip
    assert names(test) == ["test/cat/q.png", "test/cat/t.png"]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "did not list 2 links to files" in said and str(root / "train/cat/t2.png") in said
    assert "did not list 2 links to files" in said and str(root / "train/dog/o2.png") in said
    assert sorted(folder_files(root)) == sorted(train.files + test.files)
    flat = tmp_path / "flat"  # no train/: the folder is both splits, and a link in it to one
    make_folder(flat)  # of its files would list that file twice
    first = scan_image_folder(flat).files[0]
    os.symlink(first, flat / "dog" / "again.png")
    assert first in scan_image_folder(flat).files
    assert str(flat / "dog" / "again.png") not in scan_image_folder(flat).files
    # files the scans do not list are linked to: a loose image beside the class folders (in
    # PATH or in train/), one in a test class that is no training class: listed once, here
    (flat / "loose.png").write_bytes(b"png")
    os.symlink("../loose.png", flat / "dog" / "loose.png")
    assert str(flat / "dog" / "loose.png") in scan_image_folder(flat).files
    (root / "train" / "beside.png").write_bytes(b"png")
    (root / "test" / "bird").mkdir()
    (root / "test" / "bird" / "b.png").write_bytes(b"png")
    os.symlink("../beside.png", root / "train" / "cat" / "beside.png")
    os.symlink("../../test/bird/b.png", root / "train" / "cat" / "bird.png")
    train = load_folder_split(root, "train", 0)
    assert {"train/cat/beside.png", "train/cat/bird.png"} <= set(names(train))
    assert "train/cat/t2.png" not in names(train)  # test/cat is scanned: still not listed
    mixed = tmp_path / "mixed"  # train/ unlabelled, test/ with classes of its own: a link in
    for name in ("train/u.png", "test/cat/t.png"):  # train/ to a test image is refused too
        (mixed / name).parent.mkdir(parents=True, exist_ok=True)
        (mixed / name).write_bytes(b"png")
    os.symlink("../test/cat/t.png", mixed / "train" / "t.png")
    (tmp_path / "pool" / "dog").mkdir(parents=True)  # and test/dog -> a folder outside: a link
    (tmp_path / "pool" / "dog" / "d.png").write_bytes(b"png")  # in train/ to its image too
    os.symlink(tmp_path / "pool" / "dog", mixed / "test" / "dog")
    os.symlink(tmp_path / "pool" / "dog" / "d.png", mixed / "train" / "d.png")
    assert [os.path.basename(f) for f in load_folder_split(mixed, "train", 0).files] == ["u.png"]
    assert len(load_folder_split(mixed, "test", 0)) == 2  # t.png and dog/d.png
    listed = [str(mixed / n) for n in ("test/cat/t.png", "test/dog/d.png", "train/u.png")]
    assert sorted(folder_files(mixed)) == listed  # the digest's list: what the scans list


def test_a_link_to_the_dataset_holding_the_class_is_a_loop(tmp_path, caplog) -> None:
    """Without train/ both splits are drawn from the folder itself: a class folder linked to a
    sibling, or to the dataset's folder, or to /, is not listed (before, `cls -> /` listed the
    whole filesystem)."""
    make_folder(tmp_path / "imgs")
    os.symlink(tmp_path / "imgs" / "dog", tmp_path / "imgs" / "fox")
    os.symlink(Path(os.sep), tmp_path / "imgs" / "gnu")
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        split = scan_image_folder(tmp_path / "imgs")
    assert len(split) == 13 and not any("/fox/" in f or "/gnu/" in f for f in split.files)
    said = [r.getMessage() for r in caplog.records]
    assert sum("did not list class folder" in m for m in said) == 2


def test_a_link_to_a_folder_holding_the_dataset_is_not_followed(tmp_path, caplog, monkeypatch):
    """A followed folder's link up to a folder that holds the dataset would list everything
    beside the dataset, data.test's images too, under this class: skipped, and said. A folder
    that cannot be read is named, and the rest listed."""
    w = tmp_path / "w"
    make_folder(w / "train_ds")
    (w / "test_ds" / "cat").mkdir(parents=True)
    (w / "test_ds" / "cat" / "t.png").write_bytes(b"png")
    (tmp_path / "S" / "locked").mkdir(parents=True)
    (tmp_path / "S" / "s.png").write_bytes(b"png")
    os.symlink(tmp_path / "S", w / "train_ds" / "cat" / "x")
    os.symlink(w, tmp_path / "S" / "up")
    scandir = os.scandir

    def refused(path):  # as a folder of another user's, mode 0700, is to a non-root user
        if str(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refused)
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        split = scan_image_folder(w / "train_ds")
    assert not any("test_ds" in f for f in split.files)
    assert sum(f.endswith("/cat/x/s.png") for f in split.files) == 1
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "cat/x/up" in said and "could not read 1 folders" in said and "locked" in said


def test_a_single_folder_read_for_both_splits_says_each_warning_once(tmp_path: Path, caplog):
    """A folder without train/ is scanned for the training and the test split (a seeded 20%):
    its non-image files and image-less classes are said once each, not once a split (and not
    counted as said while the logger drops warnings)."""
    make_folder(tmp_path / "imgs")
    (tmp_path / "imgs" / "fox").mkdir()
    with caplog.at_level(logging.ERROR, logger="vitlab"):  # dropped: not counted as said
        load_split(f"imagefolder:{tmp_path / 'imgs'}", "train")
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        splits = [load_split(f"imagefolder:{tmp_path / 'imgs'}", s) for s in ("train", "test")]
    assert sum(map(len, splits)) == 13
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("notes.txt" in m for m in said) == 1, said
    assert sum("classes: fox" in m for m in said) == 1, said


def test_class_folders_named_in_another_unicode_form_are_one_class(tmp_path, caplog) -> None:
    """train/ made on macOS ('café' decomposed, NFD), test/ elsewhere (composed, NFC): the test
    split lost café's images, with a warning that train/ lacks café and one that test/ has no
    images of it (a QA pass). The class keeps train/'s name; the digest lists the files too."""
    import unicodedata

    for split, form in (("train", "NFD"), ("test", "NFC")):
        for cls, n in (("café", 3), ("zoo", 2)):
            folder = tmp_path / split / unicodedata.normalize(form, cls)
            folder.mkdir(parents=True)
            for i in range(n):
                Image.new("L", (8, 8), 40 * i).save(folder / f"{i}.png")
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        test = load_split(f"imagefolder:{tmp_path}", "test")
    assert sorted(test.labels.tolist()) == [0, 0, 0, 1, 1], caplog.text
    assert test.classes == [unicodedata.normalize("NFD", "café"), "zoo"]
    assert "lacks" not in caplog.text and "no images" not in caplog.text
    listed = folder_files(tmp_path)
    assert len([f for f in listed if f.endswith(".png")]) == 10
    # an image beside the class folders has no class: not read, and now said (it went unsaid)
    Image.new("L", (8, 8)).save(tmp_path / "test" / "loose.png")
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        assert len(load_split(f"imagefolder:{tmp_path}", "test")) == 5
    assert "has 1 image file beside its class folders, not read (no class): loose" in caplog.text
    # a checkpoint's names match in either form too; and test/ holding both forms of a class
    # reads the one that is train/'s name and names the other (it went unread, unsaid)
    from vitlab.data.classes import name_order

    nfc, nfd = (unicodedata.normalize(f, "café") for f in ("NFC", "NFD"))
    assert name_order([nfd, "zoo"], ["zoo", nfc], "x") == ([1, 0], None)
    (tmp_path / "test" / nfd).mkdir()
    Image.new("L", (8, 8)).save(tmp_path / "test" / nfd / "d.png")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        assert len(load_split(f"imagefolder:{tmp_path}", "test")) == 3  # nfd's one, zoo's two
    assert f"train lacks, left out of the test split: {nfc}" in caplog.text


def test_image_folder_skips_bad_files_with_warnings(tmp_path: Path, caplog) -> None:
    """Scanning lists files only (a non-image suffix is skipped at once); a file that does not
    decode is skipped when first decoded, named once however often it comes: in training the next
    readable image takes its place, in evaluation a padding sample that is not counted."""
    make_folder(tmp_path / "imgs")
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        full = scan_image_folder(tmp_path / "imgs")
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("notes.txt" in m and "skipped 1" in m for m in messages)
    assert not any("broken.png" in m for m in messages)  # not opened yet
    assert len(full) == 13 and full.classes == ["cat", "dog", "eel"]
    pre = Preprocessing((16, 16), 3, (0.5,) * 3, (0.5,) * 3)
    aug = BatchAugment(DataConfig(random_resized_crop=True, hflip=0.5), pre, 3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        loader = make_loader(full, 13, pre, augment=aug, shuffle=True, workers=1)
        for epoch in range(3):
            ((x, y),) = list(loader.iterate(epoch))
            assert x.shape == (13, 3, 16, 16) and (y >= 0).all()
        ((x, y),) = list(make_loader(full, 13, pre))
        assert (y == PADDING).sum() == 1 and x.shape == (13, 3, 16, 16)
    named = [r.getMessage() for r in caplog.records if "broken.png" in r.getMessage()]
    assert len(named) == 2, named  # once by each loader
    (tmp_path / "imgs" / "fox").mkdir()  # a class folder with no images: kept, and said
    (tmp_path / "imgs" / "fox" / "notes.txt").write_text("not an image")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        with_fox = scan_image_folder(tmp_path / "imgs")
    assert with_fox.classes == ["cat", "dog", "eel", "fox"] and len(with_fox) == 13
    assert any("no images of 1 of its 4 classes: fox" in r.getMessage() for r in caplog.records)
    (tmp_path / "imgs" / "fox" / "notes.txt").unlink()
    (tmp_path / "imgs" / "fox").rmdir()
    split = tmp_path / "split"  # a test folder without one of the training split's classes
    make_folder(split / "train")
    make_folder(split / "test")
    for f in (split / "test" / "eel").iterdir():
        f.unlink()
    (split / "test" / "eel").rmdir()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        assert len(load_split(f"imagefolder:{split}", "train")) == 13
        test = load_split(f"imagefolder:{split}", "test")
        assert len(scan_image_folder(split / "test" / "cat")) == 5  # unlabelled: no classes
    assert test.classes == ["cat", "dog", "eel"] and len(test) == 9
    said = [r.getMessage() for r in caplog.records if "classes" in r.getMessage()]
    assert len(said) == 1 and "no images of 1 of its 3 classes: eel" in said[0], said
    # a test class train/ lacks, and train/, val/ and test/ together: both said (unsaid before)
    (split / "test" / "yak").mkdir()
    Image.new("RGB", (8, 8)).save(split / "test" / "yak" / "y.png")
    (split / "val" / "cat").mkdir(parents=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitlab"):
        assert len(load_split(f"imagefolder:{split}", "test")) == 9
    assert "train lacks, left out of the test split: yak" in caplog.text
    assert "val/ is not read (the test split is test/" in caplog.text
    train = load_split(f"imagefolder:{tmp_path / 'imgs'}", "train")
    test = load_split(f"imagefolder:{tmp_path / 'imgs'}", "test")
    assert len(train) + len(test) == 13
    loader = make_loader(train, 4, pre, augment=aug, shuffle=True, workers=0)
    batches = list(loader)
    assert len(batches) == len(train) // 4
    assert all(x.shape == (4, 3, 16, 16) for x, _ in batches)
    with pytest.raises(DatasetError, match="does not exist"):
        load_split(f"imagefolder:{tmp_path / 'nope'}", "train")


def test_a_colour_webp_decodes_grey_as_pil_converts_it(tmp_path: Path) -> None:
    """torchvision's WebP decoder ignores its GRAY mode and gives 3 channels: a grey model on
    colour WebP files failed (a batch of 3- and 1-channel images, or 'expected 1 channel').
    Now such a file decodes as PIL's convert("L") (ITU-R 601-2 luma), as JPEG and PNG do; in
    RGB it is torchvision's, the same pixels as PIL's for lossless WebP."""
    from vitlab.data.decode import decode_image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8), "RGB")
    out = io.BytesIO()
    image.save(out, format="WEBP", lossless=True)
    grey = decode_image(out.getvalue(), 1, "c.webp")
    assert grey.shape == (1, 12, 10)
    assert np.array_equal(grey[0].numpy(), np.asarray(image.convert("L")))
    rgb = decode_image(out.getvalue(), 3, "c.webp")
    assert np.array_equal(rgb.permute(1, 2, 0).numpy(), np.asarray(image))
    root = tmp_path / "wp"  # a grey model on a folder of colour WebP and grey PNG files
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        (root / cls / "c.webp").write_bytes(out.getvalue())
        image.convert("L").save(root / cls / "g.png")
    pre = Preprocessing((8, 8), 1, (0.5,), (0.5,))
    batches = list(make_loader(load_split(f"imagefolder:{root}", "train"), 4, pre, workers=0))
    assert batches and all(tuple(x.shape[1:]) == (1, 8, 8) for x, _ in batches)


def test_an_empty_or_unknown_file_is_said_as_predict_says_it(tmp_path: Path) -> None:
    """Training's and eval's decoding say a 0-byte file is empty, as predict does (it said
    "UnidentifiedImageError: not an image file of a format PIL knows")."""
    from vitlab.data.decode import decode_image

    (tmp_path / "empty.jpg").write_bytes(b"")
    with pytest.raises(DatasetError, match="^cannot read image a/empty.jpg: an empty file$"):
        decode_image(b"", 3, "a/empty.jpg")
    with pytest.raises(DatasetError, match="empty.jpg: an empty file$"):
        read_image(tmp_path / "empty.jpg", "RGB")
    with pytest.raises(DatasetError, match="notes.png: .*not an image file of a format PIL knows"):
        decode_image(b"some notes", 3, "notes.png")


def test_decode_16_bit_png_and_header_bombs() -> None:
    """A 16-bit PNG or TIFF decodes to its high bytes as uint8 (greyscale and as RGB); a JPEG
    whose header claims 20000 x 10000 pixels is refused before any decoder allocates them."""
    from vitlab.data.decode import decode_image

    deep = np.arange(0, 65536, 257, dtype=np.uint16).reshape(16, 16)  # 0, 257, ..., 65535
    out = io.BytesIO()
    Image.fromarray(deep).save(out, format="PNG")
    grey = decode_image(out.getvalue(), 1, "deep.png")
    assert grey.dtype == torch.uint8 and grey.shape == (1, 16, 16)
    assert torch.equal(grey[0], torch.from_numpy((deep >> 8).astype(np.uint8)))
    rgb = decode_image(out.getvalue(), 3, "deep.png")
    assert rgb.dtype == torch.uint8 and torch.equal(rgb[1], grey[0])
    # PIL's paths (a 16-bit TIFF in a folder or shard; any file predict / analyze read) agree
    tiff = io.BytesIO()
    Image.fromarray(deep).save(tiff, format="TIFF")
    assert torch.equal(decode_image(tiff.getvalue(), 1, "deep.tif"), grey)
    assert torch.equal(decode_image(tiff.getvalue(), 3, "deep.tif"), rgb)
    pgm = io.BytesIO()  # maxval 65535: PIL opens it in mode I
    Image.fromarray(deep).save(pgm, format="PPM")
    assert torch.equal(decode_image(pgm.getvalue(), 1, "deep.pgm"), grey)
    read = read_image(io.BytesIO(out.getvalue()), "L")
    assert np.array_equal(np.asarray(read), (deep >> 8).astype(np.uint8))
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="JPEG")
    jpeg = bytearray(out.getvalue())
    sof = jpeg.index(b"\xff\xc0")  # FF C0, length (2), precision (1), height (2), width (2)
    jpeg[sof + 5 : sof + 9] = (10_000).to_bytes(2, "big") + (20_000).to_bytes(2, "big")
    import torchvision.io

    calls = []
    with pytest.MonkeyPatch.context() as m:  # torchvision's decoder allocates the claim: not run
        m.setattr(torchvision.io, "decode_image", lambda *a, **k: calls.append(a))
        with pytest.raises(DatasetError, match="bomb.jpg: .*(20000 x 10000|DecompressionBomb)"):
            decode_image(bytes(jpeg), 3, "bomb.jpg")
    assert calls == []


def test_header_sizes_read_directly_agree_with_pil() -> None:
    """The JPEG / PNG header reader the size guard uses gives PIL's size for baseline and
    progressive JPEGs, ones with large APP segments before the frame header, and PNGs; None for
    what it does not follow (WebP, garbage), which PIL then reads."""
    from vitlab.data.decode import _header_size

    rng = np.random.default_rng(0)
    cases = [("JPEG", {}), ("JPEG", {"progressive": True}), ("PNG", {}),
             ("JPEG", {"icc_profile": b"p" * 70_000, "exif": b"Exif" + b"x" * 3000})]  # fmt: skip
    for fmt, kw in cases:
        for w, h in [(37, 11), (1, 1), (300, 2)]:
            out = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(out, fmt, **kw)
            with Image.open(io.BytesIO(out.getvalue())) as im:
                assert _header_size(out.getvalue()) == im.size == (w, h), (fmt, kw.keys())
    out = io.BytesIO()
    Image.new("RGB", (5, 4)).save(out, "WEBP")
    assert _header_size(out.getvalue()) is None


def test_header_reader_leaves_what_it_does_not_follow_to_pil() -> None:
    """Crafted JPEG headers: a stray FF 00 (which libjpeg skips byte by byte) in front of an APP
    segment holding a small fake frame header, then the real one claiming 13500 x 13500: the
    reader must not jump into the APP data and report the fake size; the guard still refuses the
    image. Other oddities give None (PIL decides) rather than a size."""
    from vitlab.data.decode import _header_size, decode_image

    def sof(w: int, h: int) -> bytes:
        return (
            b"\xff\xc0\x00\x11\x08"
            + h.to_bytes(2, "big")
            + w.to_bytes(2, "big")
            + b"\x03"
            + b"\x01\x11\x00" * 3
        )

    fake = b"\xff\xe1\x00\x13" + sof(16, 16)  # APP1 whose data is a frame header
    crafted = b"\xff\xd8\xff\x00\x00\x06" + fake + sof(13_500, 13_500) + b"\x00" * 64
    assert _header_size(crafted) != (16, 16)
    with pytest.raises(DatasetError, match="bomb|pixels"):
        decode_image(crafted, 1, "crafted.jpg")
    soi = b"\xff\xd8"
    assert _header_size(soi + b"\xff\xff\xff" + sof(7, 5)) == (7, 5)  # fill bytes
    assert _header_size(soi + b"\xff\xe0\x00\x04ab" + sof(7, 5)) == (7, 5)  # an APP0 segment
    odd = [b"\xff\xd8\x00junk and more", soi + b"\xff\xd9" + sof(7, 5),  # EOI first
           soi + b"\xff\xe0\x00\x01" + sof(7, 5), soi + b"\xff\xe0\x00\x00" + sof(7, 5),
           soi + b"\xff\xe0\xff\xf0" + sof(7, 5), soi + sof(7, 5)[:7],
           soi + b"\xff\x00" * 8]  # fmt: skip
    assert [_header_size(x) for x in odd] == [None] * len(odd)


def test_decode_ignores_only_torchvisions_deprecation_warning() -> None:
    import importlib
    import re
    import warnings

    from vitlab.data import decode

    importlib.reload(decode)  # its filter, added now (pytest resets filters between tests)
    mine = [f for f in warnings.filters if f[1] and f[1].pattern.startswith("The image decoding")]
    assert mine and all(f[3] is not None for f in mine)  # never a filter for every module
    assert re.match(mine[0][3], "torchvision.io.image") and not re.match(mine[0][3], "mylib")


def test_close_ends_the_workers_and_the_default_count_is_capped(tmp_path: Path, monkeypatch):
    from vitlab.data import workers as loader_mod

    monkeypatch.setattr(loader_mod, "available_cores", lambda: 64)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert loader_mod.loader_options(DataConfig(), torch.device("cpu"))["workers"] == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert loader_mod.loader_options(DataConfig(), torch.device("cpu"))["workers"] == 4
    assert not loader_mod.loader_options(DataConfig(), torch.device("cpu"))["workers_chosen"]
    assert loader_mod.loader_options(DataConfig(workers=2), torch.device("cpu"))["workers_chosen"]
    make_folder(tmp_path / "imgs")
    pre = Preprocessing((16, 16), 3, (0.5,) * 3, (0.5,) * 3)
    aug = BatchAugment(DataConfig(), pre, 3)
    loader = make_loader(scan_image_folder(tmp_path / "imgs"), 4, pre, augment=aug, shuffle=True,
                         workers=1)  # fmt: skip
    assert len(list(loader.iterate(0))) == 3
    workers = loader._loader._iterator._workers  # persistent: alive between epochs
    assert workers and all(w.is_alive() for w in workers)
    loader.close()
    assert not any(w.is_alive() for w in workers)
    assert len(list(loader.iterate(1))) == 3  # usable again: new workers


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_more_workers_than_cores_are_said_once_in_vitlabs_words(tmp_path: Path) -> None:
    """PyTorch warned of more DataLoader workers than cores in Python's format at each iterator
    (four times a run, inside the progress bar): the command says it once, before training, as a
    `vitlab: warning:` line that -q hides; the count is the cores this process may use."""
    import sys

    from tests.helpers import TINY_MODEL, run_together

    for split in ("train", "test"):
        make_folder(tmp_path / "imgs" / split)
    one_core = (  # the command, held to one of this machine's cores: 2 workers are too many
        "import os, runpy, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "sys.argv[0] = 'vitlab'; runpy.run_module('vitlab', run_name='__main__')"
    )
    args = ["train", *TINY_MODEL, f"data.name=imagefolder:{tmp_path / 'imgs'}", "data.workers=2",
            "train.epochs=2", "train.batch_size=4", "optim.warmup_epochs=0",
            "train.threads=1"]  # fmt: skip
    said, quiet = run_together(
        ([sys.executable, "-c", one_core, *args, "--out", str(tmp_path / "a")], None),
        ([sys.executable, "-c", one_core, "-q", *args, "--out", str(tmp_path / "b")], None),
    )
    assert said.returncode == 0 and quiet.returncode == 0, said.stderr + quiet.stderr
    lines = [x for x in said.stderr.splitlines() if "DataLoader" in x or "data.workers" in x]
    assert lines == [
        "vitlab: warning: data.workers=2 starts 2 loader processes on the 1 core this process "
        "may use, where they compete with training's threads (more workers than cores help only "
        "where loading waits on storage; the default is this process's share of the cores)"
    ], said.stderr
    assert "UserWarning" not in said.stderr and "warning" not in quiet.stderr, quiet.stderr


def test_python_warnings_of_a_command_are_vitlabs_warning_lines(capsys) -> None:
    """A library's warnings.warn during a command: one `vitlab: warning:` line naming its kind and
    source file (inside site-packages from there), hidden by -q; Python's way again after."""
    import warnings

    from vitlab.cli.main import cli_logging

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        before = warnings.showwarning
        with cli_logging(0, 0, python_warnings=True):
            warnings.warn_explicit("slow path", UserWarning, "/v/lib/site-packages/torch/x.py", 7)
        assert capsys.readouterr().err == "vitlab: warning: slow path (UserWarning, torch/x.py:7)\n"
        assert warnings.showwarning is before  # restored by cli_logging itself
        with cli_logging(0, 1, python_warnings=True):
            warnings.warn("hidden", UserWarning, stacklevel=1)
        assert capsys.readouterr().err == ""
        with cli_logging(0, 0):  # an in-process call: the caller's warnings stay the caller's
            assert warnings.showwarning is before


def grey_folder(root: Path) -> Path:
    """train/ and test/ of two classes of six random 10x12 grey PNGs each."""
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(6):
                pixels = rng.integers(0, 256, (10, 12), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{i}.png")
    return root


def test_a_run_on_a_grey_folder_from_before_resumes_as_it_was(tmp_path, monkeypatch) -> None:
    """Folders were read as RGB: a run stopped then (3 channels, ImageNet's colour statistics)
    was refused on --resume ("does not fit the model": a 1-channel model from the data). It
    resumes with its checkpoint's channels and statistics, as it trained."""
    from vitlab import load_checkpoint
    from vitlab.cli.main import main
    from vitlab.data import datasets as datasets_mod

    folder = grey_folder(tmp_path / "grey")
    monkeypatch.setattr(datasets_mod, "channels_of", lambda split, **kw: 3)  # as folders were
    args = ["train", f"data.name=imagefolder:{folder}", "model.img_size=8", "model.patch_size=4",
            "model.depth=1", "train.epochs=2", "train.stop_at_epoch=1",
            "train.batch_size=4"]  # fmt: skip
    run = tmp_path / "run"
    assert main([*args, "--out", str(run)]) == 0
    monkeypatch.undo()
    assert main(["train", "--resume", str(run)]) == 0
    meta = load_checkpoint(run / "checkpoints" / "last")[1]
    assert meta.config.in_chans == 3 and meta.preprocessing.mean == (0.485, 0.456, 0.406)
    state = torch.load(run / "checkpoints" / "last" / "state.pt", weights_only=True)
    assert state["epoch"] == 2


def test_a_folder_of_grey_images_trains_a_grey_model(tmp_path: Path) -> None:
    """Grey PNGs were read as RGB (3 channels, ImageNet's colour statistics), where an hf:
    dataset of them is read grey: a folder whose sampled images are all grey is too (one RGB
    image among them keeps it in colour; a file that does not open is passed over)."""
    from vitlab import load_checkpoint
    from vitlab.cli.main import main
    from vitlab.data import dataset_info
    from vitlab.data.decode import GREY_STATS

    grey_folder(tmp_path / "grey")
    (tmp_path / "grey" / "train" / "a" / "0.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    grey = load_split(f"imagefolder:{tmp_path / 'grey'}", "train")
    info = dataset_info("imagefolder:g", grey)
    assert info.in_chans == 1 and (info.mean, info.std) == GREY_STATS
    make_folder(tmp_path / "mixed")  # RGB, L and RGBA images
    info = dataset_info("imagefolder:m", load_split(f"imagefolder:{tmp_path / 'mixed'}", "all"))
    assert info.in_chans == 3 and info.mean == (0.485, 0.456, 0.406)
    args = ["train", f"data.name=imagefolder:{tmp_path / 'grey'}", "model.img_size=8",
            "model.patch_size=4", "model.depth=1", "train.epochs=1",
            "train.batch_size=4"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "run")]) == 0
    model, meta = load_checkpoint(tmp_path / "run")
    assert meta.config.in_chans == 1 and meta.preprocessing.mean == GREY_STATS[0]
    # files decode in the model's mode: model.in_chans=3 trains RGB on them (the grey statistics
    # on every channel), and 1 a grey model on colour files (ImageNet's averaged, it was refused)
    assert main([*args, "model.in_chans=3", "--out", str(tmp_path / "rgb")]) == 0
    meta = load_checkpoint(tmp_path / "rgb")[1]
    assert meta.config.in_chans == 3 and meta.preprocessing.mean == GREY_STATS[0] * 3
    colour = [f"data.name=imagefolder:{tmp_path / 'mixed'}", "data.test_fraction=0.5"]
    assert main([*args, *colour, "model.in_chans=1", "--out", str(tmp_path / "g")]) == 0
    meta = load_checkpoint(tmp_path / "g")[1]
    assert meta.config.in_chans == 1
    assert meta.preprocessing.mean == pytest.approx(GREY_STATS[0], abs=1e-9)


def test_file_batches_are_the_same_wherever_they_are_normalised(tmp_path: Path) -> None:
    """Training batches of an image folder with random erasing and mixup: normalised in two
    workers, in this process (workers=0), or after the workers as for a GPU (uint8 across, then
    normalised here): the same batches, and the trainer's RNG (which erasing and mixing draw
    from) left in the same state. And normalisation happens exactly once: an evaluation batch
    maps back to whole pixel values in 0..255."""
    import warnings

    make_folder(tmp_path / "imgs")
    split = scan_image_folder(tmp_path / "imgs")
    pre = Preprocessing((16, 16), 3, (0.5,) * 3, (0.25,) * 3)
    cfg = DataConfig(random_resized_crop=True, hflip=0.5, random_erasing=0.5, mixup=0.8)
    aug = BatchAugment(cfg, pre, 3)
    runs = []
    for kw in ({"workers": 0}, {"workers": 2}, {"workers": 2, "pin_memory": True}):
        torch.manual_seed(5)
        loader = make_loader(split, 4, pre, augment=aug, shuffle=True, seed=1, **kw)
        with warnings.catch_warnings():  # pin_memory without a GPU: torch warns, pins nothing
            warnings.simplefilter("ignore", UserWarning)
            batches = list(loader.iterate(1))
        loader.close()
        runs.append((batches, torch.rand(3)))
    first, after = runs[0]
    assert len(first) == 3 and first[0][1].shape == (4, 3)  # soft labels: mixed
    for batches, rng_after in runs[1:]:
        assert torch.equal(rng_after, after)
        for (x, y), (x0, y0) in zip(batches, first, strict=True):
            assert torch.equal(x, x0) and torch.equal(y, y0)
    loader = make_loader(split, 4, pre, workers=2)
    x, _ = next(iter(loader))
    loader.close()
    pixels = (x * 0.25 + 0.5) * 255
    assert pixels.min() >= -1e-3 and pixels.max() <= 255 + 1e-3
    assert (pixels - pixels.round()).abs().max() < 1e-3


def test_batched_shift_is_a_crop_of_the_zero_padded_image_at_each_images_own_offset() -> None:
    """random_shift against torchvision's pad + crop: every image is the crop of its own zero-padded
    copy at one offset, and all (2p+1)^2 offsets come about equally often."""
    from torchvision.transforms.v2 import functional as TF

    torch.manual_seed(0)
    images = torch.randint(1, 256, (1000, 2, 6, 7), dtype=torch.uint8)  # no zeros: pads show
    out = random_shift(images, 2)
    assert out.shape == images.shape and out.dtype == torch.uint8
    padded = TF.pad(images, [2])
    matches = torch.stack([
        (TF.crop(padded, top, left, 6, 7) == out).flatten(1).all(1)
        for top in range(5) for left in range(5)
    ], dim=1)  # fmt: skip  # (images, 25 offsets)
    assert (matches.sum(1) == 1).all()  # each image is one offset's crop, no other
    counts = matches.sum(0)  # 40 expected each, sd 6.2
    assert counts.min() >= 15 and counts.max() <= 65, counts
    assert torch.equal(random_shift(images, 0), images)


def test_batched_flip_mirrors_each_image_with_probability_p() -> None:
    torch.manual_seed(0)
    images = torch.randint(0, 256, (4000, 1, 5, 5), dtype=torch.uint8)
    out = random_hflip(images, 0.3)
    same = (out == images).flatten(1).all(1)
    mirrored = (out == images.flip(-1)).flatten(1).all(1)
    assert (same ^ mirrored).all()  # one or the other (random images are not symmetric)
    assert abs(mirrored.float().mean().item() - 0.3) < 0.03  # sd 0.007
    assert torch.equal(random_hflip(images, 0.0), images)
    assert torch.equal(random_hflip(images, 1.0), images.flip(-1))


def test_batched_erasing_draws_torchvision_random_erasings_boxes() -> None:
    """random_erase against torchvision's RandomErasing, image by image: a solid box of zeros,
    the rest untouched, erased as often, with the same distribution of box areas, aspect ratios
    and positions (means over 4,000 images each)."""
    from torchvision.transforms import v2

    def boxes(x: torch.Tensor) -> torch.Tensor:  # (n, 5): erased?, height, width, top, left
        assert torch.equal(x[:, 0], x[:, 1])  # every channel erased alike
        zero = x[:, 0] == 0
        rows, cols = zero.any(2), zero.any(1)
        h, w = rows.sum(1), cols.sum(1)
        assert torch.equal(zero.sum((1, 2)), h * w)  # a solid rectangle, nothing else
        top, left = rows.float().argmax(1), cols.float().argmax(1)
        return torch.stack([h > 0, h, w, top, left], dim=1).float()

    torch.manual_seed(0)
    x = torch.ones(4000, 2, 28, 24)
    ours = boxes(random_erase(x, 0.5))
    theirs = boxes(torch.stack([v2.RandomErasing(0.5)(img) for img in x]))
    assert abs(ours[:, 0].mean() - theirs[:, 0].mean()) < 0.05  # erased share: 0.5, sd 0.008
    ours, theirs = ours[ours[:, 0] > 0], theirs[theirs[:, 0] > 0]
    area = [(b[:, 1] * b[:, 2]).mean() for b in (ours, theirs)]
    assert abs(area[0] / area[1] - 1) < 0.05, area  # ~0.175 of 672 pixels
    aspect = [(b[:, 1] / b[:, 2]).log().mean() for b in (ours, theirs)]
    assert abs(aspect[0] - aspect[1]) < 0.1, aspect
    for k in (3, 4):  # top, left
        assert abs(ours[:, k].mean() - theirs[:, k].mean()) < 0.6
    for b in (ours, theirs):  # positions span the whole range, edges included
        assert (b[:, 3] == 0).any() and (b[:, 3] + b[:, 1] == 28).any()
        assert (b[:, 4] == 0).any() and (b[:, 4] + b[:, 2] == 24).any()
    assert torch.equal(random_erase(x, 0.0), x)


def test_nested_trees_sort_as_paths_and_links_to_folders_are_not_followed(tmp_path: Path):
    """Files sort by their path's parts, as main's sorted Paths did ('a/b.png' before 'a-b/x.png',
    which a string sort swaps: '-' < '/'); a link to a folder above is not followed (no loop)."""
    import os

    for name in ("c/a-b/x.png", "c/a/b.png", "c/a/z/q.png", "c/a.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4)).save(tmp_path / name)
    os.symlink(tmp_path / "c", tmp_path / "c" / "a" / "loop")
    split = scan_image_folder(tmp_path)
    expected = sorted(p for p in (tmp_path / "c").rglob("*.png") if "loop" not in p.parts)
    assert [Path(f) for f in split.files] == expected and len(expected) == 4


def test_a_tree_of_20k_files_is_indexed_without_opening_one(tmp_path: Path, monkeypatch) -> None:
    """No file is opened while scanning (open() fails if one is): 20,000 (empty) files in 100
    classes index in seconds, well under a loaded CI machine's generous 20."""
    import os
    import tempfile

    shm = Path("/dev/shm")  # a RAM disk, where there is one: creating the files is the slow part
    where = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    with tempfile.TemporaryDirectory(dir=where) as root:
        index_tree(Path(root), monkeypatch)


def index_tree(root: Path, monkeypatch) -> None:
    import builtins
    import os
    import time

    for c in range(100):
        folder = root / f"c{c:03d}"
        folder.mkdir()
        for i in range(200):
            os.close(os.open(folder / f"{i}.jpg", os.O_CREAT | os.O_WRONLY))
    t = time.perf_counter()
    with monkeypatch.context() as m:
        m.setattr(builtins, "open", lambda *a, **k: pytest.fail(f"the scan opened {a[0]}"))
        split = scan_image_folder(root)
    seconds = time.perf_counter() - t
    assert len(split) == 20_000 and len(split.classes) == 100
    assert split.labels[-1] == 99 and Path(split.files[0]).name == "0.jpg"
    assert seconds < 20, f"indexing 20k files took {seconds:.1f} s"


def test_augmentations_shapes_and_mixed_labels() -> None:
    split = load_split("digits", "train")
    pre = Preprocessing((28, 28), 1, (0.3,), (0.4,))
    cfg = DataConfig(
        crop_padding=3, hflip=0.5, randaugment_ops=2, random_erasing=0.5, mixup=0.8, cutmix=1.0
    )
    torch.manual_seed(0)
    x, y = next(iter(make_loader(split, 32, pre, augment=BatchAugment(cfg, pre, 10), shuffle=True)))
    assert x.shape == (32, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (32, 10)
    torch.testing.assert_close(y.sum(dim=1), torch.ones(32))
    assert (y.max(dim=1).values < 1).any()  # labels really are mixed
    x_eval, y_eval = next(iter(make_loader(split, 32, pre)))
    assert x_eval.shape == (32, 1, 28, 28) and y_eval.dtype == torch.long
    # evaluation preprocessing is exactly resize + scale + normalise
    expected = (split.images[:32].float() / 255).sub(0.3).div(0.4)
    small = Preprocessing((8, 8), 1, (0.3,), (0.4,))
    torch.testing.assert_close(next(iter(make_loader(split, 32, small)))[0], expected)


def test_digits_are_scikit_learns_read_without_importing_it(monkeypatch) -> None:
    """read_digits reads scikit-learn's CSV file itself (importing scikit-learn costs a small run
    1.5-3 s of its start), no import of it made, and gives load_digits' arrays; without that
    file, load_digits'."""
    import builtins
    import importlib.util

    import sklearn.datasets

    reference = sklearn.datasets.load_digits()
    real_import, real_find_spec = builtins.__import__, importlib.util.find_spec

    def no_sklearn(name, *args, **kwargs):
        if name == "sklearn" or name.startswith("sklearn."):
            pytest.fail(f"read_digits imported {name}")
        return real_import(name, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(builtins, "__import__", no_sklearn)
        images, labels = read_digits()
    assert images.shape == (1797, 8, 8) and np.array_equal(images, reference.images)
    assert np.array_equal(labels, reference.target) and labels.dtype == np.int64

    def no_sklearn_found(name, package=None):
        return None if name == "sklearn" else real_find_spec(name, package)

    with monkeypatch.context() as m:  # no file to read
        m.setattr(importlib.util, "find_spec", no_sklearn_found)
        images, labels = read_digits()
    assert np.array_equal(images, reference.images) and np.array_equal(labels, reference.target)
    assert load_split("digits", "train").images.max() == 255  # 16 scaled to 0-255


def test_validation_split_is_seeded_and_disjoint() -> None:
    full = load_split("digits", "train")
    a_train, a_val = train_val_split(full, 0.1, seed=0)
    b_train, b_val = train_val_split(full, 0.1, seed=0)
    assert torch.equal(a_val.labels, b_val.labels) and len(a_val) == round(0.1 * len(full))
    assert len(a_train) + len(a_val) == len(full)
    test = load_split("digits", "test")
    assert len(test) + len(full) == 1797
    # images that name their own index: the two parts are disjoint, cover the split, and another
    # seed draws another validation part
    ids = torch.zeros(50, 1, 2, 2, dtype=torch.uint8)
    ids[:, 0, 0, 0] = torch.arange(50)
    numbered = ArraySplit(ids, torch.arange(50) % 5, list("abcde"))
    fit, val = train_val_split(numbered, 0.2, seed=0)
    fit_ids, val_ids = (set(part.images[:, 0, 0, 0].tolist()) for part in (fit, val))
    assert len(val_ids) == 10 and fit_ids.isdisjoint(val_ids)
    assert fit_ids | val_ids == set(range(50))
    other = set(train_val_split(numbered, 0.2, seed=1)[1].images[:, 0, 0, 0].tolist())
    assert other != val_ids
    # a fraction that rounds to no image still carves one (and leaves one to train on)
    fit, val = train_val_split(numbered.subset(torch.arange(4)), 0.1, seed=0)
    assert (len(fit), len(val)) == (3, 1)
    fit, val = train_val_split(numbered.subset(torch.arange(2)), 0.9, seed=0)
    assert (len(fit), len(val)) == (1, 1)
    with pytest.raises(DatasetError, match=r"from 1 training image\(s\): it needs at least 2"):
        train_val_split(numbered.subset(torch.arange(1)), 0.1, seed=0)


def test_rank_slices_cover_the_single_process_batches() -> None:
    single = list(BatchPlan(100, 16, True, seed=3).batches())
    ranks = [list(BatchPlan(100, 16, True, seed=3, rank=r, world=2).batches()) for r in (0, 1)]
    for b, whole in enumerate(single):
        assert torch.equal(torch.cat([ranks[0][b], ranks[1][b]]), whole)
    evals = [torch.cat(list(BatchPlan(10, 4, False, 0, r, 3).batches())) for r in range(3)]
    assert sorted(torch.cat(evals).tolist()) == list(range(10))
    with pytest.raises(ValueError, match="not divisible by 3"):
        BatchPlan(100, 16, True, 0, 0, 3)


def test_unknown_dataset() -> None:
    with pytest.raises(DatasetError, match="unknown dataset 'mnist'"):
        load_split("mnist", "train")


def test_preprocessing_of_pil_images() -> None:
    pre = Preprocessing((28, 28), 1, (0.5,), (0.5,))
    rgb = Image.fromarray(np.full((50, 40, 3), 255, dtype=np.uint8))
    x = pre.pil(rgb)
    assert x.shape == (1, 28, 28)
    torch.testing.assert_close(x, torch.ones(1, 28, 28))
    buf = io.BytesIO()
    rgb.save(buf, format="PNG")
