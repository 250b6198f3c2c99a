"""Image folders: one sub-folder per class (or none: unlabelled images), listed without opening
a file (each is checked when first decoded, loader.py), and the split an `imagefolder:PATH`
dataset reads: PATH/train and PATH/test (or PATH/val) when there is a train/, else a seeded 20% of
PATH for the test split."""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from vitlab.data.classes import nfc
from vitlab.data.decode import decode_image, pil_convert
from vitlab.data.download import DatasetError
from vitlab.runtime import seeded_split

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
_SAID: set[str] = set()  # warnings given: a folder scanned for two splits says each once


@dataclass
class FolderSplit:
    """One split of an image folder: file paths (strings: a Path each costs more to make than
    listing the file) and labels, read on demand."""

    files: list[str]
    labels: Tensor  # (N,) int64
    classes: list[str]
    skipped: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, index: Tensor) -> FolderSplit:
        return FolderSplit(
            [self.files[i] for i in index.tolist()], self.labels[index], self.classes
        )

    def read(self, i: int) -> bytes:
        """Image i's encoded bytes (an OSError when the file cannot be read)."""
        with open(self.files[i], "rb") as f:
            return f.read()

    def where(self, i: int) -> str:
        return self.files[i]


def read_image(path: Path | str, mode: str):  # -> PIL.Image.Image
    """The image file at `path` decoded and converted to `mode` ('L', 'RGB'; 16-bit greyscale by
    its high bytes); a DatasetError naming the file when it cannot be (PIL raises OSError,
    ValueError, DecompressionBombError ...)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return pil_convert(im, mode)
    except Exception as e:
        raise _unreadable(path, e) from None


def decode_file(path: Path | str, in_chans: int) -> Tensor:
    """The image file at `path` as uint8 (in_chans, H, W), decoded as training decodes a folder's
    files (decode_image: a colour JPEG's grey is libjpeg's luma plane, several levels from PIL's
    convert('L') of its RGB: 14 on a noisy one); a DatasetError naming the file where it cannot
    be."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:  # a folder, no permission, gone
        raise _unreadable(path, e) from None
    return decode_image(data, in_chans, str(path))


def _unreadable(path: Path | str, e: Exception) -> DatasetError:
    if isinstance(e, IsADirectoryError):
        return DatasetError(
            f"cannot read image {path}: it is a folder (name its images: {os.path.join(path, '*')})"
        )
    empty = os.path.isfile(path) and not os.path.getsize(path)
    why = "an empty file" if empty else f"{type(e).__name__}: {e}"
    return DatasetError(f"cannot read image {path}: {why}")


