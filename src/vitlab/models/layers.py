"""Building blocks of the Vision Transformer: attention, MLP, the pre-LN encoder block and
stochastic depth; the patch embedding is in patch_embed.py (the convolutional stems in stems.py),
position embeddings in pos_embed.py. Shapes: B batch, T tokens (prefix + N patches), D width,
H heads, d = D / H head width, (gh, gw) the patch grid."""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitlab.models import cpu_attention, cpu_kernels
from vitlab.models.packed import folds, linear, plain, watched
from vitlab.models.pos_embed import Grid, RelativePositionBias
from vitlab.runtime import random_stream


class BlockConfig(Protocol):
    """What the encoder block and its parts read from the model's config (a ViTConfig)."""

    embed_dim: int
    num_heads: int
    mlp_dim: int
    qkv_bias: bool
    dropout: float
    attn_dropout: float
    act: str  # "gelu" | "gelu_tanh"
    norm_eps: float
    layer_scale: float | None  # None: no per-channel residual scale
    pos_embed: str  # "relative": every attention layer gets a RelativePositionBias

    @property
    def grid(self) -> Grid: ...

    @property
    def num_prefix_tokens(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


def lecun_normal_(weight: Tensor) -> Tensor:
    """Flax's default kernel init: truncated normal (+-2 std) with variance 1 / fan_in."""
    fan_in = weight[0].numel()
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # std of a unit normal truncated to +-2
    return nn.init.trunc_normal_(weight, 0.0, std, -2.0 * std, 2.0 * std)


class DropPath(nn.Module):
    """Stochastic depth: drops the whole residual branch per sample with probability `p`."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep, shape = 1.0 - self.p, (x.shape[0],) + (1,) * (x.ndim - 1)
        mask = x.new_empty(shape).bernoulli_(keep, generator=random_stream())
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


# --- the encoder block ---------------------------------------------------------------------------


def attention_probs(q: Tensor, k: Tensor, scale: float, bias: Tensor | None = None) -> Tensor:
    """softmax((q * scale) k^T + bias): (B, H, T, T), in q's dtype (PyTorch's reduced-precision
    softmax accumulates in float32)."""
    logits = (q * scale) @ k.transpose(-2, -1)
    if bias is not None:
        logits = logits + bias
    return logits.softmax(dim=-1)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection. The plain path runs
    F.scaled_dot_product_attention; `return_attention=True` computes the same result explicitly
    (attention_probs, then dropout, then the product with V) and also returns the attention
    probabilities (B, H, T, T). bf16 on CPU always takes the explicit path, because PyTorch's fused
    kernel is slow to train in bf16 on CPU (BENCHMARKS.md has the measurements); float32 on a CPU
    (training and inference) takes vitlab's kernel for short sequences where it applies
    (cpu_attention)."""

    def __init__(self, cfg: BlockConfig, rel_pos: RelativePositionBias | None = None) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.embed_dim // cfg.num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim, bias=cfg.qkv_bias)
        self.attn_drop = cfg.attn_dropout
        self.proj = nn.Linear(cfg.embed_dim, cfg.embed_dim)
        self.proj_drop = nn.Dropout(cfg.dropout)
        self.rel_pos = rel_pos

    def forward(
        self, x: Tensor, return_attention: bool = False, queries: int | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """(B, T, D) -> (B, T, D) and the probabilities or None; with `queries` n, only the first
        n tokens' outputs (B, n, D): their queries attend to every token, the other rows of q and
        of the output are not computed."""
        if queries is not None and self._splits(return_attention):
            return self._first_rows(x, queries), None
        out, attn = self._mix(x, return_attention)
        if queries is not None:  # every row's attention computed, the first rows kept
            out, attn = out[:, :queries], None if attn is None else attn[:, :, :queries]
        return self.proj_drop(self.proj(out)), attn  # (B, T, D)

    def joined(
        self, x: Tensor, residual: Tensor, return_attention: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """residual + forward(x)[0], proj's bias added in the same pass, in place on its fresh
        output (cpu_kernels.join_; Block._joins says when), and the probabilities or None."""
        out, attn = self._mix(x, return_attention)
        return cpu_kernels.join_(F.linear(out, self.proj.weight), residual, self.proj.bias), attn

    def _mix(self, x: Tensor, return_attention: bool) -> tuple[Tensor, Tensor | None]:
        """Every token's attention output (B, T, D), before the output projection, and the
        probabilities or None."""
        # bare: no relative-position bias, no attention dropout, no probabilities asked for
        bare = self.rel_pos is None and not (self.training and self.attn_drop > 0)
        bare = bare and not return_attention
        if bare and self._folds(x):  # the kernel adds qkv's bias as it reads q, k and v
            qkv = F.linear(x, self.qkv.weight)  # (B, T, 3D) without the bias: no pass for it
            out = cpu_attention.attention(qkv, self.num_heads, self.scale, self.qkv.bias)
            attn = None
        else:
            qkv = self.qkv(x)  # (B, T, 3D)
            if bare and cpu_attention.applies(qkv, self.num_heads):
                out, attn = cpu_attention.attention(qkv, self.num_heads, self.scale), None
            else:
                out, attn = self._attend(qkv, return_attention)
        return out, attn

    def _folds(self, x: Tensor) -> bool:
        """Whether the qkv projection of the tokens x runs without its bias, which vitlab's
        attention kernel adds as it reads q, k and v: the kernel takes x's projection, qkv's bias
        can be folded (folds) and no hook watches qkv (it would see the output without it)."""
        return folds(self.qkv) and cpu_attention.takes(x, self.num_heads) and not watched(self.qkv)

    def _splits(self, return_attention: bool) -> bool:
        """Whether the first rows can be computed from the qkv weight's blocks (_first_rows): a
        plain or packed nn.Linear (not a quantised or wrapped one, no forward of its own), no
        relative-position bias (RelativePositionBias takes every row of q)."""
        return linear(self.qkv) and not return_attention and self.rel_pos is None

    def _first_rows(self, x: Tensor, n: int) -> Tensor:
        """The first n tokens' outputs (B, n, D), no other token's q, k or v formed. For a query
        row q of a head, q . k_t = x_t . (W_k^T q) + q . b_k, whose last term is the same for
        every t and leaves the softmax as it is; sum_t p_t v_t = (sum_t p_t x_t) W_v^T +
        (sum_t p_t) b_v. So the tokens x are multiplied by n H vectors of width D, twice,
        instead of by the (D, 2D) key and value projection."""
        b, _, d = x.shape
        h, hd = self.num_heads, self.head_dim
        w_q, w_k, w_v = self.qkv.weight.view(3, h, hd, d).unbind(0)  # one gradient for qkv
        q = F.linear(
            x[:, :n], w_q.reshape(d, d), None if self.qkv.bias is None else self.qkv.bias[:d]
        )
        u = torch.einsum("bihc,hcD->bihD", q.view(b, n, h, hd) * self.scale, w_k)
        probs = (u.reshape(b, n * h, d) @ x.transpose(1, 2)).softmax(dim=-1)  # (B, n H, T)
        dropped = self.training and self.attn_drop > 0
        probs = F.dropout(probs, self.attn_drop, training=True) if dropped else probs
        z = (probs @ x).view(b, n, h, d)  # sum_t p_t x_t for each query row and head
        out = torch.einsum("bihD,hcD->bihc", z, w_v)  # (B, n, H, d)
        if self.qkv.bias is not None:
            b_v = self.qkv.bias[2 * d :].view(h, hd)
            if dropped:  # the kept weights no longer sum to 1
                b_v = probs.sum(dim=-1).view(b, n, h, 1) * b_v
            out = out + b_v
        return self.proj_drop(self.proj(out.reshape(b, n, d)))

    def _attend(self, qkv: Tensor, return_attention: bool) -> tuple[Tensor, Tensor | None]:
        """PyTorch's attention over qkv (B, T, 3D): the output (B, T, D) and, with
        return_attention, the probabilities."""
        b, t, width = qkv.shape
        qkv = qkv.reshape(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, T, d) each
        bias = None if self.rel_pos is None else self.rel_pos(q, self.scale)  # (B, H, T, T)
        return self._heads(q, k, v, bias, return_attention)

    def _heads(
        self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, return_attention: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of q (B, H, n, d) over k, v (B, H, T, d): the output (B, n, D) and, with
        return_attention, the probabilities (B, H, n, T)."""
        drop = self.attn_drop if self.training else 0.0
        attn = None
        # explicit: asked for the probabilities, bf16 on a CPU, or a bias being exported (the
        # ONNX exporter cannot decompose PyTorch's attention with a mask)
        exported_bias = bias is not None and torch.compiler.is_exporting()
        if (
            return_attention
            or exported_bias
            or (q.device.type == "cpu" and q.dtype == torch.bfloat16)
        ):
            probs = attention_probs(q, k, self.scale, bias)
            attn = probs if return_attention else None
            out = F.dropout(probs, drop, training=self.training) @ v
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=drop, scale=self.scale
            )
        b, h, n, d = out.shape
        return out.transpose(1, 2).reshape(b, n, h * d), attn


class Mlp(nn.Module):
    """Linear(D, M) -> GELU -> dropout -> Linear(M, D) -> dropout."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.embed_dim, cfg.mlp_dim)
        self.act = nn.GELU(approximate="tanh" if cfg.act == "gelu_tanh" else "none")
        self.drop1 = nn.Dropout(cfg.dropout)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.embed_dim)
        self.drop2 = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self._hidden(x)))

    def joined(self, x: Tensor, residual: Tensor) -> Tensor:
        """residual + forward(x), fc2's bias added in the same pass, in place on its fresh output
        (cpu_kernels.join_; Block._joins says when)."""
        return cpu_kernels.join_(
            F.linear(self._hidden(x), self.fc2.weight), residual, self.fc2.bias
        )

    def _hidden(self, x: Tensor) -> Tensor:
        """GELU(fc1(x)) after dropout: what fc2 reads."""
        if self._on_kernel(x):  # fc1's (rows, M) output, not a view: GELU in place on it
            rows = x.reshape(-1, x.shape[-1])
            if folds(self.fc1, width=8):  # the bias added in GELU's pass, not in its own
                h = cpu_kernels.gelu_(F.linear(rows, self.fc1.weight), self.fc1.bias)
            else:
                h = cpu_kernels.gelu_(self.fc1(rows))
            h = h.view(*x.shape[:-1], h.shape[-1])
        else:
            h = self.act(self.fc1(x))
        return self.drop1(h)

    def _on_kernel(self, x: Tensor) -> bool:
        """Whether GELU runs on vitlab's kernel (cpu_kernels.gelu_), in place on fc1's output:
        float32 on the CPU, the erf form, a plain or packed fc1, and no hook that could see fc1's
        output (which it overwrites) or expect act (which it skips)."""
        if not cpu_kernels.usable(x):  # first: shapes are not read under tracing
            return False
        erf = plain(self.act, nn.GELU) and self.act.approximate == "none"
        return erf and linear(self.fc1) and not watched(self.fc1, self.act)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm; over one dimension of a width that is a multiple of 8, with weight and bias,
    inference in float32 on the CPU runs vitlab's kernel (cpu_kernels: rows in cache, four at a
    time, 2.8x PyTorch's at D = 64 and 128)."""

    def forward(self, x: Tensor) -> Tensor:
        if not cpu_kernels.infers(x):  # first: shapes are not read under tracing
            return super().forward(x)
        one = len(self.normalized_shape) == 1 and self.normalized_shape[0] % 8 == 0
        if one and self.weight is not None and self.bias is not None:
            return cpu_kernels.layer_norm(x, self.weight, self.bias, self.eps)
        return super().forward(x)


