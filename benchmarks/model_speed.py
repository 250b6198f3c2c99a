"""Forward (inference) and training-step throughput of vitlab against timm's twin of the same
shape (its VisionTransformer, hybrid, DeiT distilled model or ResNet), side by side in one process,
fp32 and bf16 autocast.

    .venv/bin/python benchmarks/model_speed.py                       # the default set
    .venv/bin/python benchmarks/model_speed.py --models Ti/16 --batch 32 --steps 10 --json out.json
    .venv/bin/python benchmarks/model_speed.py --models Ti/16:distilled=true R26+S/32 resnet18_28

A model is a registered name or alias, optionally with `:field=value,...` config overrides. Both
models get identical weights (the test suite checks that they then agree to 1e-5; this script
refuses to time a pair 1e-3 apart, a wrong twin), so the comparison is of implementations only. A
distilled model's forward averages its two heads in both libraries (timm's default); the training
step is cross-entropy on that output, then each library's own AdamW as its training script builds
it: vitlab's fused kernel (`vitlab train`'s `build_optimizer`), timm's
`create_optimizer_v2("adamw")` (PyTorch's per-tensor loop on CPU); `--optimizer plain` gives both
the same `torch.optim.AdamW`. timm has no conv stem: for `stem=conv` its ViT is built around a copy
of vitlab's stem, so the encoder is what differs.

MFU: each row's FLOP/s against the same run's measured peak, a 2048x2048 matrix product in the
row's precision. A ViT's FLOPs are 2 x `vitlab cost`'s forward MACs (attention products included),
other models' PyTorch's FlopCounterMode count of the forward; a training step is 3x a forward.
These are the model's FLOPs, every row of every block as timm computes them, for both libraries:
vitlab's last block computes the class token's rows only (`--all-rows`), so the products it runs
are fewer (a count on 2026-12-06: 0.76 of the training step's for nano, 0.84 micro, 0.79 the conv
stem, 0.92 Ti/16 and B/16 forward), and its MFU overstates its share of the matrix-product peak
by the inverse.

On a bf16 CPU the bf16 pass also times timm's fp32 training step interleaved with vitlab's
(timm_fp32_train_* columns): default_train_vs_timm_fp32, vitlab's default path (train.precision=
auto) against timm's eager fp32, is taken from that pass (it divided two passes' figures before
2026-12-06). The run's CPU (model name and the flags that decide its fast path) is printed and
kept in the JSON's first row.

`--channels-last` adds a third contestant, vitlab's model as `train.channels_last` trains it
(convolution weights and images in NHWC memory), timed interleaved with the other two.

`--batch-threads N` adds another: vitlab's training step as `train.batch_threads=N` runs it (the
batch in N parts, each part's forward and backward on its own thread with 1/N of the threads) and
its inference as `vitlab eval --batch-threads N` runs it; vitlab_bt_* columns and bt_gain, with
`--channels-last` also in NHWC memory.

`--sdpa` adds vitlab's model without its CPU kernels (models/cpu_kernels.py: PyTorch's attention,
LayerNorm and GELU instead of vitlab's, which the default contestant uses where they apply):
vitlab_sdpa_* columns and kernel_gain (vitlab's default over it).

`--ceiling` times vitlab's matrix products alone, each shape its linear layers multiply (as
vitlab runs them) on its own, forward (inference) and forward plus the backward's two products
(training): matmul_*_ms, and *_ceiling, timm's time over that: the ratio to timm vitlab's step
would reach if everything but its matrix products took no time.

`--packed` adds vitlab's inference as `vitlab eval` / `predict` run it (eval.backends.prepare:
a copy whose float32 CPU linear layers have their weights packed once for oneDNN,
models/packed.py), timed interleaved: vitlab_packed_infer_* columns, infer_packed_gain (over
vitlab's default model(x)) and infer_packed_ratio (timm's time over it); float32 inference only,
and only for a model with a layer large enough to be packed (PACK_BYTES).

`--all-rows` adds vitlab's ViT computing every token's row in its last block as timm's does
(forward() computes only the class token's rows there, VisionTransformer.forward_features'
head_only): vitlab_rows_* columns and head_only_gain. MFU counts every row's FLOPs for all.

`--isa avx2` re-runs the script with PyTorch's kernels (ATEN_CPU_CAPABILITY), oneDNN and MKL held
to AVX2: the float32 path of an AVX2-only CPU (no AVX-512, no bf16) on any newer x86 machine. bf16
rows are then left out (such CPUs have no bf16 arithmetic), as they are on a CPU that is AVX2-only
(or otherwise lacks bf16 arithmetic: runtime.cpu_has_bf16), where they would take hours.
Results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

import torch
import yaml
from machine_info import cpu_flags

import vitlab
from vitlab.analysis.cost import forward_macs, matrix_products
from vitlab.cli.eval import positive_int
from vitlab.config import OptimConfig
from vitlab.eval.backends import BatchParts
from vitlab.formats.timm import vitlab_to_timm
from vitlab.formats.timm_names import timm_model_args
from vitlab.models.cpu_kernels import use_kernel
from vitlab.models.packed import PACK_BYTES, pack_linear
from vitlab.models.registry import family_of
from vitlab.runtime import cpu_has_bf16, use_bf16
from vitlab.train.engine import classification
from vitlab.train.optim import build_optimizer
from vitlab.train.threads import BatchThreads

# an AVX2-only CPU's kernels on a newer one: ATen's dispatch, oneDNN and MKL held to AVX2
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def hold_to(isa: str) -> None:
    """With isa "avx2", run this script again under AVX2_ENV unless it already runs so (the
    variables are read when the libraries load)."""
    if isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})


DEFAULT = [
    ("vit_nano_patch4_28", 256),
    ("Ti/16", 32),
    ("S/16", 16),
    ("B/16", 8),
    ("Ti/16:distilled=true", 32),  # DeiT-Ti distilled
    ("R26+S/32", 16),  # hybrids
    ("R50+B/16", 4),
    ("resnet18_28", 128),  # CNN baselines: the small stem, and torchvision's at 224
    ("resnet18", 16),
    ("resnetv2_50", 8),  # BiT's ResNet-v2-50 (the hybrids' ResNet with four stages)
]


def parse_model(spec: str) -> tuple[str, dict[str, object]]:
    """'Ti/16:distilled=true,img_size=384' -> ('Ti/16', {'distilled': True, 'img_size': 384});
    a list in brackets keeps its commas: 'nano:stem=conv,stem_depths=[2,2]'."""
    name, _, rest = spec.partition(":")
    overrides = {}
    for item in filter(None, re.split(r",(?![^\[]*\])", rest)):
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    return name, overrides


def timm_twin(model: torch.nn.Module) -> torch.nn.Module:
    """timm's model with `model`'s shape and weights: a ViT, hybrid or distilled ViT from the same
    model_args that `vitlab convert --to timm` writes; a ResNet from timm's resnet18 / 34 / 50
    (torchvision's names, as vitlab's), its conv1 and max-pool swapped for the small stem; BiT's
    ResNet-v2-50 as timm's ResNetV2 with StdConv2dSame (the hybrids' backbone)."""
    import timm

    cfg = model.config
    if family_of(cfg) == "cnn" and cfg.bit:  # timm's ResNetV2 as the hybrids build it
        from timm.layers import StdConv2dSame
        from timm.models.resnetv2 import ResNetV2

        if cfg.uses_small_stem:
            raise SystemExit("timm's ResNetV2 has no small stem: compare resnetv2_50 above 32 px")
        twin = ResNetV2(layers=cfg.depths, preact=False, stem_type="same",
                        conv_layer=partial(StdConv2dSame, eps=1e-8),
                        num_classes=cfg.num_classes, in_chans=cfg.in_chans)  # fmt: skip
        twin.load_state_dict(model.state_dict())
        return twin
    if family_of(cfg) == "cnn":
        twin = timm.create_model(cfg.arch, num_classes=cfg.num_classes, in_chans=cfg.in_chans)
        if cfg.uses_small_stem:
            twin.conv1 = torch.nn.Conv2d(cfg.in_chans, 64, 3, 1, 1, bias=False)
            twin.maxpool = torch.nn.Identity()
        twin.load_state_dict(model.state_dict())
        return twin
    if cfg.stem == "conv":  # timm has no conv stem: its ViT around a copy of vitlab's stem
        arch, args = timm_model_args(cfg.replace(stem="patch", stem_depths=()))
        stem = copy.deepcopy(model.patch_embed)
        stem.num_patches = stem.grid[0] * stem.grid[1]  # what timm's ViT reads of its embed_layer
        twin = timm.create_model(arch, **args, embed_layer=lambda **_: stem)
        state = model.state_dict()
        encoder = {k: v for k, v in state.items() if not k.startswith("patch_embed.")}
        twin.load_state_dict({**vitlab_to_timm(encoder), **stem.state_dict(prefix="patch_embed.")})
        return twin
    arch, args = timm_model_args(cfg)
    twin = timm.create_model(arch, **args)
    twin.load_state_dict(vitlab_to_timm(model.state_dict()))
    return twin


def randomize_heads(model: torch.nn.Module) -> None:
    """Non-zero classifier weights (vitlab's start at zero), so the heads' matmuls are real."""
    for name in ("head", "head_dist", "fc"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            torch.nn.init.normal_(head.weight, std=0.02)


def median_seconds(fns: dict[str, Callable[[], None]], steps: int, warmup: int = 2) -> dict:
    """Median seconds per call of each fn, the fns called in turn (a, b, c, a, b, c, ...) so that
    all see the same machine state; the shared machine's noise hits them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(steps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def matmul_peak(dtype: torch.dtype, n: int = 2048, calls: int = 10) -> float:
    """FLOP/s of an n x n matrix product in `dtype` on this machine now (median of `calls`)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    secs = median_seconds({"mm": lambda: a @ b}, calls)["mm"]
    return 2 * n**3 / secs


def forward_flops(model: torch.nn.Module, x: torch.Tensor) -> float:
    """FLOPs of one forward pass over batch x: a ViT's from the cost model (PyTorch's counter
    misses the CPU attention kernel), other models' from PyTorch's FlopCounterMode."""
    if family_of(model.config) == "vit":
        return 2.0 * forward_macs(model.config) * len(x)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.eval()(x)
    return float(counter.get_total_flops())


def products_seconds(shapes: Counter, steps: int) -> dict[str, float]:
    """Seconds of the matrix products alone, each shape timed on its own (median of `steps`): the
    forward's (infer), and the forward's plus its backward's two per product (train: dX and dW,
    in the layouts PyTorch's linear backward uses). An estimate: operands in cache, no bias."""
    fwd = bwd = 0.0
    for (m, k, n), count in shapes.items():
        a, b, dy = torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)
        products = {"y": (a, b), "dx": (dy, b.T), "dw": (dy.T, a)}
        secs = median_seconds(
            {name: partial(torch.mm, *ab) for name, ab in products.items()}, steps
        )
        fwd += count * secs["y"]
        bwd += count * (secs["dx"] + secs["dw"])
    return {"infer": fwd, "train": fwd + bwd}


