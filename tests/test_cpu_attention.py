"""vitlab's CPU attention kernel (models/cpu_attention.py): its outputs and gradients against the
formula computed in float64, the same result on any number of threads, the model's attention on it
and off it, and the cases it leaves to F.scaled_dot_product_attention."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import vitlab
from tests.helpers import count_calls, fresh_kernel_cache, run_together, tiny_config
from vitlab.models import cpu_attention, cpu_kernels
from vitlab.models.vit import VisionTransformer

needs_kernel = pytest.mark.skipif(
    cpu_kernels.library() is None, reason="no AVX2 CPU or no C compiler here"
)


def formula(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per head, written out: (B, T, 3D) -> (B, T, D)."""
    b, t, width = qkv.shape
    d = width // (3 * heads)
    q, k, v = qkv.reshape(b, t, 3, heads, d).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
    probs = (q @ k.transpose(-1, -2) / d**0.5).softmax(-1)
    return (probs @ v).transpose(1, 2).reshape(b, t, width // 3)


@needs_kernel
@pytest.mark.parametrize(
    ("b", "t", "heads", "d", "spread"),
    [
        (3, 50, 4, 16, 2.0),  # nano's attention
        (2, 50, 2, 32, 2.0),  # micro's
        (2, 17, 3, 24, 2.0),  # token counts off the vector width, each tile shape of the scores
        (2, 12, 2, 16, 2.0),
        (1, 48, 2, 8, 2.0),
        (2, 65, 1, 64, 2.0),
        (1, 1, 2, 8, 2.0),  # one token
        (1, 128, 1, 8, 2.0),  # the longest sequence
        (2, 50, 2, 16, 30.0),  # logits ~1000: most of each softmax underflows to 0 (and float32
        # rounds the logits themselves by ~1e-4, so the tolerance grows with spread ** 3)
    ],
)
def test_outputs_and_gradients_match_the_formula_in_float64(b, t, heads, d, spread) -> None:
    """The forward and the whole qkv gradient (q, k and v) against float64, within float32
    rounding of the formula."""
    torch.manual_seed(0)
    qkv = (torch.randn(b, t, 3 * heads * d) * spread).requires_grad_()
    assert cpu_attention.applies(qkv, heads)
    out = cpu_attention.attention(qkv, heads, d**-0.5)
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, grad_out)
    exact = qkv.detach().double().requires_grad_()
    expected = formula(exact, heads)
    (expected_grad,) = torch.autograd.grad(expected, exact, grad_out.double())
    tol = 5e-6 * spread**3
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(grad.double(), expected_grad, atol=tol, rtol=tol)
    assert t == 1 or expected_grad[..., : heads * d].abs().max() > 0.1  # q gets a gradient


@needs_kernel
@pytest.mark.parametrize(("b", "t", "heads", "d"), [(3, 50, 4, 16), (2, 17, 3, 24), (1, 1, 2, 8)])
def test_a_bias_added_as_q_k_and_v_are_read_is_the_formula_of_qkv_plus_bias(b, t, heads, d) -> None:
    """attention(qkv, bias) (how the model runs its qkv projection without the bias) against
    the formula of qkv + bias in float64: the output, qkv's gradient and bias's, summed over the
    batch and tokens; k's bias moves no softmax, so its gradient is zero in both."""
    torch.manual_seed(1)
    qkv = (torch.randn(b, t, 3 * heads * d) * 2).requires_grad_()
    bias = (torch.randn(3 * heads * d) * 2).requires_grad_()
    out = cpu_attention.attention(qkv, heads, d**-0.5, bias)
    grad_out = torch.randn_like(out)
    grad, grad_bias = torch.autograd.grad(out, (qkv, bias), grad_out)
    exact, exact_bias = (v.detach().double().requires_grad_() for v in (qkv, bias))
    expected = formula(exact + exact_bias, heads)
    expected_grads = torch.autograd.grad(expected, (exact, exact_bias), grad_out.double())
    torch.testing.assert_close(out.double(), expected, atol=4e-5, rtol=4e-5)
    torch.testing.assert_close(grad.double(), expected_grads[0], atol=4e-5, rtol=4e-5)
    torch.testing.assert_close(grad_bias.double(), expected_grads[1], atol=2e-4, rtol=4e-5)
    width = heads * d
    assert t == 1 or expected_grads[1][:width].abs().max() > 0.1  # q's bias gets a gradient
    assert grad_bias[width : 2 * width].abs().max() < 1e-4  # k's: zero, up to float32 rounding
    with torch.no_grad():
        assert torch.equal(cpu_attention.attention(qkv, heads, d**-0.5, bias), out.detach())
    bias_only = cpu_attention.attention(qkv.detach(), heads, d**-0.5, bias)  # qkv needs no grad
    (only,) = torch.autograd.grad(bias_only, bias, grad_out)
    assert torch.equal(only, grad_bias)


