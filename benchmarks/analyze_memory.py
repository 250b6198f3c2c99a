"""Peak memory of `vitlab analyze` on ViT-B/16 at 384 (random weights), against what holding every
layer's attention at once would add. The analysis takes attention one layer at a time.

    .venv/bin/python benchmarks/analyze_memory.py [--images 8]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

import vitlab
from vitlab.preprocessing import Preprocessing
from vitlab.train.state import CheckpointMeta, save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = vitlab.create_model("vit_base_patch16_384")
        pre = Preprocessing((384, 384), 3, (0.5,) * 3, (0.5,) * 3)
        meta = CheckpointMeta(model.config, pre, [str(i) for i in range(1000)], {})
        save_checkpoint(root / "ckpt", model.state_dict(), meta)
        files = []
        for i in range(args.images):
            path = root / f"{i}.png"
            pixels = np.random.default_rng(i).integers(0, 256, (384, 384, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(path)
            files.append(str(path))
        del model
        t = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "vitlab",
                "analyze",
                str(root / "ckpt"),
                "--images",
                *files,
                "--out",
                str(root / "out"),
            ],  # fmt: skip
            check=True,
            capture_output=True,
        )
        seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    cfg = vitlab.get_config("vit_base_patch16_384")
    t_tokens = cfg.num_patches + 1
    per_layer = min(args.images, 16) * cfg.num_heads * t_tokens**2 * 4  # one batch, fp32
    print(
        json.dumps(
            {
                "model": "vit_base_patch16_384",
                "images": args.images,
                "peak_rss_gib": round(peak / 2**30, 2),
                "seconds": round(seconds, 1),
                "one_layer_attention_gib": round(per_layer / 2**30, 3),
                "all_layers_attention_gib": round(cfg.depth * per_layer / 2**30, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