class _Listed:
    """Where a dataset's images are listed, as real paths each ending in a separator: its split
    folders (train/ and test/, or the one folder both are drawn from) and the targets of their
    class folders (`classes`; None: every sub-folder) that are links (listed under the link) but
    do not meet a split folder. A link into one of these, or to a folder holding one, would list
    images twice, under another class, or in the other split."""

    def __init__(self, splits: list[Path], classes: list[str] | None = None) -> None:
        real = {os.path.join(os.path.realpath(f), ""): f for f in splits}  # test -> train: once
        self.splits = list(real)
        self.count, self.above = Counter(), set()
        self._add(self.splits)
        self._roots, self._classes = list(real.values()), classes
        self._dirs: dict[Path, list | None] = {}  # a split folder's sub-folders (_sub_dirs)
        targets, named = [], set(classes or [])
        for split in self._roots if classes != [] else []:  # [] (unlabelled): no class folders
            links = [e for e in self._sub_dirs(split) or [] if e.is_symlink()]
            targets += [os.path.join(os.path.realpath(e.path), "") for e in links
                        if classes is None or e.name in named]  # fmt: skip
        self.linked = {t for t in targets if not self.meets(t)}  # the others: not listed
        self._add([t for t in targets if t in self.linked])
        self._listed: set[str] | None = None  # the folders whose files are listed (lists())
        self._real: dict[str, tuple] = {}  # a file link's target's folder: (real path, listed)

    def _sub_dirs(self, root: Path) -> list[os.DirEntry] | None:
        """root's entries that are folders or links to folders, scanned once (scandir's entries
        know links without a stat: a split's files are millions); None where unreadable (the
        scan names it)."""
        if root not in self._dirs:
            try:
                with os.scandir(root) as entries:
                    self._dirs[root] = [e for e in entries if e.is_dir(follow_symlinks=False)
                                        or e.is_symlink() and _leads_to(e) == "dir"]  # fmt: skip
            except OSError:
                self._dirs[root] = None
        return self._dirs[root]

    def _add(self, paths: list[str]) -> None:
        self.count.update(paths)
        self.above.update(up for path in paths for up in _ancestors(path)[1:])

    def meets(self, path: str, own: bool = False) -> bool:
        """Whether the real folder path `path` lies in one of these folders or holds one (`own`:
        path is a class folder's target, which does not meet itself)."""
        return (
            path in self.above
            or self.count[path] > (own and path in self.linked)
            or any(self.count[up] for up in _ancestors(path)[1:])
        )

    def lists(self, link: str) -> bool:
        """Whether the file a link to a file leads to lies in a folder whose files are listed: a
        scanned class folder, a class folder's target, or an unlabelled split folder (listed
        there; False: it cannot be read, gone since). Its folder's real path is resolved once
        for all the links into it (a folder of links into one pool of images: a readlink each,
        not a realpath's lstat per part: 7 us a link more than listing it, against 28)."""
        try:
            folder, name = os.path.split(os.path.join(os.path.dirname(link), os.readlink(link)))
        except OSError:
            return False
        if (seen := self._real.get(folder)) is None:
            real = os.path.join(os.path.realpath(folder), "")
            seen = self._real[folder] = real, _under(real, self._listed_folders())
        if seen[1] or not os.path.islink(seen[0] + name):  # listed there, whatever it is
            return seen[1]
        real = os.path.join(os.path.dirname(os.path.realpath(seen[0] + name)), "")  # a link to
        return _under(real, self._listed_folders())  # a link: followed to its end

    def _listed_folders(self) -> set[str]:
        """The real paths of the folders whose files the scans list (found once, when a link to
        a file is first met): each split's class folders that are scanned (a linked one: its
        target, if listed), or the split folder itself where it has none. Without class names
        (train/ unlabelled) each split's own count, a linked one's target unless it meets a
        split folder."""
        if self._listed is None:
            self._listed = set(self.linked)
            for root in self._roots:
                if (subs := self._sub_dirs(root)) is None:
                    continue
                if not subs:  # unlabelled: its every file
                    self._listed.add(os.path.join(os.path.realpath(root), ""))
                named = set(self._classes or (e.name for e in subs))  # none: the root's own
                for e in (e for e in subs if e.name in named):  # a linked one: where it leads,
                    real = os.path.join(os.path.realpath(e.path), "")  # if its scan lists it
                    if not e.is_symlink() or not self._classes and not self.meets(real):
                        self._listed.add(real)  # (with names given, self.linked holds those)
        return self._listed


def _leads_to(entry: os.DirEntry) -> str:
    """What a link leads to: 'dir', 'file' or '' (nothing: a broken link, or a loop, for which
    DirEntry.is_dir raises ELOOP)."""
    try:
        return "dir" if entry.is_dir() else "file" if entry.is_file() else ""
    except OSError:
        return ""


def _ancestors(path: str) -> list[str]:
    """A real folder path (ending in a separator) and the folders above it, up to the root."""
    found = [path]
    while len(up := os.path.join(os.path.dirname(found[-1][:-1]), "")) < len(found[-1]) and up:
        found.append(up)
    return found