@needs_kernel
def test_an_empty_batch_and_fewer_pairs_than_threads() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        qkv = torch.randn(1, 7, 3 * 8, requires_grad=True)  # one (batch, head) pair
        out = cpu_attention.attention(qkv, 1, 8**-0.5)
        torch.testing.assert_close(out, formula(qkv, 1), atol=1e-6, rtol=1e-5)
        out.sum().backward()
        empty = cpu_attention.attention(torch.randn(0, 7, 3 * 8, requires_grad=True), 1, 0.5)
        assert empty.shape == (0, 7, 8)
    finally:
        torch.set_num_threads(before)


def test_attention_says_what_it_cannot_take() -> None:
    cases = [
        (torch.randn(2, 5, 3 * 20), 1, "multiple of 8, got 20"),
        (torch.randn(2, 5, 3 * 16).double(), 1, "float32 on the CPU, got torch.float64"),
        (torch.randn(2, 5, 50), 2, r"expected \(B, T, 3 x 2 heads x d\), got \(2, 5, 50\)"),
    ]
    for qkv, heads, message in cases:
        with pytest.raises(ValueError, match=message):
            cpu_attention.attention(qkv, heads, 0.25)
    qkv = torch.randn(2, 5, 3 * 16)
    for bias in (torch.randn(3 * 8), torch.randn(3 * 16).double(), torch.randn(48, device="meta")):
        with pytest.raises(ValueError, match=r"bias must be float32 of shape \(48,\) on the CPU"):
            cpu_attention.attention(qkv, 1, 0.25, bias)


@needs_kernel
def test_same_bits_on_one_and_two_threads_and_without_gradients() -> None:
    before = torch.get_num_threads()
    torch.manual_seed(1)
    qkv = torch.randn(5, 50, 3 * 64, requires_grad=True)
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = cpu_attention.attention(qkv, 4, 0.25)
            (grad,) = torch.autograd.grad(out, qkv, torch.ones_like(out))
            with torch.inference_mode():
                plain = cpu_attention.attention(qkv.detach(), 4, 0.25)
            results.append((out, grad, plain))
    finally:
        torch.set_num_threads(before)
    (out1, grad1, plain1), (out2, grad2, plain2) = results
    assert torch.equal(out1, out2) and torch.equal(grad1, grad2)
    assert torch.equal(out1, plain1) and torch.equal(plain1, plain2)


@needs_kernel
def test_a_nan_in_q_k_or_v_reaches_the_outputs_the_formula_says() -> None:
    """A NaN key enters every row's softmax, a NaN query its own row, a NaN value one channel of
    every row: the kernel's NaNs are the formula's, so a non-finite loss is never hidden from the
    trainer's check (PyTorch's fused CPU kernel drops a NaN query's row: no NaN at all)."""
    for part in range(3):  # q, k, v
        qkv = torch.randn(2, 10, 3 * 16)
        qkv[1, 4, part * 16 + 3] = float("nan")
        out, expected = cpu_attention.attention(qkv, 2, 0.25), formula(qkv.double(), 2)
        assert torch.equal(out.isnan(), expected.isnan()) and out[1].isnan().any(), part
        assert not out[0].isnan().any()


@needs_kernel
def test_keeps_the_softmax_only_for_a_backward(monkeypatch) -> None:
    kept = []
    real = cpu_attention._forward
    monkeypatch.setattr(
        cpu_attention, "_forward", lambda *a, keep: kept.append(keep) or real(*a, keep=keep)
    )
    qkv = torch.randn(1, 9, 3 * 16, requires_grad=True)
    with torch.no_grad():
        cpu_attention.attention(qkv, 2, 0.25)
    cpu_attention.attention(qkv.detach(), 2, 0.25)
    cpu_attention.attention(qkv, 2, 0.25)
    assert kept == [False, False, True]