def optimizer(model: torch.nn.Module, lib: str, kind: str) -> torch.optim.Optimizer:
    """AdamW for `lib`'s model: as its training script builds it (kind "own") or PyTorch's plain
    default for both ("plain")."""
    if kind == "plain":
        return torch.optim.AdamW(model.parameters(), lr=1e-4)
    if lib == "vitlab":
        return build_optimizer(model, OptimConfig(name="adamw", lr=1e-4))
    from timm.optim import create_optimizer_v2

    return create_optimizer_v2(model, "adamw", lr=1e-4, weight_decay=0.05)


def step_fns(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool, opt):
    """(inference call, training step) for model on batch (x, y), stepping `opt`."""
    ctx = (lambda: torch.autocast(x.device.type, torch.bfloat16)) if bf16 else nullcontext

    def infer() -> None:
        model.eval()
        with torch.inference_mode(), ctx():
            model(x)

    def train() -> None:
        model.train()
        with ctx():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return infer, train


def threaded_step_fns(model, x, y, bf16: bool, opt, n: int):
    """step_fns' pair as train.batch_threads=n trains and --batch-threads n infers."""
    infer, _ = step_fns(BatchParts(model, n), x, y, bf16, opt)
    threads = BatchThreads(model, n)
    ctx = (lambda: torch.autocast(x.device.type, torch.bfloat16)) if bf16 else nullcontext

    def train() -> None:
        model.train()
        opt.zero_grad(set_to_none=True)
        threads.forward_backward(classification(), x, y, ctx, 1, seed=0)
        threads.add_gradients()
        opt.step()

    return infer, train