def _list_files(
    folder: Path, listed: _Listed, quiet: bool = False, split: bool = False
) -> list[str]:
    """Every file under folder, sorted as Paths sort (by their parts), listed without opening or
    stat-ing any (os.scandir's entries know their type): a tree of millions of files is indexed
    in the time it takes to list its directories. A symbolic link to a folder is followed (as
    torchvision's ImageFolder does), its files listed under the link's path, but not one whose
    target lies in a folder whose images are listed (`listed`: a split folder, or a class
    folder's target: its files are listed there, and through the link they would be listed
    twice, under another class, or a test image in the training split), holds one (`/`, or
    everything beside the dataset) or the link itself (a loop) or lies inside a target followed
    already (in this folder: links in two class folders to one target list it under each). Other
    folders are followed, the dataset's own unscanned ones among them. A class folder that is a
    link is not listed when its target lies in, is or holds another listed folder (`split`:
    `folder` is the split folder itself, unlabelled, and is listed wherever it lies). A warning
    names each link not followed, links that lead nowhere and folders that cannot be read (none
    with `quiet`). A target above one followed already is followed, and the folder followed
    before is not entered again through it: each file is listed once, whichever link comes
    first. A link to a file is listed under its own name unless the file lies in a folder whose
    files are listed (`listed.lists`, for the same reason; warned)."""
    found, skipped, broken, unreadable, files, twice = [], [], [], [], [], []
    start = os.path.join(target := os.path.realpath(folder), "")
    if not split and os.path.islink(folder) and listed.meets(start, own=True):
        if not quiet:
            _say(f"did not list class folder {folder}: a link to {target}, which lies in, is "
                 f"or holds a split folder or another class folder's target (its images would "
                 f"be listed twice, under another class, or in the other split)")  # fmt: skip
        return []
    followed = {start}  # real paths (ending in a separator) whose files are listed
    stack = [(str(folder), start)]  # (where it is listed, its real path)
    while stack:
        where, real = stack.pop()
        folders, links = [], []
        try:
            with os.scandir(where) as entries:
                for e in entries:
                    if e.is_dir(follow_symlinks=False):
                        sub = os.path.join(real + e.name, "")
                        if sub not in followed:  # else listed through its link
                            folders.append((e.path, sub))
                    elif e.is_symlink():  # stat-ed: links only
                        kind = _leads_to(e)
                        (links if kind == "dir" else files if kind else broken).append(e.path)
                    elif e.is_file():
                        found.append(e.path)
        except OSError:  # no permission, gone meanwhile: named, the rest still listed
            unreadable.append(where)
        for link in files:  # links to files: not one to a file listed already (twice, under
            (twice if listed.lists(link) else found).append(link)  # another class or split)
        files.clear()
        for link in sorted(links):  # in name order within a folder (folders too): which link a
            target = os.path.join(os.path.realpath(link), "")  # target comes through is fixed
            if real.startswith(target) or listed.meets(target) or _under(target, followed):
                skipped.append(link)
            else:
                followed.add(target)
                folders.append((link, target))
        stack += sorted(folders, reverse=True)
    if skipped and not quiet:
        _say(f"did not follow {len(skipped)} links to folders in or holding the dataset's split "
             f"folders ({', '.join(s[:-1] for s in listed.splits)}) or a class folder's target, "
             f"to a folder holding the link, or in one followed already: "
             f"{_few(sorted(skipped))}")  # fmt: skip
    if twice and not quiet:
        _say(f"did not list {len(twice)} links to files listed already (in a scanned class "
             f"folder, a class folder's target or an unlabelled split folder: through the link "
             f"a file would be listed twice, under another class, or in the other split): "
             f"{_few(sorted(twice))}")  # fmt: skip
    if broken and not quiet:
        _say(f"skipped {len(broken)} links to nothing (or to themselves) in {folder}: "
             f"{_few(sorted(broken))}")  # fmt: skip
    if unreadable and not quiet:
        _say(f"could not read {len(unreadable)} folders in {folder}: {_few(sorted(unreadable))}")
    return sorted(found, key=lambda p: p.split(os.sep))


def _under(path: str, tops: set[str]) -> bool:
    """Whether the real folder path `path` (ending in a separator) is one of `tops` (alike) or
    inside one: its ancestors looked up, not every top compared (20,000 links: 0.7 s, not 16)."""
    return any(up in tops for up in _ancestors(path))