@needs_kernel
def test_once_differentiable() -> None:
    qkv = torch.randn(1, 9, 3 * 16, requires_grad=True)
    loss = cpu_attention.attention(qkv, 2, 0.25).square().sum()  # its gradient needs qkv
    (grad,) = torch.autograd.grad(loss, qkv, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


@needs_kernel
def test_the_model_trains_the_same_on_the_kernel_and_off_it(monkeypatch) -> None:
    """nano's forward and every parameter's gradient, attention on the kernel and through
    F.scaled_dot_product_attention (use_kernel(False))."""
    torch.manual_seed(0)
    model = vitlab.create_model("vit_nano_patch4_28", num_classes=10, in_chans=1)
    torch.nn.init.normal_(model.head.weight, std=0.1)
    images, labels = torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,))
    runs, calls = [], count_calls(monkeypatch, cpu_attention, "attention")
    for enabled in (True, False):
        with cpu_attention.use_kernel(enabled):
            model.zero_grad()
            logits = model(images)
            torch.nn.functional.cross_entropy(logits, labels).backward()
            runs.append((logits, {n: p.grad.clone() for n, p in model.named_parameters()}))
    # the first pass only; forward()'s last block computes the class token's row alone (PyTorch's)
    assert len(calls) == len(model.blocks) - 1
    (logits, grads), (ref_logits, ref_grads) = runs
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@needs_kernel
def test_the_kernels_add_qkv_and_fc1_biases_unless_a_hook_watches(monkeypatch) -> None:
    """The model runs qkv and fc1 without their biases, which the attention and GELU kernels
    add as they read (one pass over each fresh output fewer), in training and inference; a hook
    on qkv or fc1 sees the output with its bias, as in PyTorch, and that layer keeps its bias
    (the first two tests above and test_cpu_kernels check the gradients and logits)."""
    biases: list[tuple[str, bool]] = []
    for owner, name in ((cpu_attention, "attention"), (cpu_kernels, "gelu_")):
        real = getattr(owner, name)

        def spy(x, *args, real=real, name=name):
            bias = args[2:3] if name == "attention" else args[:1]  # the bias, where given
            biases.append((name, bias not in ((), (None,))))
            return real(x, *args)

        monkeypatch.setattr(owner, name, spy)
    torch.manual_seed(0)
    model = VisionTransformer(tiny_config(embed_dim=32, num_heads=2, depth=3))
    images = torch.randn(2, 3, 16, 16)

    def run(train: bool) -> list[tuple[str, bool]]:
        biases.clear()
        out = model.train(train)(images)
        if train:
            out.sum().backward()
        return sorted(biases)

    # forward()'s last block computes the class token's row alone (PyTorch's attention)
    folded = [("attention", True)] * 2 + [("gelu_", True)] * 3
    assert run(train=True) == folded
    with torch.no_grad():
        assert run(train=False) == folded
    qkv, fc1 = model.blocks[0].attn.qkv, model.blocks[0].mlp.fc1
    seen = []
    handles = [
        m.register_forward_hook(lambda m, i, o: seen.append((m, i[0], o))) for m in (qkv, fc1)
    ]
    hooked = [("attention", False), ("attention", True), ("gelu_", True), ("gelu_", True)]
    assert run(train=True) == hooked  # block 0's GELU: PyTorch's (fc1's output is watched)
    for handle in handles:
        handle.remove()
    for module, given, output in seen:  # the biased outputs, as nn.Linear gives them
        torch.testing.assert_close(
            output, torch.nn.functional.linear(given, module.weight, module.bias)
        )
    no_bias = VisionTransformer(tiny_config(embed_dim=32, num_heads=2, qkv_bias=False))
    biases.clear()
    no_bias(images)
    assert ("attention", False) in biases and ("attention", True) not in biases


@needs_kernel
def test_inference_on_the_kernel_matches_pytorch_and_the_formula(monkeypatch) -> None:
    """nano's eval logits under no_grad on the kernel and through PyTorch's attention, and one
    layer's attention at MAX_TOKENS (the longest the kernel takes) against float64."""
    torch.manual_seed(0)
    model = vitlab.create_model("vit_nano_patch4_28", num_classes=10, in_chans=1).eval()
    torch.nn.init.normal_(model.head.weight, std=0.1)
    images = torch.randn(8, 1, 28, 28)
    calls = count_calls(monkeypatch, cpu_attention, "attention")
    with torch.no_grad():
        logits = model(images)
        with cpu_attention.use_kernel(False):
            reference = model(images)
        assert len(calls) == len(model.blocks) - 1  # not the last block's class-token row
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
        qkv = torch.randn(3, cpu_attention.MAX_TOKENS, 3 * 4 * 16) * 2
        out = cpu_attention.attention(qkv, 4, 16**-0.5)
    torch.testing.assert_close(out.double(), formula(qkv.double(), 4), atol=2e-5, rtol=1e-5)


