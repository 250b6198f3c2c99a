"""The paper's analyses: cost per layer, attention distance, rollout, position similarity,
embedding filters."""

from vitlab.analysis.attention import (
    attention_rollout,
    embedding_filters,
    mean_attention_distance,
    pos_embed_similarity,
)
from vitlab.analysis.cost import cost_report, format_cost_report, layer_cost, param_breakdown

__all__ = [
    "attention_rollout",
    "cost_report",
    "embedding_filters",
    "format_cost_report",
    "layer_cost",
    "mean_attention_distance",
    "param_breakdown",
    "pos_embed_similarity",
]
