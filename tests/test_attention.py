"""Attention: the fused kernel against an explicit reference, attention maps, intermediates, the
whole model against timm's VisionTransformer with the same weights, and forward()'s last block
computing the class token's rows only (head_only)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import run_together, tiny_config
from vitlab.analysis.cost import matrix_products
from vitlab.formats.timm import timm_to_vitlab
from vitlab.models import chunks
from vitlab.models.layers import Attention, Block
from vitlab.models.vit import VisionTransformer, ViTConfig


def reference_attention(attn: Attention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T / sqrt(d) + bias) V, written out from the module's weights."""
    b, t, dim = x.shape
    h, d = attn.num_heads, dim // attn.num_heads
    w_q, w_k, w_v = attn.qkv.weight.chunk(3)
    b_q, b_k, b_v = attn.qkv.bias.chunk(3)

    def heads(y: torch.Tensor) -> torch.Tensor:
        return y.reshape(b, t, h, d).transpose(1, 2)  # (B, H, T, d)

    q, k, v = heads(x @ w_q.T + b_q), heads(x @ w_k.T + b_k), heads(x @ w_v.T + b_v)
    logits = q @ k.transpose(-1, -2) / d**0.5
    if attn.rel_pos is not None:
        table = attn.rel_pos.table[attn.rel_pos.index]  # (T, T, d)
        logits = logits + torch.einsum("bhid,ijd->bhij", q, table) / d**0.5
    probs = logits.softmax(-1)
    out = (probs @ v).transpose(1, 2).reshape(b, t, dim)
    return out @ attn.proj.weight.T + attn.proj.bias, probs


