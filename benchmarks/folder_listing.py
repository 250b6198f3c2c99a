"""Listing an image folder (`imagefolder:PATH`'s scan, no file opened) whose class folder holds
plain files, against one whose files are symbolic links into a pool of images outside the
dataset (a common way to build splits without copying): each link to a file is checked against
the folders the scan lists (data/folders.py, _Listed.lists: a readlink and an lstat a link, each
target folder resolved once), which the plain folder does not pay.

    .venv/bin/python benchmarks/folder_listing.py --files 50000

Builds both layouts in a temporary folder, lists each split `--rounds` times (best time kept) and
prints one JSON line: seconds to list, microseconds a file, and the links' extra cost a file.
Results go in BENCHMARKS.md ("Data at scale").
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from vitlab.data.folders import load_folder_split


def build(root: Path, files: int, links: bool) -> Path:
    """root/ds/{train,test}/cls/ with `files` images in train (files, or links into root/pool)."""
    ds = root / "ds"
    (ds / "train" / "cls").mkdir(parents=True)
    (ds / "test" / "cls").mkdir(parents=True)
    (ds / "test" / "cls" / "t.png").write_bytes(b"png")
    pool = root / "pool"
    pool.mkdir()
    for i in range(files):
        name = f"{i:07d}.png"
        if links:
            (pool / name).write_bytes(b"png")
            os.symlink(f"../../../pool/{name}", ds / "train" / "cls" / name)
        else:
            (ds / "train" / "cls" / name).write_bytes(b"png")
    return ds


def best_seconds(ds: Path, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        listed = load_folder_split(ds, "train", 0)
        best = min(best, time.perf_counter() - start)
    assert len(listed) > 0
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    out = {"files": args.files}
    for kind in ("files", "links"):
        with tempfile.TemporaryDirectory() as tmp:
            ds = build(Path(tmp), args.files, links=kind == "links")
            out[f"{kind}_s"] = round(best_seconds(ds, args.rounds), 3)
    out["files_us_each"] = round(1e6 * out["files_s"] / args.files, 2)
    out["links_us_each"] = round(1e6 * out["links_s"] / args.files, 2)
    out["link_extra_us_each"] = round(out["links_us_each"] - out["files_us_each"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
