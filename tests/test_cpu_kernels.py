"""vitlab's LayerNorm and GELU kernels for CPU inference (models/cpu_kernels.py): against the
formulas in float64, the same bits on one and two threads, and when the model takes them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitlab
from tests.helpers import tiny_config
from vitlab.models import cpu_kernels
from vitlab.models.layers import LayerNorm
from vitlab.models.vit import VisionTransformer

pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None, reason="no AVX2 CPU or no C compiler here"
)


@pytest.mark.parametrize(
    ("shape", "spread"), [((5, 64), 1.0), ((2, 50, 128), 3.0), ((7, 24), 100.0)]
)
def test_layer_norm_matches_the_formula_in_float64(shape, spread) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape) * spread + 5.0  # a mean far from 0: the centred variance matters
    weight, bias = torch.randn(shape[-1]), torch.randn(shape[-1])
    with torch.no_grad():
        out = cpu_kernels.layer_norm(x, weight, bias, 1e-6)
    expected = F.layer_norm(x.double(), shape[-1:], weight.double(), bias.double(), 1e-6)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


def test_layer_norm_reads_a_transposed_input() -> None:
    x = torch.randn(16, 3).t()  # (3, 16), not contiguous
    weight, bias = torch.ones(16), torch.zeros(16)
    with torch.no_grad():
        out = cpu_kernels.layer_norm(x, weight, bias, 1e-5)
    torch.testing.assert_close(out, F.layer_norm(x, (16,), eps=1e-5), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 7, 8, 13, 4096, 20_001])
def test_gelu_matches_the_erf_formula_in_float64_in_place(n) -> None:
    torch.manual_seed(n)
    x = torch.randn(n) * 4
    expected = F.gelu(x.double())
    same = x.clone()
    assert cpu_kernels.gelu_(same) is same  # in place
    torch.testing.assert_close(same.double(), expected, atol=1e-6, rtol=1e-6)


def test_gelu_keeps_nan_and_infinity() -> None:
    x = torch.tensor([float("nan"), float("inf"), -30.0, 0.0, 30.0, -0.5, 0.5, 1e30, -1e30])
    out = cpu_kernels.gelu_(x.clone())
    assert out[0].isnan() and out[1] == float("inf")
    torch.testing.assert_close(out[2:], F.gelu(x[2:]), atol=1e-6, rtol=1e-6)


def test_same_bits_on_one_and_two_threads() -> None:
    x, weight, bias = torch.randn(1000, 64), torch.randn(64), torch.randn(64)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.no_grad():
                results.append(
                    (cpu_kernels.layer_norm(x, weight, bias, 1e-6), cpu_kernels.gelu_(x.clone()))
                )
    finally:
        torch.set_num_threads(before)
    (norm1, gelu1), (norm2, gelu2) = results
    assert torch.equal(norm1, norm2) and torch.equal(gelu1, gelu2)


def test_when_the_model_takes_them(monkeypatch) -> None:
    """Inference (no_grad) only, float32, the erf GELU, widths a multiple of 8; the model's
    logits match PyTorch's operators."""
    calls = []
    for name in ("layer_norm", "gelu_"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(
            cpu_kernels, name, lambda *a, real=real, name=name: calls.append(name) or real(*a)
        )

    def used(model: torch.nn.Module, images: torch.Tensor, grad: bool = False) -> list[str]:
        calls.clear()
        with torch.set_grad_enabled(grad):
            model(images)
        return sorted(set(calls))

    model = VisionTransformer(tiny_config(embed_dim=32, num_heads=2)).eval()
    images = torch.randn(2, 3, 16, 16)
    assert used(model, images) == ["gelu_", "layer_norm"]
    assert used(model, images, grad=True) == []  # training or autograd: PyTorch's
    assert used(VisionTransformer(tiny_config(act="gelu_tanh")).eval(), images) == ["layer_norm"]
    odd = VisionTransformer(tiny_config(embed_dim=36, num_heads=2, mlp_dim=70)).eval()
    assert used(odd, images) == ["gelu_"]  # LayerNorm's width in whole vectors only
    with torch.autocast("cpu", torch.bfloat16):
        assert "gelu_" not in used(model, images)  # bf16 activations
    with cpu_kernels.use_kernel(False):
        assert used(model, images) == []
    assert isinstance(model.blocks[0].norm1, torch.nn.LayerNorm)  # state_dict keys unchanged

    nano = vitlab.create_model("vit_nano_patch4_28", num_classes=10, in_chans=1).eval()
    torch.nn.init.normal_(nano.head.weight, std=0.1)
    x = torch.randn(8, 1, 28, 28)
    with torch.inference_mode():
        logits = nano(x)
        with cpu_kernels.use_kernel(False):
            reference = nano(x)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


def test_layer_norm_without_affine_runs_pytorch() -> None:
    norm = LayerNorm(16, elementwise_affine=False)
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), F.layer_norm(x, (16,)))