@needs_kernel
def test_what_the_kernel_leaves_to_pytorch(monkeypatch) -> None:
    qkv = torch.randn(2, 50, 3 * 64, requires_grad=True)
    assert cpu_attention.applies(qkv, 4) and cpu_attention.applies(qkv, 8)  # d = 16, 8
    assert cpu_attention.applies(qkv.detach(), 4)  # inference too
    with torch.no_grad():
        assert cpu_attention.applies(qkv, 4)
        inferred = torch.randn(1, cpu_attention.MAX_TOKENS, 48)
        assert cpu_attention.applies(inferred, 1)
        assert not cpu_attention.applies(torch.cat([inferred, inferred[:, :1]], 1), 1)
    assert not cpu_attention.applies(torch.randn(2, 50, 3 * 60, requires_grad=True), 3)  # d = 20
    longest = torch.randn(1, cpu_attention.MAX_TOKENS, 48, requires_grad=True)
    assert cpu_attention.applies(longest, 1)
    assert not cpu_attention.applies(torch.cat([longest, longest[:, :1]], 1), 1)
    assert not cpu_attention.applies(qkv.double(), 4)
    assert not cpu_attention.applies(qkv.bfloat16(), 4)
    with cpu_attention.use_kernel(False):
        assert not cpu_attention.applies(qkv, 4)
    assert cpu_attention.applies(qkv, 4)

    calls = count_calls(monkeypatch, cpu_attention, "attention")

    def kernel_calls(train: bool = False, **overrides: object) -> int:
        torch.manual_seed(0)
        model = VisionTransformer(tiny_config(embed_dim=32, num_heads=2, **overrides))
        calls.clear()
        model.train(train)(torch.randn(2, 3, 16, 16))
        return len(calls)

    depth = tiny_config().depth - 1  # forward()'s last block: the class token's row alone
    assert kernel_calls(train=True) == depth
    assert kernel_calls(attn_dropout=0.1) == depth  # no dropout in eval
    assert kernel_calls(train=True, attn_dropout=0.1) == 0
    assert kernel_calls(pos_embed="relative") == 0
    with torch.autocast("cpu", torch.bfloat16):
        assert kernel_calls() == 0
    with torch.no_grad():  # inference (5 tokens)
        assert kernel_calls() == depth
    model = VisionTransformer(tiny_config(embed_dim=32, num_heads=2)).eval()
    images = torch.randn(2, 3, 16, 16)
    calls.clear()
    torch.func.vmap(model)(images[:, None])  # torch.func's batched tensors
    assert not calls
    with torch.autograd.forward_ad.dual_level():  # (PyTorch's kernel has no forward AD on CPU)
        assert not cpu_attention.applies(torch.autograd.forward_ad.make_dual(qkv, qkv), 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's own warnings
        traced = torch.jit.trace(model, torch.randn(1, 3, 16, 16), check_trace=False)
    assert not calls and "scaled_dot_product_attention" in str(traced.inlined_graph)


def test_a_failed_build_falls_back_with_a_warning(tmp_path) -> None:
    """No compiler: a warning naming the cause, then PyTorch's attention (the model still runs);
    VITLAB_CPU_KERNELS=0 turns the kernel off."""
    script = (
        "import warnings, torch, vitlab\n"
        "from vitlab.models import cpu_attention\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    qkv = torch.randn(2, 50, 3 * 64, requires_grad=True)\n"
        "    print(cpu_attention.applies(qkv, 4))\n"
        "    print(vitlab.create_model('vit_nano_patch4_28', in_chans=1)"
        "(torch.randn(1, 1, 28, 28)).shape[0])\n"
        "print([str(x.message) for x in w])\n"
    )

    cases = {"no_cc": {"CC": "/nonexistent/cc"}, "off": {"VITLAB_CPU_KERNELS": "0"}}
    if cpu_kernels.library() is not None:
        cases["built"] = {}
    jobs = [  # at once, each with a cache of its own
        ([sys.executable, "-c", script], fresh_kernel_cache(tmp_path / name, **extra))
        for name, extra in cases.items()
    ]
    runs = dict(zip(cases, run_together(*jobs)))
    for name, run in runs.items():
        assert run.returncode == 0, f"{name}: {run.stderr}"
    applies, batch, messages = runs["no_cc"].stdout.splitlines()
    assert (applies, batch) == ("False", "1")
    assert "could not be built" in messages and "/nonexistent/cc" in messages
    applies, _, messages = runs["off"].stdout.splitlines()
    assert applies == "False" and "could not be built" not in messages
    if "built" in runs:
        applies, _, messages = runs["built"].stdout.splitlines()
        assert applies == "True" and "could not be built" not in messages
        assert list((tmp_path / "built" / "vitlab" / "kernels").glob("kernels-*.so"))
