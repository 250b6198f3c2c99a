"""Full-size checkpoint parity and cost: ViT-B/16 at 224 with random weights, written by each
reference library the way it saves (timm safetensors, transformers save_pretrained, torchvision
state dict, a Google-named .npz loaded by timm's own npz reader), then loaded by vitlab: seconds to
load and the max abs difference of the logits against the reference model. Then ONNX: export time
and onnxruntime inference against PyTorch eager on the same batch.

    python benchmarks/checkpoint_formats.py [--batch 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import vitlab
from vitlab.models.checkpoint import load_checkpoint


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.02
            scale = p.ndim == 1 and ("norm" in name or "ln" in name) and "weight" in name
            p.copy_(noise + 1.0 if scale else noise)
    return model.eval()


def timed_load(source: Path, **kw) -> tuple[torch.nn.Module, float]:
    t = time.perf_counter()
    model = vitlab.load_pretrained(source, **kw)
    return model, time.perf_counter() - t


def google_npz(ref: torch.nn.Module, path: Path) -> None:
    """Write timm model `ref`'s weights in Google's released .npz naming (the layout timm reads)."""
    d = ref.embed_dim
    heads = ref.blocks[0].attn.num_heads
    a = {
        "embedding/kernel": ref.patch_embed.proj.weight.permute(2, 3, 1, 0),
        "embedding/bias": ref.patch_embed.proj.bias,
        "cls": ref.cls_token,
        "Transformer/posembed_input/pos_embedding": ref.pos_embed,
        "Transformer/encoder_norm/scale": ref.norm.weight,
        "Transformer/encoder_norm/bias": ref.norm.bias,
        "head/kernel": ref.head.weight.t(),
        "head/bias": ref.head.bias,
    }
    for i, blk in enumerate(ref.blocks):
        b = f"Transformer/encoderblock_{i}/"
        a[b + "LayerNorm_0/scale"], a[b + "LayerNorm_0/bias"] = blk.norm1.weight, blk.norm1.bias
        a[b + "LayerNorm_2/scale"], a[b + "LayerNorm_2/bias"] = blk.norm2.weight, blk.norm2.bias
        for n, w, bias in zip(
            ("query", "key", "value"), blk.attn.qkv.weight.chunk(3), blk.attn.qkv.bias.chunk(3)
        ):
            a[b + f"MultiHeadDotProductAttention_1/{n}/kernel"] = w.t().reshape(d, heads, -1)
            a[b + f"MultiHeadDotProductAttention_1/{n}/bias"] = bias.reshape(heads, -1)
        a[b + "MultiHeadDotProductAttention_1/out/kernel"] = blk.attn.proj.weight.t().reshape(
            heads, -1, d
        )
        a[b + "MultiHeadDotProductAttention_1/out/bias"] = blk.attn.proj.bias
        for r, fc in enumerate((blk.mlp.fc1, blk.mlp.fc2)):
            a[b + f"MlpBlock_3/Dense_{r}/kernel"] = fc.weight.t()
            a[b + f"MlpBlock_3/Dense_{r}/bias"] = fc.bias
    np.savez(path, **{k: v.detach().numpy() for k, v in a.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import timm
    import transformers
    from timm.models.vision_transformer import _load_weights
    from torchvision.models import vit_b_16

    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, 224, 224)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        tmp = Path(tmp)

        def record(fmt: str, ref_logits: torch.Tensor, source: Path, **kw) -> None:
            model, seconds = timed_load(source, **kw)
            diff = (model(x) - ref_logits).abs().max().item()
            size = sum(
                f.stat().st_size for f in ([source] if source.is_file() else source.iterdir())
            )
            rows.append({"format": fmt, "load_s": seconds, "max_abs_diff": diff, "bytes": size})

        ref = randomize(timm.create_model("vit_base_patch16_224"))
        from safetensors.torch import save_file

        save_file(ref.state_dict(), tmp / "timm.safetensors")
        record("timm .safetensors", ref(x), tmp / "timm.safetensors")

        google_npz(ref, tmp / "google.npz")
        npz_ref = timm.create_model("vit_base_patch16_224", act_layer="gelu_tanh").eval()
        _load_weights(npz_ref, str(tmp / "google.npz"))
        record("Google .npz (timm's reader as reference)", npz_ref(x), tmp / "google.npz")
        del npz_ref

        hf = randomize(
            transformers.ViTForImageClassification(transformers.ViTConfig(num_labels=1000))
        )
        hf.save_pretrained(tmp / "hf")
        record("HF save_pretrained", hf(pixel_values=x).logits, tmp / "hf")
        del hf

        tv = randomize(vit_b_16())
        torch.save(tv.state_dict(), tmp / "tv.pth")
        record("torchvision vit_b_16 .pth", tv(x), tmp / "tv.pth")
        del tv

        model, meta = load_checkpoint(tmp / "timm.safetensors")
        from vitlab.models.export import export_onnx

        t = time.perf_counter()
        check = export_onnx(model, meta, tmp / "b16.onnx", dynamic_batch=True)
        export_s = time.perf_counter() - t
        import onnxruntime as ort

        session = ort.InferenceSession(str(tmp / "b16.onnx"), providers=["CPUExecutionProvider"])

        def per_image(fn, reps: int = 3) -> float:
            fn()
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return sorted(times)[len(times) // 2] / args.batch

        ort_s = per_image(lambda: session.run(None, {"images": x.numpy()}))
        torch_s = per_image(lambda: model(x))
        onnx_row = {
            "export_s": export_s,
            "max_abs_diff": check["max_abs_diff"],
            "onnxruntime_img_s": 1 / ort_s,
            "pytorch_img_s": 1 / torch_s,
            "ratio": torch_s / ort_s,
        }
    result = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "timm": timm.__version__,
        "transformers": transformers.__version__,
        "batch": args.batch,
        "loads": rows,
        "onnx": onnx_row,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"ViT-B/16 at 224, random weights, batch {args.batch}; {result['machine']}")
    print(f"{'source':<42} {'MB':>6} {'load s':>7} {'max |diff|':>11}")
    for r in rows:
        mb = r["bytes"] / 2**20
        print(f"{r['format']:<42} {mb:6.0f} {r['load_s']:7.2f} {r['max_abs_diff']:11.2e}")
    o = onnx_row
    print(
        f"ONNX export {o['export_s']:.1f} s, onnxruntime vs PyTorch max |diff| "
        f"{o['max_abs_diff']:.2e}; "
        f"inference {o['onnxruntime_img_s']:.1f} vs {o['pytorch_img_s']:.1f} img/s "
        f"(onnxruntime / PyTorch {o['ratio']:.2f}x)"
    )


if __name__ == "__main__":
    main()
