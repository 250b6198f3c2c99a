"""vitlab's LayerNorm and GELU kernels for CPU inference (models/cpu_kernels.py): against the
formulas in float64, the same bits on one and two threads, and when the model takes them."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import vitlab
from tests.helpers import count_calls, run_with_fresh_kernel_cache, tiny_config
from vitlab.models import cpu_kernels
from vitlab.models.layers import Attention, DropPath, LayerNorm
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


@pytest.mark.parametrize("n", [7, 4096, 20_001])
def test_gelu_in_training_matches_the_erf_formulas_gradient_in_float64(n) -> None:
    """With autograd: in place on a tensor that needs a gradient, whose backward multiplies by
    the derivative the forward wrote; against autograd through F.gelu in float64."""
    torch.manual_seed(n)
    a = (torch.randn(n) * 4).requires_grad_()
    grad = torch.randn(n)
    h = a * 1.0  # not a leaf
    out = cpu_kernels.gelu_(h)
    assert out is h and out.grad_fn is not None
    (da,) = torch.autograd.grad(out, a, grad)
    a64 = a.detach().double().requires_grad_()
    expected = F.gelu(a64)
    (expected_da,) = torch.autograd.grad(expected, a64, grad.double())
    torch.testing.assert_close(out.detach().double(), expected.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(da.double(), expected_da, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(37, 24), (2, 50, 256), (1, 8)])
def test_gelu_with_a_bias_is_the_erf_formula_of_x_plus_bias_in_float64(shape) -> None:
    """gelu_(x, bias) (fc1's bias added in GELU's pass): GELU(x + bias) in place, and with
    autograd the gradients of x and of bias (summed over the rows) against float64; bias alone
    needing a gradient gets the same."""
    torch.manual_seed(2)
    a = (torch.randn(shape) * 3).requires_grad_()
    bias = (torch.randn(shape[-1]) * 3).requires_grad_()
    grad = torch.randn(shape)
    h = a * 1.0
    out = cpu_kernels.gelu_(h, bias)
    assert out is h
    da, dbias = torch.autograd.grad(out, (a, bias), grad)
    a64, bias64 = (v.detach().double().requires_grad_() for v in (a, bias))
    expected = F.gelu(a64 + bias64)
    expected_da, expected_dbias = torch.autograd.grad(expected, (a64, bias64), grad.double())
    torch.testing.assert_close(out.detach().double(), expected.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(da.double(), expected_da, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(dbias.double(), expected_dbias, atol=1e-4, rtol=1e-5)
    assert expected_dbias.abs().max() > 0.1
    (only,) = torch.autograd.grad(cpu_kernels.gelu_(a.detach().clone(), bias), bias, grad)
    assert torch.equal(only, dbias)
    with torch.no_grad():
        same = a.detach().clone()
        cpu_kernels.gelu_(same, bias)
    assert torch.equal(same, out.detach())


def test_gelu_refuses_a_bias_of_another_width_or_off_whole_vectors() -> None:
    x = torch.randn(4, 16)
    for bias in (torch.randn(8), torch.randn(16).double(), torch.randn(2, 16)):
        with pytest.raises(ValueError, match="as wide as x's last dimension"):
            cpu_kernels.gelu_(x, bias)
    with pytest.raises(ValueError, match="a multiple of 8: got \\(12,\\)"):
        cpu_kernels.gelu_(torch.randn(4, 12), torch.randn(12))
    for empty in (torch.randn(4, 0), torch.tensor(1.0)):  # no row to add a bias to
        with pytest.raises(ValueError, match="as wide as x's last dimension"):
            cpu_kernels.gelu_(empty, torch.randn(0))


@pytest.mark.parametrize("with_bias", [True, False])
def test_join_is_pytorchs_linear_bias_then_the_residual_sum(with_bias) -> None:
    """join_(h, x, bias): (h + bias) + x in place on h, the same bits as PyTorch's linear with
    its bias and then the residual sum; the gradient reaches h and x as it comes and bias as
    its sum over the rows (against autograd through the sum, and float64)."""
    torch.manual_seed(3)
    a, x = (torch.randn(3, 50, 64, requires_grad=True) for _ in range(2))
    bias = torch.randn(64, requires_grad=True) if with_bias else None
    h = a * 1.0
    out = cpu_kernels.join_(h, x, bias)
    expected = (a + bias if with_bias else a) + x
    assert out is h and torch.equal(out, expected)
    grad = torch.randn_like(out)
    inputs = (a, x, bias) if with_bias else (a, x)
    grads = torch.autograd.grad(out, inputs, grad)
    expected_grads = torch.autograd.grad(expected, inputs, grad)
    assert torch.equal(grads[0], grad) and torch.equal(grads[1], grad)
    if with_bias:
        torch.testing.assert_close(grads[2].double(), grad.double().sum((0, 1)), atol=1e-4, rtol=0)
        torch.testing.assert_close(grads[2], expected_grads[2], atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        same = a.detach().clone()
        cpu_kernels.join_(same, x, bias)
    assert torch.equal(same, out.detach())


def test_join_refuses_what_it_cannot_take() -> None:
    h = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"x of its shape, got \(4, 16\) and \(4, 8\)"):
        cpu_kernels.join_(h, torch.randn(4, 8))
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_kernels.join_(torch.randn(4, 12), torch.randn(4, 12))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.join_(torch.randn(16, 4).t(), h)
    with pytest.raises(ValueError, match=r"as wide as h's rows \(16\), got \(8,\)"):
        cpu_kernels.join_(h, h, torch.randn(8))
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.join_(h, h.double())
    leaf = torch.randn(4, 16, requires_grad=True)
    before = leaf.detach().clone()
    with pytest.raises(RuntimeError, match="leaf Variable"):
        cpu_kernels.join_(leaf, h)
    assert torch.equal(leaf.detach(), before)


def test_blocks_join_their_branches_to_the_residual_stream_where_nothing_sees_it(
    monkeypatch,
) -> None:
    """Each block adds attention's and the MLP's last linear layer to the residual stream in
    one pass with that layer's bias (join_), in training and inference; not with a layer scale,
    nor in training with dropout or stochastic depth (in eval, yes), nor for a branch a hook
    watches (the attention module, its output projection). test_cpu_attention checks that the
    model's gradients are PyTorch's."""
    calls = count_calls(monkeypatch, cpu_kernels, "join_")

    def joins(
        train: bool = True,
        hook: str | None = None,
        patch: str | None = None,
        mc_dropout: bool = False,
        **overrides: object,
    ) -> int:
        torch.manual_seed(0)
        model = VisionTransformer(tiny_config(embed_dim=32, num_heads=2, depth=3, **overrides))
        if hook:
            model.get_submodule(hook).register_forward_hook(lambda *a: None)
        if patch:  # a forward of its own on the instance (as attention-map tools set)
            module = model.get_submodule(patch)
            module.forward = module.forward
        model.train(train)
        for m in model.modules() if mc_dropout else ():  # Monte Carlo dropout: eval, dropout on
            m.train(isinstance(m, torch.nn.Dropout | DropPath))
        calls.clear()
        out = model(torch.randn(2, 3, 16, 16))
        if train:
            out.sum().backward()
        return len(calls)

    both = 2 * 2  # forward()'s last block computes the class token's rows alone: not joined
    assert joins() == joins(train=False) == both
    with torch.no_grad():
        assert joins(train=False) == both
    assert joins(layer_scale=1e-5) == 0
    assert joins(dropout=0.1) == 0 and joins(train=False, dropout=0.1) == both
    # stochastic depth rises from 0 at the first block: only that one joins in training
    assert joins(drop_path=0.1) == 2 and joins(train=False, drop_path=0.1) == both
    assert joins(hook="blocks.0.attn") == joins(hook="blocks.1.attn.proj") == both - 1
    assert joins(hook="blocks.0.mlp.fc2") == joins(hook="blocks.1.drop_path2") == both - 1
    assert joins(patch="blocks.0.attn") == joins(patch="blocks.1.mlp") == both - 1
    assert joins(patch="blocks.0.attn.proj_drop") == joins(patch="blocks.1.ls2") == both - 1
    assert joins(train=False, mc_dropout=True, dropout=0.1) == 0
    with monkeypatch.context() as patched:  # a forward replaced on the class: it runs
        patched.setattr(Attention, "forward", lambda self, x, *a: (torch.zeros_like(x), None))
        assert joins() == 2
    assert joins(train=False, mc_dropout=True, drop_path=0.1) == 2  # block 0's rate is 0
    with cpu_kernels.use_kernel(False):
        assert joins() == 0


def test_gelu_in_place_on_a_tensor_autograd_saved_makes_its_backward_raise() -> None:
    """As PyTorch's in-place operators: a tensor kept for another operation's backward, changed
    in place by gelu_ with grad mode on, makes that backward raise instead of giving a wrong
    gradient."""
    w = torch.randn(8, requires_grad=True)
    h = torch.randn(8)
    y = (w * h).sum()  # autograd keeps h
    cpu_kernels.gelu_(h)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_in_place_kernels_without_grad_mode_still_make_a_saved_tensors_backward_raise() -> None:
    """gelu_ and join_ under torch.no_grad change a tensor autograd kept: its version moves, so
    that backward raises (as with PyTorch's own in-place operators) instead of a wrong gradient;
    an inference tensor has no version to move."""
    for change in (cpu_kernels.gelu_, lambda h: cpu_kernels.join_(h, torch.ones(4, 8))):
        a = torch.randn(4, 8, requires_grad=True)
        h = torch.tanh(a)  # autograd keeps its output
        with torch.no_grad():
            change(h)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            h.sum().backward()
        with torch.inference_mode():
            change(torch.randn(4, 8))


def test_gelu_keeps_nan_and_the_formulas_infinities() -> None:
    """NaN stays NaN; x / 2 (1 + erf(x / sqrt 2)) is +inf at +inf and NaN at -inf (inf x 0)."""
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), -30.0, 0.0, 30.0, 1e30, -1e30])
    out = cpu_kernels.gelu_(x.clone())
    assert out[0].isnan() and out[1] == float("inf") and out[2].isnan()
    torch.testing.assert_close(out[3:], F.gelu(x[3:]), atol=1e-6, rtol=1e-6)


def test_the_kernels_refuse_what_they_cannot_take() -> None:
    for bad in (torch.randn(16).half(), torch.randn(16).double()):
        with pytest.raises(ValueError, match="gelu_"):
            cpu_kernels.gelu_(bad)
        with pytest.raises(ValueError, match="layer_norm"):
            cpu_kernels.layer_norm(bad, torch.ones(16), torch.zeros(16), 1e-5)
    with pytest.raises(ValueError, match="layer_norm"):
        cpu_kernels.layer_norm(
            torch.randn(16, requires_grad=True), torch.ones(16), torch.zeros(16), 1e-5
        )
    leaf = torch.randn(16, requires_grad=True)
    before = leaf.detach().clone()
    with pytest.raises(RuntimeError, match="leaf Variable"):  # in place, as PyTorch's own ops
        cpu_kernels.gelu_(leaf)
    assert torch.equal(leaf.detach(), before)  # refused untouched
    with pytest.raises(ValueError, match="no gradient"):  # a weight that wants one
        cpu_kernels.layer_norm(
            torch.randn(16), torch.ones(16, requires_grad=True), torch.zeros(16), 1e-5
        )
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_kernels.layer_norm(torch.randn(2, 12), torch.ones(12), torch.zeros(12), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.gelu_(torch.randn(8, 16).t())


def test_built_with_openmp_on_pytorchs_runtime() -> None:
    """The kernels' threads are PyTorch's OpenMP team: one OpenMP runtime in the process."""
    if sys.platform != "linux" or os.environ.get("CC"):
        pytest.skip("checked with Linux's default compiler (GCC)")
    bundled = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not bundled.exists():
        pytest.skip("this PyTorch build brings no libgomp of its own")
    assert cpu_kernels.library().vitlab_openmp() == 1
    maps = Path("/proc/self/maps").read_text().splitlines()
    linked = {line.split()[-1] for line in maps if line.endswith("/libgomp.so.1")}
    assert linked == {str(bundled)}  # torch's only (other wheels' copies have other names)


def on_one_and_two_threads(compute: Callable[[], tuple]) -> list[tuple]:
    """compute()'s results on one thread, then on two, under torch.no_grad."""
    results, before = [], torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.no_grad():
                results.append(compute())
    finally:
        torch.set_num_threads(before)
    return results


def test_same_bits_on_one_and_two_threads() -> None:
    x, weight, bias = torch.randn(1002, 64), torch.randn(64), torch.randn(64)  # 501 rows each
    values = torch.randn(40_003)  # two threads' worth, and a partial vector at the end
    (norm1, gelu1), (norm2, gelu2) = on_one_and_two_threads(
        lambda: (cpu_kernels.layer_norm(x, weight, bias, 1e-6), cpu_kernels.gelu_(values.clone()))
    )
    assert torch.equal(norm1, norm2) and torch.equal(gelu1, gelu2)


def test_a_bias_is_added_by_column_where_the_second_thread_starts_mid_row() -> None:
    """gelu_ and join_ with a bias over 4,099 rows of 24 (12,297 vectors of 8: two threads' worth,
    the second starting inside a row): the formula's values, the same bits on one and two
    threads."""
    x, residual, bias = torch.randn(4099, 24), torch.randn(4099, 24), torch.randn(24)
    expected = [F.gelu(x.double() + bias.double()), (x + bias) + residual]
    results = on_one_and_two_threads(
        lambda: (cpu_kernels.gelu_(x.clone(), bias), cpu_kernels.join_(x.clone(), residual, bias))
    )
    assert all(torch.equal(one, two) for one, two in zip(*results, strict=True))
    torch.testing.assert_close(results[0][0].double(), expected[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(results[0][1], expected[1])


def test_when_the_model_takes_them(monkeypatch) -> None:
    """float32, the erf GELU (in training too), LayerNorm in inference (no_grad) only, widths a
    multiple of 8; the model's logits match PyTorch's operators."""
    calls = count_calls(monkeypatch, cpu_kernels, "layer_norm", "gelu_")

    def used(model: torch.nn.Module, images: torch.Tensor, grad: bool = False) -> list[str]:
        calls.clear()
        with torch.set_grad_enabled(grad):
            model(images)
        return sorted(set(calls))

    model = VisionTransformer(tiny_config(embed_dim=32, num_heads=2)).eval()
    images = torch.randn(2, 3, 16, 16)
    assert used(model, images) == ["gelu_", "layer_norm"]
    assert used(model, images, grad=True) == ["gelu_"]  # with autograd: LayerNorm is PyTorch's
    assert used(VisionTransformer(tiny_config(act="gelu_tanh")).eval(), images) == ["layer_norm"]
    odd = VisionTransformer(tiny_config(embed_dim=36, num_heads=2, mlp_dim=70)).eval()
    assert used(odd, images) == ["gelu_"]  # LayerNorm's width in whole vectors only
    with torch.autocast("cpu", torch.bfloat16):
        assert used(model, images) == []  # PyTorch's operators under autocast
    with cpu_kernels.use_kernel(False):
        assert used(model, images) == []
    assert isinstance(model.blocks[0].norm1, torch.nn.LayerNorm)  # state_dict keys unchanged
    seen = []  # a forward hook on the MLP's activation still sees it run, on fc1's output
    handle = model.blocks[0].mlp.act.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    assert "gelu_" in used(model, images)  # the other blocks
    handle.remove()
    assert len(seen) == 1 and seen[0].min() < 0  # GELU's input, not its output
    fc1 = model.blocks[0].mlp.fc1.register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        model(images)
    fc1.remove()
    assert seen[-1].min() < -0.2  # fc1's output left as it was (GELU's minimum is -0.17)

    nano = vitlab.create_model("vit_nano_patch4_28", num_classes=10, in_chans=1).eval()
    torch.nn.init.normal_(nano.head.weight, std=0.1)
    x = torch.randn(8, 1, 28, 28)
    with torch.inference_mode():
        logits = nano(x)
        with cpu_kernels.use_kernel(False):
            reference = nano(x)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


def test_training_through_the_gelu_kernel_gives_pytorchs_gradients(monkeypatch) -> None:
    """A training step's gradients with GELU on the kernel (in place on fc1's output) match
    PyTorch's GELU; a hook on act gets PyTorch's GELU in its block."""
    calls = count_calls(monkeypatch, cpu_kernels, "gelu_")
    torch.manual_seed(0)
    model = VisionTransformer(tiny_config(embed_dim=32, num_heads=2)).train()
    torch.nn.init.normal_(model.head.weight, std=0.1)
    images, labels = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    on = grads()
    assert len(calls) == len(model.blocks)
    calls.clear()
    with cpu_kernels.use_kernel(False):
        off = grads()
    assert not calls
    for name, grad in on.items():
        torch.testing.assert_close(grad, off[name], atol=1e-5, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for k, g in on.items() if "fc1" in k)
    seen = []
    handle = model.blocks[0].mlp.act.register_forward_hook(lambda m, i, o: seen.append(o))
    hooked = grads()
    handle.remove()
    assert len(seen) == 1 and len(calls) == len(model.blocks) - 1  # that block: PyTorch's
    torch.testing.assert_close(hooked["blocks.0.mlp.fc1.weight"], off["blocks.0.mlp.fc1.weight"])


def test_an_mlp_with_another_activation_trains_on_pytorchs_operators() -> None:
    """Swapping the MLP's activation (a ReLU: no `approximate`) leaves it to PyTorch's."""
    model = VisionTransformer(tiny_config(embed_dim=32, num_heads=2)).train()
    for block in model.blocks:
        block.mlp.act = torch.nn.ReLU()
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    mlp, tokens = model.blocks[0].mlp, torch.randn(2, 17, 32)
    torch.testing.assert_close(mlp(tokens), mlp.fc2(torch.relu(mlp.fc1(tokens))))


def test_layer_norm_without_affine_or_over_two_dimensions_runs_pytorch() -> None:
    x = torch.randn(3, 4, 16)
    with torch.no_grad():
        torch.testing.assert_close(
            LayerNorm(16, elementwise_affine=False)(x), F.layer_norm(x, (16,))
        )
        torch.testing.assert_close(LayerNorm((4, 16))(x), F.layer_norm(x, (4, 16)))


def test_layer_norm_and_the_mlp_still_trace_with_torch_fx() -> None:
    """Under symbolic tracing nothing reads a proxy's shape: the graphs record PyTorch's
    operators (torchvision's feature extraction traces this way)."""
    block = VisionTransformer(tiny_config()).eval().blocks[0]
    x = torch.randn(2, 17, 32)
    for module, op in ((block.norm1, "layer_norm"), (block.mlp, "target=act")):
        graph = torch.fx.symbolic_trace(module)
        assert op in str(graph.graph)  # PyTorch's LayerNorm; the GELU module
        with torch.no_grad():
            torch.testing.assert_close(graph(x), module(x), atol=1e-5, rtol=1e-5)


def test_a_compiler_without_openmp_builds_one_thread_kernels_with_a_warning(tmp_path) -> None:
    """A compiler that refuses -fopenmp: the kernels are built without it, under their own name
    (a later compiler with OpenMP builds the threaded library), with one warning."""
    compiler = tmp_path / "cc-no-openmp"
    compiler.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec cc "$@"\n'
    )
    compiler.chmod(0o755)
    script = (
        "import warnings, torch\n"
        "from vitlab.models import cpu_kernels\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    print(cpu_kernels.library().vitlab_openmp())\n"
        "    with torch.no_grad():\n"
        "        print(cpu_kernels.gelu_(torch.zeros(20)).abs().sum().item())\n"
        "print([str(x.message) for x in w])\n"
    )
    openmp, total, messages = run_with_fresh_kernel_cache(script, tmp_path, CC=str(compiler))
    assert (openmp, total) == ("0", "0.0") and "without OpenMP" in messages
    assert [
        p.name.endswith("-1thread.so") for p in (tmp_path / "vitlab" / "kernels").glob("*.so")
    ] == [True]
