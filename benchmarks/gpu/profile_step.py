"""Where a training step's GPU time goes, vitlab against timm, the same weights (cuda_speed.py's
setup): the step split into forward, backward and optimizer (each timed alone, interleaved,
median of the rounds), then torch.profiler's table of each library's step (self CUDA time by
operator, the kernel count), written to OUT_DIR.

    python benchmarks/gpu/profile_step.py [--model Ti/16:256] [--precision bf16|fp32]
        [--rounds 15] [--out-dir /tmp/gpu-out]
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_speed import medians  # noqa: E402
from model_speed import optimizer, randomize_heads, timm_twin  # noqa: E402

import vitlab  # noqa: E402


def parts(model, opt, x, y, bf16: bool) -> dict:
    """forward, forward+backward and the optimizer step of one training step, each callable."""
    ctx = (lambda: torch.autocast(x.device.type, torch.bfloat16)) if bf16 else nullcontext
    model.train()

    def forward() -> None:
        with torch.no_grad(), ctx():
            model(x)

    def forward_backward() -> None:
        with ctx():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()

    def step() -> None:
        forward_backward()
        opt.step()

    forward_backward()  # gradients exist for opt.step alone
    return {"forward": forward, "forward_backward": forward_backward, "opt_step": opt.step,
            "train_step": step}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Ti/16:256")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out-dir", default="/tmp/gpu-out")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name, _, batch = args.model.rpartition(":")
    if not name or not batch.isdigit():
        p.error(f"--model takes NAME:BATCH, e.g. Ti/16:256; got {args.model!r}")
    device, bf16 = args.device, args.precision == "bf16"
    torch.manual_seed(0)
    ours = vitlab.create_model(name)
    randomize_heads(ours)
    models = {"vitlab": ours.to(device), "timm": timm_twin(ours).to(device)}
    c = ours.config
    x = torch.randn(int(batch), c.in_chans, *c.img_hw, device=device)
    y = torch.randint(0, c.num_classes, (int(batch),), device=device)
    opts = {k: optimizer(m, k, "own") for k, m in models.items()}
    print({k: (type(o).__name__, {d: o.defaults.get(d) for d in ("foreach", "fused")})
           for k, o in opts.items()}, flush=True)  # fmt: skip
    fns = {k: parts(m, opts[k], x, y, bf16) for k, m in models.items()}
    split = {}
    for part in ("forward", "forward_backward", "opt_step", "train_step"):
        secs = medians({k: f[part] for k, f in fns.items()}, args.rounds)
        split[part] = {k: round(s * 1e3, 3) for k, s in secs.items()}
        print(part, "ms:", split[part], "timm/vitlab", round(secs["timm"] / secs["vitlab"], 3),
              flush=True)  # fmt: skip
    (out / "split.json").write_text(json.dumps(split, indent=2) + "\n")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    for lib, f in fns.items():
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(5):
                f["train_step"]()
            if device == "cuda":
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
        kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
        text = f"{lib}: {kernels / 5:.0f} GPU events a step (kernels, memcpy, memset)\n{table}\n"
        (out / f"profile_{lib}.txt").write_text(text)
        print(text[:4000], flush=True)


if __name__ == "__main__":
    main()