@pytest.mark.parametrize("pos_embed", ["learned", "relative"])
def test_fused_attention_matches_explicit_reference(pos_embed: str) -> None:
    torch.manual_seed(0)
    model = VisionTransformer(tiny_config(pos_embed=pos_embed, embed_dim=48, num_heads=3)).eval()
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.qkv.bias.normal_()
        x = torch.randn(3, 17, 48)
        fused, none = attn(x)
        explicit, probs = attn(x, return_attention=True)
        ref_out, ref_probs = reference_attention(attn, x)
    assert none is None
    torch.testing.assert_close(fused, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(explicit, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(probs, ref_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 3, 17))


@pytest.mark.parametrize("pos_embed", ["learned", "relative"])
def test_bf16_autocast_on_cpu_matches_float32_in_outputs_and_gradients(pos_embed: str) -> None:
    """Under CPU bf16 autocast (vitlab train's default where the CPU computes in bf16) attention
    takes the explicit path; its outputs and gradients agree with float32 to bf16 precision."""
    torch.manual_seed(0)
    attn = VisionTransformer(tiny_config(pos_embed=pos_embed, embed_dim=64)).blocks[0].attn
    x = torch.randn(4, 17, 64)
    grads = {}
    for precision in ("fp32", "bf16"):
        attn.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            out, _ = attn(xi)
        assert out.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        out.float().square().sum().backward()
        grads[precision] = [out.detach().float(), xi.grad, attn.qkv.weight.grad]
        if attn.rel_pos is not None:
            grads[precision].append(attn.rel_pos.table.grad)
    for ref, low in zip(grads["fp32"], grads["bf16"], strict=True):
        scale = ref.abs().max()
        assert (low - ref).abs().max() <= 0.03 * scale, (low - ref).abs().max() / scale


def test_forward_intermediates_tokens_and_attention_maps() -> None:
    torch.manual_seed(0)
    model = VisionTransformer(tiny_config(depth=4)).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        out = model.forward_intermediates(x, indices=[0, -1], return_attention=True)
        features = model.forward_features(x)
        # each block's attention recomputed from its input with the explicit reference
        tokens = model._embed(x)
        expected = []
        for blk in model.blocks:
            expected.append(reference_attention(blk.attn, blk.norm1(tokens))[1])
            tokens = blk(tokens)[0]
    assert out.indices == [0, 3]
    torch.testing.assert_close(out.features, features, atol=1e-5, rtol=0)
    assert [t.shape for t in out.tokens] == [(2, 17, 32)] * 2
    assert [a.shape for a in out.attentions] == [(2, 4, 17, 17)] * 2
    torch.testing.assert_close(out.attentions[0], expected[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.attentions[1], expected[3], atol=1e-5, rtol=0)
    torch.testing.assert_close(model.norm(out.tokens[1]), features, atol=1e-5, rtol=0)

    last2 = model.forward_intermediates(x, indices=2, norm=True)
    assert last2.indices == [2, 3] and last2.attentions is None
    torch.testing.assert_close(last2.tokens[1], features, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="out of range"):
        model.forward_intermediates(x, indices=[4])


def test_iter_intermediates_yields_one_block_at_a_time_and_stops_early() -> None:
    model = VisionTransformer(tiny_config(depth=4)).eval()
    calls = []
    for i, blk in enumerate(model.blocks):
        blk.register_forward_hook(lambda *_, i=i: calls.append(i))
    seen = [
        (i, a.shape)
        for i, _, a in model.iter_intermediates(torch.randn(1, 3, 16, 16), [0, 1], True)
    ]
    assert seen == [(0, (1, 4, 17, 17)), (1, (1, 4, 17, 17))]
    assert calls == [0, 1]  # blocks 2 and 3 never ran


def test_relative_offsets_share_embeddings() -> None:
    model = VisionTransformer(tiny_config(pos_embed="relative", img_size=(12, 16)))
    rel = model.blocks[0].attn.rel_pos
    index = rel.index  # (T, T) with one class token, grid 3x4
    assert index.shape == (13, 13)
    gw = 4

    def patch(r: int, c: int) -> int:
        return 1 + r * gw + c

    # the same offset (dy, dx) = (1, 1) anywhere in the grid uses the same embedding
    assert index[patch(1, 1), patch(0, 0)] == index[patch(2, 3), patch(1, 2)]
    assert index[patch(0, 0), patch(1, 1)] != index[patch(1, 1), patch(0, 0)]
    assert len(set(index[1:, 0].tolist())) == 1 and len(set(index[0, 1:].tolist())) == 1
    assert rel.table.shape == (5 * 7 + 3, 8)


# --- parity with timm ----------------------------------------------------------------------------


def from_timm(timm_model: torch.nn.Module, cfg: ViTConfig) -> VisionTransformer:
    """Copy a timm VisionTransformer's weights through vitlab's timm format reader."""
    model = VisionTransformer(cfg)
    model.load_state_dict(timm_to_vitlab(timm_model.state_dict()), strict=True)
    return model.eval()


@pytest.mark.parametrize(
    "pool,class_token",
    [("token", True), ("gap", False), ("gap", True)],
)
def test_same_logits_as_timm_with_the_same_weights(pool: str, class_token: bool) -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    ref = timm.models.vision_transformer.VisionTransformer(
        img_size=32,
        patch_size=8,
        embed_dim=64,
        depth=3,
        num_heads=4,
        mlp_ratio=3.0,
        num_classes=5,
        class_token=class_token,
        global_pool="token" if pool == "token" else "avg",
        fc_norm=False,
    ).eval()
    torch.nn.init.normal_(ref.head.weight)
    torch.nn.init.normal_(ref.head.bias)
    cfg = ViTConfig(
        img_size=32,
        patch_size=8,
        num_classes=5,
        embed_dim=64,
        depth=3,
        num_heads=4,
        mlp_dim=192,
        class_token=class_token,
        pool=pool,
    )
    model = from_timm(ref, cfg)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(
            model.forward_features(x), ref.forward_features(x), atol=1e-5, rtol=0
        )


# --- the last block's class-token rows (forward_features(head_only=True), what forward() runs) ---


def test_head_only_forward_trains_as_timm_does() -> None:
    """forward() computes only the class token's row in the last block; its logits and every
    parameter's gradient (training mode) match timm's model, which computes every row."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    ref = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=5
    )
    torch.nn.init.normal_(ref.head.weight)
    model = from_timm(ref, ViTConfig(img_size=32, patch_size=8, num_classes=5, embed_dim=64,
                                     depth=2, num_heads=4, mlp_dim=256))  # fmt: skip
    x, y = torch.randn(6, 3, 32, 32), torch.randint(0, 5, (6,))
    for m in (model.train(), ref.train()):
        torch.nn.functional.cross_entropy(m(x), y).backward()
    grads = timm_to_vitlab({n: p.grad for n, p in ref.named_parameters()})
    assert model.forward_features(x, head_only=True).shape == (6, 1, 64)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], atol=1e-5, rtol=1e-4, msg=name)
    assert model.blocks[-1].attn.qkv.weight.grad[:64].abs().sum() > 0  # q's rows are trained


def _linear_flops(model: VisionTransformer, x: torch.Tensor) -> int:
    """FLOPs of the matrix products (mm, addmm) in model(x), counted from their shapes."""
    return sum(2 * m * k * n * c for (m, k, n), c in matrix_products(model, x).items())


@pytest.mark.parametrize("distilled", [False, True])
def test_head_only_saves_the_last_blocks_other_rows(distilled: bool) -> None:
    """The tokens the head reads equal the full path's, and the linear layers' FLOPs drop by
    exactly the other rows' q, output projection and MLP in the last block and every row's key
    and value projection (the class token's attention multiplies the tokens by W_k^T q instead:
    batched products of n H rows, not linear layers)."""
    torch.manual_seed(0)
    cfg = tiny_config(distilled=distilled, depth=3)
    model = VisionTransformer(cfg).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        full = model.forward_features(x)
        head = model.forward_features(x, head_only=True)
    n = cfg.num_prefix_tokens
    assert head.shape == (2, n, 32)
    torch.testing.assert_close(head, full[:, :n], atol=1e-6, rtol=0)
    flops = _linear_flops(model, x)
    d, m, t = cfg.embed_dim, cfg.mlp_dim, full.shape[1]
    saved = 2 * 2 * ((t - n) * (2 * d * d + 2 * d * m) + t * 2 * d * d)  # batch 2, 2 FLOPs a MAC
    with model.blocks[-1].register_forward_hook(lambda *a: None):  # a hook: every row again
        assert _linear_flops(model, x) - flops == saved


@pytest.mark.parametrize(("qkv_bias", "prefix"), [(True, 1), (False, 1), (True, 2)])
def test_first_rows_without_keys_and_values_match_the_full_attention(
    qkv_bias: bool, prefix: int, monkeypatch
) -> None:
    """The last block's class-token rows (Attention._first_rows: no key or value formed) equal
    the full attention's first rows, with and without qkv's bias, for DeiT's two rows, and with
    attention dropout in training (a dropout whose mask depends on the value alone, so both
    paths drop the same weights; the value bias is then scaled by the kept weights' sum), in
    the outputs and in every parameter's and the input's gradient."""
    torch.manual_seed(0)
    attn = VisionTransformer(tiny_config(qkv_bias=qkv_bias, attn_dropout=0.2)).blocks[0].attn
    attn.train()

    def keep(p: torch.Tensor, rate: float = 0.5, training: bool = True, inplace: bool = False):
        return p * (p > 0.05) / (1 - rate) if training and rate else p

    monkeypatch.setattr(torch.nn.functional, "dropout", keep)
    x = torch.randn(3, 17, 32, requires_grad=True)
    grad = torch.randn(3, prefix, 32)
    results = []
    for queries in (prefix, None):  # the first rows; every row (the explicit path), then cut
        attn.zero_grad()
        x.grad = None
        out = attn(x, return_attention=queries is None, queries=queries)[0][:, :prefix]
        out.backward(grad)
        results.append([out.detach(), x.grad, *(p.grad.clone() for p in attn.parameters())])
    cut, full = results
    assert cut[0].shape == (3, prefix, 32)
    for a, b in zip(cut, full, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    if qkv_bias:
        assert attn.qkv.bias.grad[32:64].abs().max() < 1e-6  # k's bias: the softmax ignores it


def test_head_only_falls_back_where_rows_cannot_be_cut() -> None:
    """Where q cannot be projected apart (relative positions, a qkv with a forward of its own,
    a quantised one) the last block's attention computes every row and keeps the class token's
    (its output projection and MLP still that row only): the same token (a quantised model's
    int8 layers then scale the class token's row alone: close to float32); a forward or
    backward hook on the block sees every row; pool='gap' returns every token; with gradient
    checkpointing the rows are cut too and the gradients are the same."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    rel = VisionTransformer(tiny_config(pos_embed="relative")).eval()
    gap = VisionTransformer(tiny_config(pool="gap", class_token=False)).eval()
    plain = VisionTransformer(tiny_config()).eval()
    torch.nn.init.normal_(plain.head.weight)
    quant = torch.ao.quantization.quantize_dynamic(plain, {torch.nn.Linear}, dtype=torch.qint8)
    wrapped = VisionTransformer(tiny_config()).eval()
    qkv = wrapped.blocks[-1].attn.qkv
    qkv.forward = lambda t: torch.nn.Linear.forward(qkv, t) * 1.5  # as adapters patch one
    with torch.no_grad():
        for model in (rel, wrapped):
            full = model.forward_features(x)[:, :1]
            cut = model.forward_features(x, head_only=True)
            torch.testing.assert_close(cut, full, atol=1e-6, rtol=0)
        cut, exact = quant.forward_features(x, head_only=True), plain.forward_features(x)
        assert cut.shape == (2, 1, 32)
        torch.testing.assert_close(cut, exact[:, :1], atol=0.25, rtol=0)  # int8, not float32
        assert gap.forward_features(x, head_only=True).shape == (2, 16, 32)
        seen = []
        with plain.blocks[-1].register_forward_hook(lambda m, i, o: seen.append(o[0].shape)):
            assert plain.forward_features(x, head_only=True).shape == (2, 17, 32)
        assert seen == [(2, 17, 32)]
    grads = []
    for ckpt in (False, True):
        plain.zero_grad()
        plain.train().set_grad_checkpointing(ckpt)
        assert plain.forward_features(x, head_only=True).shape == (2, 1, 32)
        plain(x).square().sum().backward()
        grads.append([p.grad.clone() for p in plain.parameters()])
    assert all(g.abs().sum() > 0 for g in grads[0][-4:])  # the final norm and the head: trained
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    seen.clear()
    with plain.blocks[-1].register_full_backward_hook(lambda m, i, o: seen.append(o[0].shape)):
        plain(x).sum().backward()
    assert seen == [(2, 17, 32)]


def test_fsdp_hooks_leave_the_rows_cut(tmp_path) -> None:
    """fully_shard's hooks on each block (train.strategy=fsdp) gather parameters whatever a block
    returns: forward() still computes the class token's rows only, with the same logits."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = VisionTransformer(tiny_config()).eval()
    torch.nn.init.normal_(model.head.weight)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want = model(x)
    products = matrix_products(model, x)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        assert model.blocks[-1]._forward_pre_hooks and model._head_rows() == 1  # FSDP's hooks
        assert matrix_products(model, x) == products  # the same products: the rows cut
        with torch.no_grad():
            torch.testing.assert_close(model(x), want, atol=1e-5, rtol=0)
    finally:
        dist.destroy_process_group()


# --- inference a part of the batch at a time (chunks.batch_chunk) -------------------------------


def _parts_of_two(monkeypatch: pytest.MonkeyPatch, tokens: int) -> list[int]:
    """Parts of at most two images of `tokens` tokens (a 32-wide tiny model: qkv's output is the
    widest), glibc's allocator taken as at its defaults; the returned list gets the batch size
    of every block's call."""
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 2 * tokens * 96 * 4)  # two images' qkv output
    monkeypatch.setattr(chunks, "CHUNK_ROWS", tokens)  # parts of one image allowed
    monkeypatch.setattr(chunks, "allocator_returns_memory", lambda: True)
    sizes: list[int] = []
    real = Block.forward
    monkeypatch.setattr(
        Block, "forward", lambda blk, t, *a, **k: sizes.append(len(t)) or real(blk, t, *a, **k)
    )
    return sizes


@pytest.mark.parametrize(("distilled", "pool"), [(False, "token"), (True, "token"), (False, "gap")])
def test_inference_takes_the_batch_in_parts_with_the_same_outputs(
    distilled: bool, pool: str, monkeypatch
) -> None:
    """In inference on the CPU the encoder takes the batch a part at a time (about CHUNK_BYTES
    of the widest activation, qkv's output here, a part): each image's logits and tokens are
    those of a forward over it alone. With autograd, a hook that watches a block or the final
    norm (it sees the whole batch, as it expects), or glibc's allocator tuned, the whole batch
    at once."""
    torch.manual_seed(0)
    cfg = tiny_config(distilled=distilled, pool=pool, class_token=pool == "token")
    model = VisionTransformer(cfg).eval()
    torch.nn.init.normal_(model.head.weight)
    x = torch.randn(5, 3, 16, 16)
    tokens = 16 + model.num_prefix_tokens
    sizes = _parts_of_two(monkeypatch, tokens)
    with torch.no_grad():
        alone = torch.cat([model(x[i : i + 1]) for i in range(5)])
        features = torch.cat([model.forward_features(x[i : i + 1]) for i in range(5)])
        sizes.clear()
        torch.testing.assert_close(model(x), alone, atol=1e-5, rtol=0)
        assert sizes == [2, 2, 2, 2, 1, 1]  # three parts of at most two images, two blocks each
        torch.testing.assert_close(model.forward_features(x), features, atol=1e-5, rtol=0)
    with torch.inference_mode():
        sizes.clear()
        torch.testing.assert_close(model(x), alone, atol=1e-5, rtol=0)
        assert sizes == [2, 2, 2, 2, 1, 1]
    sizes.clear()
    with torch.enable_grad():  # autograd: one pass
        torch.testing.assert_close(model(x).detach(), alone, atol=1e-5, rtol=0)
    assert sizes == [5, 5]
    seen: list[int] = []
    with torch.no_grad(), model.norm.register_forward_hook(lambda m, i, o: seen.append(len(o))):
        sizes.clear()
        torch.testing.assert_close(model(x), alone, atol=1e-5, rtol=0)
    assert sizes == [5, 5] and seen == [5]
    monkeypatch.setattr(chunks, "allocator_returns_memory", lambda: False)  # tuned: one part
    with torch.no_grad():
        sizes.clear()
        model(x)
    assert sizes == [5, 5]
    monkeypatch.setattr(chunks, "allocator_returns_memory", lambda: True)
    # the batch fits: one part; parts of at least two images: two parts, not five
    for bytes_, rows in ((5 * tokens * 96 * 4, tokens), (tokens * 96 * 4, 2 * tokens)):
        monkeypatch.setattr(chunks, "CHUNK_BYTES", bytes_)
        monkeypatch.setattr(chunks, "CHUNK_ROWS", rows)
        with torch.no_grad():
            sizes.clear()
            model(x)
        assert sizes == ([5, 5] if rows == tokens else [3, 3, 2, 2])


def test_inference_keeps_the_batch_whole_where_a_part_could_differ(monkeypatch) -> None:
    """The whole batch at once where a part's result or what a user observes could differ from
    its share of the whole batch: a model in training mode under no_grad (DropPath's draws),
    dynamically quantised linear layers (one activation scale per call), a hook on a layer
    inside a block, a global hook; a batch of one image is never cut."""
    torch.manual_seed(0)
    model = VisionTransformer(tiny_config(drop_path=0.5)).eval()
    sizes = _parts_of_two(monkeypatch, 17)
    x = torch.randn(5, 3, 16, 16)
    quant = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    with torch.no_grad():
        model(x)
        assert sizes == [2, 2, 2, 2, 1, 1]  # parts, as the other cases would without the cause
        for run, want in (
            (lambda: model.train()(x), [5, 5]),
            (lambda: quant(x), [5, 5]),
            (lambda: model.eval()(x[:1]), [1, 1]),
        ):
            sizes.clear()
            run()
            assert sizes == want
        for handle in (
            model.blocks[0].attn.qkv.register_forward_hook(lambda *a: None),
            torch.nn.modules.module.register_module_forward_hook(lambda *a: None),
        ):
            sizes.clear()
            with handle:
                model(x)
            assert sizes == [5, 5]


def test_the_allocator_counts_as_returning_memory_until_tuned(tmp_path) -> None:
    """runtime.allocator_returns_memory(), which batch_chunk reads: true with glibc's defaults,
    false after tune_allocator() (the vitlab command's start), with a user's own setting of a
    threshold vitlab sets (which tune_allocator then leaves), and with another malloc preloaded;
    another glibc tunable changes nothing."""
    import platform
    import shutil
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's allocator only")
    code = (
        "from vitlab.runtime import allocator_returns_memory as r, tune_allocator as t; "
        "print(r(), t(), r())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUN"))}
    cases = [({}, "True True False"), ({"MALLOC_TOP_PAD_": "0"}, "False False False")]
    cases.append(({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "False False False"))
    cases.append(({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "True True False"))
    if shutil.which("cc"):  # another malloc preloaded (as jemalloc would be): not glibc's
        (tmp_path / "m.c").write_text(
            "#include <stddef.h>\nextern void *__libc_malloc(size_t);\n"
            "void *malloc(size_t n) { return __libc_malloc(n); }\n"
        )
        lib = tmp_path / "m.so"
        subprocess.run(["cc", "-shared", "-fPIC", "-o", lib, tmp_path / "m.c"], check=True)
        cases.append(({"LD_PRELOAD": str(lib)}, "False False False"))
    runs = run_together(*[([sys.executable, "-c", code], {**env, **extra}) for extra, _ in cases])
    for (extra, want), run in zip(cases, runs):
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == want.split(), extra