def scan_image_folder(
    root: Path, classes: list[str] | None = None, splits: list[Path] | None = None
) -> FolderSplit:
    """Files of root/CLASS/* with an image suffix, listed only: a file is checked when decoded,
    and one that does not decode is then skipped and named once (loader.py). Other files are
    skipped, and classes without images kept, with a warning each. A folder without sub-folders
    is unlabelled: its images, no classes (for training without labels, train.objective=mpp).
    Links to folders are followed unless they lead into `splits` (the split folders of the
    dataset scanned, train/ and test/; root alone by default) or another class folder's target,
    or hold one of those (`/`, PATH), or loop; a class folder that is such a link is not listed,
    nor a link to a file in one of those folders (_list_files)."""
    if root.exists() and not root.is_dir():
        raise DatasetError(f"image folder {root} is a file, not a folder: expected a folder of "
                           "images (in a sub-folder per class)")  # fmt: skip
    if not root.is_dir():
        raise DatasetError(f"image folder {root} does not exist")
    found = _sub_folders(root)
    listed = _Listed(splits or [root], classes or found)
    classes = classes or found
    unlabelled = not classes
    files, labels, skipped, empty = [], [], [], []
    forms = _forms(root)
    for label, cls in enumerate(classes or ["."]):
        folder = _class_dir(root, cls, forms)
        if not folder.is_dir():
            empty.append(cls)
            continue
        had = len(files)
        for path in _list_files(folder, listed, split=unlabelled):
            if os.path.splitext(path)[1].lower() in IMAGE_SUFFIXES:
                files.append(path)
                labels.append(label)
            else:
                skipped.append(path)
        if len(files) == had:
            empty.append(cls)
    if skipped:
        _say(f"skipped {len(skipped)} non-image files in {root}: {_few(skipped)}")
    loose = [] if unlabelled else [f for f in root.iterdir() if f.is_file()]  # no class's
    if beside := sorted(f.name for f in loose if f.suffix.lower() in IMAGE_SUFFIXES):
        _say(f"image folder {root} has {len(beside)} image file{'s' * (len(beside) > 1)} beside "
             f"its class folders, not read (no class): {_few(beside)}")  # fmt: skip
    if not files:
        kinds = ", ".join(sorted(IMAGE_SUFFIXES))
        raise DatasetError(f"image folder {root} holds no image files ({kinds})")
    if empty and not unlabelled:  # said, not refused: a test split may lack a class
        _say(f"image folder {root} has no images of {len(empty)} of its {len(classes)} classes: "
             f"{_few(empty)} (their labels are kept; no image here has them)")  # fmt: skip
    if unlabelled:
        log.info("image folder %s has no class sub-folders: %d unlabelled images", root, len(files))
    return FolderSplit(files, torch.tensor(labels, dtype=torch.long), list(classes), skipped)


def _say(message: str) -> None:
    """A warning, once in this process, as Python's warnings are (a folder without train/ is
    scanned for the train and the test split); not counted as said where the logger drops it."""
    if message not in _SAID and log.isEnabledFor(logging.WARNING):
        _SAID.add(message)
        log.warning(message)


def _few(items: list) -> str:
    return ", ".join(map(str, items[:5])) + (", ..." if len(items) > 5 else "")


def folder_root(name: str) -> Path:
    """The folder an `imagefolder:PATH` dataset name names; a DatasetError for no PATH (an empty
    Path is the working folder, which `imagefolder:` once read as the dataset)."""
    path = name.split(":", 1)[1].strip()  # `imagefolder: /data/x` (a space) names /data/x
    if not path:
        raise DatasetError(f"{name!r} names no folder: expected imagefolder:PATH")
    return Path(path).expanduser()


