"""What the PNG check before torchvision's decoder costs, and what it prevents.

torchvision's PNG decoder ends the process (SIGSEGV) on an error libpng meets while reading the
rows (a CRC or zlib checksum error, a bad filter byte, missing rows); vitlab.data.decode checks the
pixel data first (`png_damage`) and names such a file. This times, per image, for three PNGs (a
28x28 grey image as Fashion-MNIST shards hold, a smooth 224x224 RGB picture, 700x500 RGB noise):
torchvision's decoder alone, the check alone, vitlab's decode_image with and without the check,
and PIL. Then it damages PNGs at random (1-6 bytes, half with every chunk's CRC made right, a fifth
truncated) and decodes them in child processes, once through torchvision alone and once through
vitlab's decode_image, counting the files that crashed one (another child goes on after it).

    .venv/bin/python benchmarks/png_decode.py [--repeats 200] [--damaged 300]
"""

from __future__ import annotations

import argparse
import io
import random
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode
from torchvision.io import decode_image as tv_decode

from vitlab.data import decode

CHILD = """
import sys, torch
from torchvision.io import decode_image, ImageReadMode
from vitlab.data.decode import decode_image as vitlab_decode
RGB = ImageReadMode.RGB
for path in sys.argv[3:]:
    print(path, flush=True)  # the file being read, should the process die on it
    data = open(path, "rb").read()
    try:
        if sys.argv[1] == "torchvision":
            decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=RGB)
        else:
            vitlab_decode(data, 3, path)
    except Exception:
        pass
"""


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def per_call(repeats: int, fn, *args) -> float:
    """Microseconds a call of fn(*args), after one call not timed."""
    fn(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - start) / repeats * 1e6


def torchvision_only(data: bytes) -> torch.Tensor:
    return tv_decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def timings(repeats: int) -> None:
    rs = np.random.RandomState(0)
    x = np.linspace(0, 255, 224)
    smooth = (np.add.outer(x, x) / 2).astype(np.uint8)
    images = {
        "28x28 grey": png((rs.randint(0, 255, (28, 28)) // 8 * 8).astype(np.uint8)),
        "224x224 RGB, smooth": png(np.stack([smooth, smooth.T, smooth[::-1]], -1)),
        "700x500 RGB, noise": png(rs.randint(0, 255, (700, 500, 3), np.uint8)),
    }
    real = decode.png_damage
    print("| PNG | bytes | torchvision | the check | vitlab, no check | vitlab | PIL |")
    print("|---|---|---|---|---|---|---|")
    for name, data in images.items():
        n = repeats * 10 if "28x28" in name else repeats
        tv = per_call(n, torchvision_only, data)
        check = per_call(n, real, data)
        decode.png_damage = lambda data: None
        unchecked = per_call(n, decode.decode_image, data, 3, name)
        decode.png_damage = real
        checked = per_call(n, decode.decode_image, data, 3, name)
        pil = per_call(n, decode._pil_decode, data, "RGB", name)
        print(f"| {name} | {len(data):,} | {tv:.0f} us | {check:.0f} us | {unchecked:.0f} us | "
              f"{checked:.0f} us | {pil:.0f} us |")  # fmt: skip


def damaged(count: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    x = np.linspace(0, 255, 48)
    smooth = (np.add.outer(x, x) / 2).astype(np.uint8)
    bases = [png(smooth), png(np.stack([smooth, smooth.T, smooth], -1))]
    out = []
    for _ in range(count):
        data = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(8, len(data))] = rng.randrange(256)
        if rng.random() < 0.5:  # every chunk's CRC made right: the damage reaches the pixels
            i = 8
            while i + 12 <= len(data):
                n = struct.unpack(">I", data[i : i + 4])[0]
                if i + 12 + n > len(data):
                    break
                data[i + 8 + n : i + 12 + n] = struct.pack(
                    ">I", zlib.crc32(data[i + 4 : i + 8 + n])
                )
                i += 12 + n
        if rng.random() < 0.2:
            data = data[: rng.randrange(10, len(data))]
        out.append(bytes(data))
    return out


def crashes(count: int, folder: str) -> None:
    files = []
    for i, data in enumerate(damaged(count)):
        path = f"{folder}/{i}.png"
        with open(path, "wb") as f:
            f.write(data)
        files.append(path)
    for reader in ("torchvision", "vitlab"):
        crashed, left = 0, files
        while left:  # one child reads the files in turn; where it dies, another goes on after
            run = subprocess.run([sys.executable, "-c", CHILD, reader, "-", *left],
                                 capture_output=True, text=True)  # fmt: skip
            if run.returncode >= 0:
                break
            crashed += 1
            read = run.stdout.split()
            left = left[left.index(read[-1]) + 1 :] if read else left[1:]
        print(f"{reader}: {crashed} of {count} damaged PNGs crashed the process")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--damaged", type=int, default=300)
    args = parser.parse_args()
    timings(args.repeats)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        crashes(args.damaged, folder)


if __name__ == "__main__":
    main()
