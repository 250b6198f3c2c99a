"""A ViT's intermediate layers, for the analyses (attention maps and rollout, attention distance,
features of chosen blocks): each chosen block's output tokens and, on request, its attention
probabilities, computed block by block without running past the last one chosen."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from torch import Tensor

from vitlab.models.indices import chosen_indices


class Intermediates(NamedTuple):
    """What forward_intermediates returns."""

    features: Tensor  # (B, T, D) final tokens after the last LayerNorm
    tokens: list[Tensor]  # per chosen block, its output tokens (B, T, D)
    attentions: list[Tensor] | None  # per chosen block, attention probabilities (B, H, T, T)
    indices: list[int]  # the chosen blocks


class IntermediatesApi:
    """Mixed into VisionTransformer: reads its `blocks`, `norm` and `_embed` (patches, prefix
    tokens and positions)."""

    blocks: Any
    norm: Any
    _embed: Any

    def iter_intermediates(
        self, x: Tensor, indices: int | Sequence[int] | None = None, return_attention: bool = False
    ) -> Iterator[tuple[int, Tensor, Tensor | None]]:
        """Yield (block index, output tokens (B, T, D), attention (B, H, T, T) or None) for each
        chosen block, one at a time, and stop after the last one; attention is computed only for
        the chosen blocks. `indices`: an int n (the last n blocks) or block indices (negative
        allowed); None for all."""
        chosen = chosen_indices(indices, len(self.blocks), "block")
        if not chosen:
            return
        for i, tokens, attn in self._walk(self._embed(x), set(chosen), return_attention):
            if i in chosen:
                yield i, tokens, attn
            del tokens, attn  # hold no layer's maps while the next block runs
            if i == chosen[-1]:
                return

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | Sequence[int] | None = None,
        return_attention: bool = False,
        norm: bool = False,
    ) -> Intermediates:
        """Final tokens plus the chosen blocks' output tokens (with the final LayerNorm applied
        when `norm`) and, when `return_attention`, each chosen block's attention probabilities
        (B, H, T, T): softmax((q / sqrt(d)) k^T + bias) over the keys (rows sum to 1), the bias
        being (q / sqrt(d)) . r, r the learned embedding of each query-key offset, with
        pos_embed='relative', and none otherwise.

        The maps come from layers.attention_probs in the dtype its softmax runs in (q's: the
        model's, or the autocast dtype under CPU autocast; float32 under CUDA autocast), taken
        before attention dropout (in training mode the output uses a dropped copy), with autograd
        history when grad is enabled.
        With return_attention, the chosen blocks run this explicit path instead of
        F.scaled_dot_product_attention, which forward() uses (except in bf16 on CPU, where it
        takes the explicit path too): the same formula, not bit for bit, so tokens and `features`
        may then differ from forward_features' by rounding; without it every block runs as in
        forward(). tests/test_attention.py checks in float32, to atol 1e-5, the maps against the
        formula written out from the weights and `features` against forward_features
        (test_forward_intermediates_tokens_and_attention_maps), and both paths' outputs against
        that formula (test_fused_attention_matches_explicit_reference)."""
        chosen = chosen_indices(indices, len(self.blocks), "block")
        tokens: list[Tensor] = []
        attentions: list[Tensor] = []
        last = self._embed(x)  # stays the embedded input for a model without blocks
        for i, out, attn in self._walk(last, set(chosen), return_attention):
            last = out
            if i in chosen:
                tokens.append(self.norm(out) if norm else out)
                if attn is not None:
                    attentions.append(attn)
        features = self.norm(last)
        return Intermediates(features, tokens, attentions if return_attention else None, chosen)

    def _walk(
        self, x: Tensor, wanted: set[int], return_attention: bool
    ) -> Iterator[tuple[int, Tensor, Tensor | None]]:
        """From embedded tokens, yield (index, tokens, attention or None) after every block;
        attention only for the `wanted` blocks."""
        for i, blk in enumerate(self.blocks):
            x, attn = blk(x, return_attention=return_attention and i in wanted)
            yield i, x, attn
            del attn
