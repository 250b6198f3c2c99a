"""`vitlab predict` against a timm user's own script on the same image files, interleaved in one
process (steady state: the checkpoint read and the model built inside each call, as the command
does; Python's start-up left out), and their top-1 agreement.

    .venv/bin/python benchmarks/predict_speed.py [--model vit_tiny_patch16_224] [--images 40]
        [--repeats 5] [--json out.json]

timm's model (random weights, seeded, its zero-initialised head randomised too so that the classes
differ) is saved with timm's save_for_hf (model.safetensors and config.json, the folder a timm user
has from the hub); vitlab reads it with that config's preprocessing, as timm's resolve_data_config
does. The images: smooth random 320x240 pictures, three JPEG to one PNG.
The timm script: PIL open + convert, timm's resolve_data_config / create_transform, batches of 32
under torch.inference_mode, softmax, top-5. vitlab: predict_files as `vitlab predict` calls it,
at its default batch and at --batch-size 1 (how predict ran until 2026-12-05). Results go in
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import timm
import torch
from model_speed import randomize_heads
from PIL import Image
from timm.data import create_transform, resolve_data_config
from timm.models import save_for_hf

from vitlab.eval.run import predict_files


def images(folder: Path, n: int) -> list[str]:
    """n smooth random 320x240 RGB pictures (every fourth a PNG, the rest JPEG)."""
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        small = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        picture = Image.fromarray(small).resize((320, 240), Image.BICUBIC)
        path = folder / f"img{i:03d}.{'png' if i % 4 == 0 else 'jpg'}"
        picture.save(path)
        paths.append(str(path))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="vit_tiny_patch16_224")
    ap.add_argument("--images", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    tm = timm.create_model(args.model, pretrained=False).eval()
    randomize_heads(tm)
    tf = create_transform(**resolve_data_config({}, model=tm))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "model"
        save_for_hf(tm, ckpt)
        files = images(Path(tmp), args.images)

        def timm_script() -> list[int]:
            top = []
            with torch.inference_mode():
                for i in range(0, len(files), 32):
                    x = torch.stack([tf(Image.open(f).convert("RGB")) for f in files[i : i + 32]])
                    top += tm(x).softmax(1).topk(5).indices[:, 0].tolist()
            return top

        cases = {
            "timm script (batch 32)": timm_script,
            "vitlab predict (default batch)": lambda: predict_files(str(ckpt), files, device="cpu"),
            "vitlab predict --batch-size 1": lambda: predict_files(
                str(ckpt), files, device="cpu", batch_size=1
            ),
        }
        outputs = {k: f() for k, f in cases.items()}  # warm-up, and the answers compared
        seconds: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.repeats):
            for k, f in cases.items():
                t = time.perf_counter()
                f()
                seconds[k].append(time.perf_counter() - t)
    ref = outputs["timm script (batch 32)"]
    agree = {
        k: sum(r["top"][0]["index"] == t for r, t in zip(v, ref, strict=True)) / len(ref)
        for k, v in outputs.items()
        if k.startswith("vitlab")
    }
    base = statistics.median(seconds["timm script (batch 32)"])
    report = {
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "timm": timm.__version__,
        "threads": torch.get_num_threads(),
        "model": args.model,
        "images": len(ref),
        "median_s": {k: round(statistics.median(v), 3) for k, v in seconds.items()},
        # vitlab's time over timm's: below 1, vitlab is faster (a time's ratio, unlike the
        # throughput ratios of model_speed.py, where above 1 is faster)
        "time_ratio_to_timm": {
            k: round(statistics.median(v) / base, 2) for k, v in seconds.items()
        },
        "top1_agreement_with_timm": agree,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