def without_kernel(fns):
    """step_fns' pair without vitlab's CPU kernels (PyTorch's attention, LayerNorm, GELU)."""

    def wrap(fn):
        def call() -> None:
            with use_kernel(False):
                fn()

        return call

    return tuple(wrap(fn) for fn in fns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        nargs="*",
        help="names or aliases, each optionally NAME:field=value,... (default: a standard set)",
    )
    parser.add_argument("--batch", type=int, help="batch size for every model")
    parser.add_argument("--steps", type=int, default=5, help="timed calls per measurement")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--optimizer",
        choices=("own", "plain"),
        default="own",
        help="own: each library's AdamW as its training script builds it (default); plain: "
        "torch.optim.AdamW for both",
    )
    parser.add_argument(
        "--channels-last",
        action="store_true",
        help="also time vitlab's model with train.channels_last (weights and images NHWC), "
        "interleaved with the other two: vitlab_cl_* columns and cl_gain (over vitlab's default)",
    )
    parser.add_argument(
        "--batch-threads",
        type=positive_int,
        default=1,
        help="N > 1: also time vitlab's model with train.batch_threads=N (training) and "
        "--batch-threads N (inference), interleaved: vitlab_bt_* columns and bt_gain (over "
        "vitlab's default)",
    )
    parser.add_argument(
        "--sdpa",
        action="store_true",
        help="also time vitlab's model without its CPU kernels (cpu_kernels.use_kernel(False): "
        "PyTorch's attention, LayerNorm and GELU), interleaved: vitlab_sdpa_* columns and "
        "kernel_gain",
    )
    parser.add_argument(
        "--packed",
        action="store_true",
        help="also time vitlab's inference as vitlab eval / predict run it (linear weights "
        "packed once for oneDNN), interleaved: vitlab_packed_infer_* columns, "
        "infer_packed_gain and infer_packed_ratio",
    )
    parser.add_argument(
        "--all-rows",
        action="store_true",
        help="also time vitlab's ViT computing every token's row in its last block, as timm's "
        "does (a no-op forward hook on the block turns forward()'s class-token rows off), "
        "interleaved: vitlab_rows_* columns and head_only_gain",
    )
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="also time vitlab's matrix products alone (each linear layer's shape on its own, "
        "operands in cache: an estimate): matmul_*_ms columns and *_ceiling, timm's time over "
        "them: about the ratio vitlab would reach were everything else free (fp32)",
    )
    parser.add_argument(
        "--infer-only", action="store_true", help="time inference only (no training step)"
    )
    parser.add_argument(
        "--isa",
        choices=("native", "avx2"),
        default="native",
        help="avx2: hold PyTorch, oneDNN and MKL to AVX2 (an AVX2-only CPU's fp32 path)",
    )
    args = parser.parse_args()
    hold_to(args.isa)
    native = args.isa == "native"
    batches = dict(DEFAULT)  # a model of the default set keeps its batch
    runs = [(m, batches.get(m, 16)) for m in args.models] if args.models else DEFAULT
    if args.batch:
        runs = [(m, args.batch) for m, _ in runs]
    torch.manual_seed(0)
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_flags()}, "
          f"kernels {isa}, optimizer {args.optimizer}")  # fmt: skip
    precisions = (False, True) if native and cpu_has_bf16() else (False,)
    peaks = {bf16: matmul_peak(torch.bfloat16 if bf16 else torch.float32) for bf16 in precisions}
    print(json.dumps({"matmul_2048_gflop_s": {("bf16" if k else "fp32"): round(v / 1e9, 1)
                                              for k, v in peaks.items()}}))  # fmt: skip
    results = [{"cpu": cpu_flags(), "kernels": isa, "optimizer": args.optimizer,
                "threads": torch.get_num_threads(),
                "matmul_2048_gflop_s": {("bf16" if k else "fp32"): round(v / 1e9, 1)
                                        for k, v in peaks.items()}}]  # fmt: skip
    for name, batch in runs:
        base, overrides = parse_model(name)
        ours = vitlab.create_model(base, **overrides)
        randomize_heads(ours)
        theirs = timm_twin(ours)
        cfg = ours.config
        x = torch.randn(batch, cfg.in_chans, *cfg.img_hw)
        y = torch.randint(0, cfg.num_classes, (batch,))
        with torch.inference_mode():  # the same function, or the comparison means nothing
            diff = (ours.eval()(x[:2]) - theirs.eval()(x[:2])).abs().max().item()
        if diff > 1e-3:
            raise SystemExit(f"{name}: vitlab's and timm's logits differ by {diff:.2e}")
        by_precision = {}
        flops = {"infer": forward_flops(ours, x)}
        flops["train"] = 3 * flops["infer"]
        pair = [("vitlab", ours), ("timm", theirs)]
        if args.channels_last:  # the same weights and AdamW, in NHWC memory
            nhwc = copy.deepcopy(ours).to(memory_format=torch.channels_last)
            pair.append(("vitlab_cl", nhwc))
        if args.batch_threads > 1:  # the same weights and AdamW, each batch on N threads
            like = dict(pair)["vitlab_cl" if args.channels_last else "vitlab"]
            pair.append(("vitlab_bt", copy.deepcopy(like)))
        if args.sdpa:  # the same weights and AdamW, PyTorch's attention kernel
            pair.append(("vitlab_sdpa", copy.deepcopy(ours)))
        if args.all_rows and family_of(cfg) == "vit":  # the same weights, every row computed
            rows = copy.deepcopy(ours)
            rows.blocks[-1].register_forward_hook(lambda *_: None)
            pair.append(("vitlab_rows", rows))
        if args.packed:  # the same weights, packed: inference only
            packed = pack_linear(ours)
            if packed is ours:
                print(f"{name}: no linear layer of {PACK_BYTES:,} bytes or more: nothing packed")
            else:
                pair.append(("vitlab_packed", packed))
        opts = {lib: None if args.infer_only or lib == "vitlab_packed"  # no training step
                else optimizer(m, "timm" if lib == "timm" else "vitlab", args.optimizer)
                for lib, m in pair}  # fmt: skip
        nhwc_inputs = {"vitlab_cl", "vitlab_bt"} if args.channels_last else set()
        inputs = {lib: x.contiguous(memory_format=torch.channels_last) if lib in nhwc_inputs
                  else x for lib, _ in pair}  # fmt: skip
        for bf16 in precisions:
            row = {"model": name, "batch": batch, "precision": "bf16" if bf16 else "fp32",
                   "fp32_max_abs_logit_diff": float(f"{diff:.1e}"),
                   "train_gflop_per_step": round(flops["train"] / 1e9, 3)}  # fmt: skip
            fns = {
                lib: threaded_step_fns(m, inputs[lib], y, bf16, opts[lib], args.batch_threads)
                if lib == "vitlab_bt"
                else step_fns(m, inputs[lib], y, bf16, opts[lib])
                for lib, m in pair
            }
            if "vitlab_sdpa" in fns:
                fns["vitlab_sdpa"] = without_kernel(fns["vitlab_sdpa"])
            if bf16 and not args.infer_only:  # vitlab's default path against timm's eager fp32,
                fns["timm_fp32"] = step_fns(theirs, x, y, False, opts["timm"])  # interleaved
            for i, kind in enumerate(("infer",) if args.infer_only else ("infer", "train")):
                timed = {  # packed: fp32 inference only; timm's fp32 beside bf16: training
                    lib: f[i]
                    for lib, f in fns.items()
                    if lib != "vitlab_packed" or (kind == "infer" and not bf16)
                    if lib != "timm_fp32" or kind == "train"
                }  # fp32 beside bf16: training
                secs = median_seconds(timed, args.steps)
                for lib, s in secs.items():
                    row[f"{lib}_{kind}_img_s"] = round(batch / s, 1)
                    peak = peaks[bf16 and lib != "timm_fp32"]
                    row[f"{lib}_{kind}_mfu"] = round(flops[kind] / s / peak, 3)
                row[f"{kind}_ratio"] = round(secs["timm"] / secs["vitlab"], 3)
                if "vitlab_packed" in secs:
                    row["infer_packed_gain"] = round(secs["vitlab"] / secs["vitlab_packed"], 3)
                    row["infer_packed_ratio"] = round(secs["timm"] / secs["vitlab_packed"], 3)
                for other in ("cl", "bt"):
                    if f"vitlab_{other}" in secs:
                        gain = secs["vitlab"] / secs[f"vitlab_{other}"]
                        row[f"{kind}_{other}_gain"] = round(gain, 3)
                for other, gain in (("sdpa", "kernel_gain"), ("rows", "head_only_gain")):
                    if f"vitlab_{other}" in secs:
                        row[f"{kind}_{gain}"] = round(secs[f"vitlab_{other}"] / secs["vitlab"], 3)
            if args.ceiling and not bf16:
                alone = products_seconds(matrix_products(ours, x), args.steps)
                for kind, secs_alone in alone.items():
                    if f"timm_{kind}_img_s" in row:
                        row[f"matmul_{kind}_ms"] = round(secs_alone * 1e3, 2)
                        timm_secs = batch / row[f"timm_{kind}_img_s"]
                        row[f"{kind}_ceiling"] = round(timm_secs / secs_alone, 3)
            results.append(row)
            by_precision[row["precision"]] = row
            print(json.dumps(row), flush=True)
        if args.infer_only:
            continue
        # vitlab's default path (train.precision=auto) against timm's eager fp32
        default = "bf16" if native and use_bf16("auto", x.device) else "fp32"
        timm_fp32 = "timm_fp32" if default == "bf16" else "timm"  # timed in the same pass
        summary = {
            "model": name,
            "default_precision": default,
            "default_train_vs_timm_fp32": round(
                by_precision[default]["vitlab_train_img_s"]
                / by_precision[default][f"{timm_fp32}_train_img_s"],
                2,
            ),
        }
        results.append(summary)
        print(json.dumps(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