class LayerScale(nn.Module):
    """Per-channel scale of a residual branch (CaiT, DeiT-3): x * gamma, gamma (D,) starting at
    `init`."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


# the branches' own forwards: where one is replaced on the class (as some attention-map tools
# do), a block calls forward, not the joined path that would bypass it
_FORWARDS = {Attention: Attention.forward, Mlp: Mlp.forward}


class Block(nn.Module):
    """Pre-LN encoder layer (Eq. 2-3): x + DropPath(MSA(LN(x))), then x + DropPath(MLP(LN(x)));
    with `layer_scale`, each branch is scaled per channel before it is added."""

    def __init__(self, cfg: BlockConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        rel_pos = None
        if cfg.pos_embed == "relative":
            rel_pos = RelativePositionBias(cfg.grid, cfg.num_prefix_tokens, cfg.head_dim)
        self.norm1 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg, rel_pos)
        scaled = cfg.layer_scale is not None
        self.ls1 = LayerScale(cfg.embed_dim, cfg.layer_scale) if scaled else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.mlp = Mlp(cfg)
        self.ls2 = LayerScale(cfg.embed_dim, cfg.layer_scale) if scaled else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    def forward(
        self, x: Tensor, return_attention: bool = False, queries: int | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """(B, T, D) -> (B, T, D) and attention or None; with `queries` n, the first n tokens'
        rows only (B, n, D), the same values (Attention.forward)."""
        joins = self._joins(x) if queries is None else (False, False)
        if joins[0]:
            x, attn = self.attn.joined(self.norm1(x), x, return_attention)
        else:
            y, attn = self.attn(self.norm1(x), return_attention, queries)
            x = (x if queries is None else x[:, :queries]) + self.drop_path1(self.ls1(y))
        if joins[1]:
            return self.mlp.joined(self.norm2(x), x), attn
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)))), attn

    def _joins(self, x: Tensor) -> tuple[bool, bool]:
        """Whether each branch's (attention's, the MLP's) last linear layer runs without its bias,
        which the sum with the residual stream x adds in the same pass, in place on the layer's
        fresh output (cpu_kernels.join_: one pass and one fresh tensor fewer; micro's float32
        training step 1.03x, BENCHMARKS.md, issue 16): a tensor the kernels take, a layer whose
        bias can be folded (packed.folds), nothing between it and the sum that changes its output
        (no layer scale; dropout and stochastic depth only where they are off: p = 0 or their own
        module in eval mode, as Monte Carlo dropout keeps them on in an eval model), nothing
        replacing a forward, no hook on them."""
        if not cpu_kernels.usable(x) or x.dim() != 3 or x.shape[-1] % 8:
            return False, False

        def joins(branch: nn.Module, layer: nn.Module, *between: nn.Module) -> bool:
            kinds = zip((type(branch), nn.Dropout, nn.Identity, DropPath), (branch, *between))
            own = _FORWARDS.get(type(branch)) is type(branch).forward
            kinds = own and all(plain(m, k) for k, m in kinds)
            idle = all(not m.training or m.p == 0 for m in (between[0], between[2]))
            return kinds and idle and folds(layer, 8) and not watched(branch, layer, *between)

        attn, mlp = self.attn, self.mlp
        return (
            joins(attn, attn.proj, attn.proj_drop, self.ls1, self.drop_path1),
            joins(mlp, mlp.fc2, mlp.drop2, self.ls2, self.drop_path2),
        )
