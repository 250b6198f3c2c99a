"""vitlab on one CUDA GPU against timm and Hugging Face transformers: the same weights in all three
(timm's twin as model_speed.py builds it; transformers' ViTForImageClassification from the folder
`vitlab convert --to hf` writes, SDPA attention), logits compared in float32, then the training
step (cross-entropy, each library's AdamW as its scripts build it: vitlab's `build_optimizer`,
timm's `create_optimizer_v2`, `torch.optim.AdamW` for transformers' Trainer default) and
inference, in bf16 autocast and in float32 (PyTorch's default: no TF32), timed interleaved
(a, b, c, a, b, c, ...) with the GPU synchronised around each library's group of 3 calls, median
of the rounds; peak_mem_gib: the most GPU memory allocated during the row (all three libraries'
models and optimizer states together).

    python benchmarks/gpu/cuda_speed.py [--models Ti/16:256 S/16:256 B/16:128] [--rounds 15]
        [--json OUT.json]

benchmarks/gpu/run.sh runs it with the end-to-end checks on a lent GPU machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_speed import optimizer, randomize_heads, step_fns, timm_twin  # noqa: E402

import vitlab  # noqa: E402
from vitlab.models.checkpoint import save_pretrained  # noqa: E402


def hf_twin(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' ViTForImageClassification with `model`'s weights, through vitlab's writer."""
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, Path(tmp) / "hf", "hf")
        twin = transformers.ViTForImageClassification.from_pretrained(
            Path(tmp) / "hf", attn_implementation="sdpa"
        )
    return _Logits(twin)


class _Logits(torch.nn.Module):
    """transformers' model called as the others are: model(x) -> logits."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(pixel_values=x).logits


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def medians(fns: dict, rounds: int, calls: int = 3, warmup: int = 3) -> dict[str, float]:
    """Median over `rounds` of the seconds per call (`calls` calls between two synchronisations),
    the libraries in turn."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            sync()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            times[k].append((time.perf_counter() - t) / calls)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def measure(name: str, batch: int, rounds: int, device: str) -> list[dict]:
    torch.manual_seed(0)
    ours = vitlab.create_model(name)
    randomize_heads(ours)
    models = {"vitlab": ours, "timm": timm_twin(ours), "hf": hf_twin(ours)}
    models = {k: m.to(device) for k, m in models.items()}
    c = ours.config
    x = torch.randn(batch, c.in_chans, *c.img_hw, device=device)
    y = torch.randint(0, c.num_classes, (batch,), device=device)
    with torch.no_grad():
        for m in models.values():
            m.eval()
        logits = {k: m(x[:8]).float() for k, m in models.items()}
    rows = []
    for bf16 in (True, False):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        row = {"model": name, "batch": batch, "precision": "bf16" if bf16 else "fp32"}
        for lib in ("timm", "hf"):
            row[f"fp32_max_logit_diff_{lib}"] = (logits["vitlab"] - logits[lib]).abs().max().item()
        opts = {k: optimizer(m, "vitlab" if k == "vitlab" else "timm", "own") for k, m in
                models.items() if k != "hf"}  # fmt: skip
        opts["hf"] = torch.optim.AdamW(models["hf"].parameters(), lr=1e-4)
        fns = {k: step_fns(m, x, y, bf16, opts[k]) for k, m in models.items()}
        for i, kind in enumerate(("infer", "train")):
            secs = medians({k: f[i] for k, f in fns.items()}, rounds)
            for lib, s in secs.items():
                row[f"{lib}_{kind}_img_s"] = round(batch / s, 1)
            for lib in ("timm", "hf"):
                row[f"{kind}_vs_{lib}"] = round(secs[lib] / secs["vitlab"], 3)
        if device == "cuda":
            row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del opts, fns
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["Ti/16:256", "S/16:256", "B/16:128"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    import timm
    import transformers

    print(f"torch {torch.__version__}, timm {timm.__version__}, transformers "
          f"{transformers.__version__}, {args.device}", flush=True)  # fmt: skip
    rows = []
    for spec in args.models:
        name, _, batch = spec.rpartition(":")
        rows += measure(name, int(batch), args.rounds, args.device)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
