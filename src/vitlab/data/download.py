"""Finding dataset files on disk, and fetching them (with SHA-256 checks) when they are missing;
DatasetError, which every dataset reader raises, is defined here (datasets.py re-exports it)."""

from __future__ import annotations

import gzip
import hashlib
import os
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from vitlab.runtime import bars_off, file_mode

FASHION_MIRROR = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
# SHA-256 of the decompressed IDX payloads: the same whichever gzip wrote the .gz (Debian's
# dataset-fashion-mnist package recompresses the official files, so their .gz bytes differ).
FASHION_SHA256 = {
    name: digest
    for name, digest in (
        (
            "train-images-idx3-ubyte.gz",
            "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
        ),
        (
            "train-labels-idx1-ubyte.gz",
            "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
        ),
        (
            "t10k-images-idx3-ubyte.gz",
            "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
        ),
        (
            "t10k-labels-idx1-ubyte.gz",
            "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
        ),
    )
}
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
# where else a dataset's files may be put, as a message says it (`vitlab reproduce` has only the
# variable; `train`, data.dir=; eval, fewshot, probe, analyze and `data shard`, --data-dir)
ELSEWHERE = (
    "a folder named by $VITLAB_DATA, `vitlab train`'s data.dir= or another command's --data-dir"
)


class DatasetError(ValueError):
    """A dataset that cannot be found or read."""


def cache_dir() -> Path:
    return Path.home() / ".cache" / "vitlab"


def fashion_mnist_candidates(data_dir: str | None) -> list[Path]:
    """Where Fashion-MNIST is looked for, in order: data.dir, $VITLAB_DATA, Debian's package
    folder, ~/.cache/vitlab (each also with a fashion-mnist/ sub-folder)."""
    roots = [Path(p).expanduser() for p in (data_dir, os.environ.get("VITLAB_DATA")) if p]
    roots += [DEBIAN_DIR, cache_dir()]
    out: list[Path] = []
    for root in roots:
        for folder in (root, root / "fashion-mnist"):
            if folder not in out:
                out.append(folder)
    return out


def payload_sha256(path: Path) -> str:
    with gzip.open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def find_fashion_mnist(data_dir: str | None) -> dict[str, Path] | None:
    for folder in fashion_mnist_candidates(data_dir):
        files = {name: folder / name for name in FASHION_SHA256}
        if all(p.is_file() for p in files.values()):
            return files
    return None


def fetch(url: str, dest: Path, expected_sha256: str, gzipped: bool = True) -> None:
    """Download url to dest atomically, checking the SHA-256 of the decompressed payload (of the
    file itself unless `gzipped`). Processes fetching into one folder (the ranks of a torchrun)
    take turns: the first downloads, the others then find the file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _folder_turn(dest.parent):
        if not dest.is_file():
            _download(url, dest, expected_sha256, gzipped)


@contextmanager
def _folder_turn(folder: Path) -> Iterator[None]:
    """An flock on the folder itself (no lock file left behind) while the block runs; none where
    there is no flock (Windows) or the file system refuses one on a folder."""
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        with suppress(OSError):  # NFS (a folder cannot be write-locked there), Lustre, FUSE
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # lets go of the lock


def _download(url: str, dest: Path, expected_sha256: str, gzipped: bool) -> None:
    from tqdm import tqdm

    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=30) as resp:
            total = int(resp.headers.get("Content-Length") or 0) or None
            shown = {"desc": dest.name, "disable": bars_off()}  # -q hides it (and --no-progress)
            with tqdm(total=total, unit="B", unit_scale=True, **shown) as bar:
                while chunk := resp.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        try:
            digest = payload_sha256(Path(tmp)) if gzipped else file_sha256(Path(tmp))
        except (EOFError, zlib.error) as e:  # a connection dropped mid-file: no error from read()
            raise OSError(f"{url}: the download is incomplete or not gzip data ({e})") from None
        if digest != expected_sha256:
            raise OSError(f"{url}: SHA-256 {digest} does not match the expected {expected_sha256}")
        os.chmod(tmp, file_mode())  # mkstemp's 0600 would hide a shared data.dir's files
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def find_or_fetch_fashion_mnist(data_dir: str | None) -> dict[str, Path]:
    """The four Fashion-MNIST files, found on disk or downloaded into ~/.cache/vitlab/fashion-mnist
    (or data.dir when given); offline and missing, a DatasetError naming both ways to get them."""
    found = find_fashion_mnist(data_dir)
    if found:
        return found
    target = (Path(data_dir).expanduser() if data_dir else cache_dir()) / "fashion-mnist"
    try:
        for name, sha in FASHION_SHA256.items():
            if not (target / name).is_file():
                fetch(FASHION_MIRROR + name, target / name, sha)
    except (OSError, urllib.error.URLError) as e:
        looked = ", ".join(str(p) for p in fashion_mnist_candidates(data_dir))
        raise DatasetError(
            f"Fashion-MNIST not found (looked in {looked}) and the download from {FASHION_MIRROR} "
            f"failed ({e}). Get it either way: `apt-get install dataset-fashion-mnist` (Debian, "
            f"files in {DEBIAN_DIR}), or download the four *-ubyte.gz files from {FASHION_MIRROR} "
            f"into {target} (or into {ELSEWHERE})."
        ) from None
    return {name: target / name for name in FASHION_SHA256}


def absolute_source(name: str | None) -> str | None:
    """A dataset name with its local path made absolute (imagefolder:, hf: on disk, local wds:
    shards), as a run's config.yaml keeps it; another name (digits, a hub name, a URL) as it is."""
    kind, sep, rest = (name or "").partition(":")
    if not sep or kind not in ("imagefolder", "hf", "wds"):
        return name  # digits, fashion-mnist, cifar10, ... (and None)
    spec, mark, split = rest.strip().partition("#") if kind == "hf" else (rest.strip(), "", "")
    path = os.path.expanduser(spec)
    if (kind == "hf" and not os.path.exists(path)) or "://" in spec or spec.startswith("pipe:"):
        return name  # a hub name, a URL, a command
    if not spec:
        return name  # no path: an error where it is read, not the working folder
    return f"{kind}:{os.path.abspath(path)}{mark}{split}"