def folder_files(root: Path, whole: bool = False) -> list[str]:
    """The files an image folder's splits are scanned from, listed as scan_image_folder lists
    them (every class folder's files, train/'s classes in test/ where it has any, links followed
    alike; the files beside the class folders too), no warning said: what a digest of the
    dataset's contents covers. `whole`: root read as one split (data.test's folder: its every
    sub-folder a class)."""
    folders = [root] if whole else _split_folders(root)
    if not root.is_dir():
        return []
    classes, files = _sub_folders(folders[0]), []
    for folder in folders:  # as load_folder_split: train/'s classes, else the folder's own
        names = classes or _sub_folders(folder)
        listed = _Listed(folders, names)
        if not names:  # unlabelled: the folder's every file
            files += _list_files(folder, listed, quiet=True, split=True)
            continue
        files += [str(p) for p in folder.iterdir() if not p.is_dir()]  # beside the classes
        forms = _forms(folder)
        for cls in names:
            if (found := _class_dir(folder, cls, forms)).is_dir():
                files += _list_files(found, listed, quiet=True)
    return files


def _sub_folders(folder: Path) -> list[str]:
    """The names of a folder's sub-folders (links to folders too), sorted: its classes."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


def _forms(folder: Path) -> dict[str, str]:
    """A folder's sub-folder names by their NFC form (Unicode's composed one)."""
    return {nfc(n): n for n in _sub_folders(folder)}


def _class_dir(folder: Path, cls: str, forms: dict[str, str]) -> Path:
    """Class `cls`'s folder under `folder`: its name, else the same name in another Unicode form
    (`forms`, _forms'): an archive made on macOS writes 'café' decomposed (NFD), one made
    elsewhere composed, and the test split lost that class's images."""
    if (folder / cls).is_dir():
        return folder / cls
    return folder / forms.get(nfc(cls), cls)


def _test_folder(root: Path) -> Path | None:
    """Where a folder with train/ has its test split: test/, else val/ (None: neither)."""
    return next((root / n for n in ("test", "val") if (root / n).is_dir()), None)


def _split_folders(root: Path) -> list[Path]:
    """The folders load_folder_split scans: train/ and its test folder (test/, else val/) when
    there is a train/, else root (both splits drawn from it)."""
    if not (root / "train").is_dir():
        return [root]
    return [root / "train"] + [t for t in [_test_folder(root)] if t is not None]


def scanned_folders(root: Path) -> list[Path]:
    """The folders load_folder_split reads class folders from: train/ and test/ or val/ when there
    is a train/, else the root itself."""
    return [root / n for n in ("train", "test", "val")] if (root / "train").is_dir() else [root]


def load_folder_split(root: Path, split: str, seed: int, whole: bool = False) -> FolderSplit:
    train_dir = root / "train"
    if train_dir.is_dir():
        classes = _sub_folders(train_dir)
        splits = _split_folders(root)
        if split != "test":
            return scan_image_folder(train_dir, classes, splits)
        if len(splits) == 1:
            raise DatasetError(f"{root} has train/ but neither test/ nor val/ for the test split")
        known = {nfc(c): c for c in classes}  # in either form
        forms = _forms(splits[1])  # a folder not read: no class's, or a class's other form
        extra = [c for c in _sub_folders(splits[1]) if classes and (
            (cls := known.get(nfc(c))) is None
            or _class_dir(splits[1], cls, forms).name != c)]  # fmt: skip
        if extra:  # never predicted right; data.test of other classes is refused
            _say(f"{splits[1]} has class folders {train_dir} lacks, left out of the test split: "
                 f"{_few(extra)}")  # fmt: skip
        if splits[1].name == "test" and (root / "val").is_dir():
            _say(f"{root} has train/, val/ and test/: val/ is not read (the test split is test/; "
                 f"validation is carved from train/ by data.val_fraction)")  # fmt: skip
        one, two = (os.path.join(os.path.realpath(f), "") for f in splits)
        if one.startswith(two) or two.startswith(one):
            _say(f"{splits[1]} and {train_dir} are one folder, or one holds the other (a link?): "
                 f"the test split's images are training images")  # fmt: skip
        return scan_image_folder(splits[1], classes, splits)
    full = scan_image_folder(root)
    if whole and split == "train":
        return full
    train, test = seeded_split(len(full), 0.2, seed)
    return full.subset(test if split == "test" else train)
