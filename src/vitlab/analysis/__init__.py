"""The paper's analyses: cost per layer (a Swin's per stage), attention cost against image size,
attention distance (a Swin's within windows), rollout, position similarity, embedding filters."""

from vitlab.analysis.attention import (
    attention_rollout,
    embedding_filters,
    mean_attention_distance,
    pos_embed_similarity,
)
from vitlab.analysis.cost import cost_report, format_cost_report, layer_cost, param_breakdown
from vitlab.analysis.scaling import attention_scaling
from vitlab.analysis.swin_cost import swin_cost_report
from vitlab.analysis.windows import mean_window_attention_distance, window_token_centres

__all__ = [
    "attention_rollout",
    "attention_scaling",
    "cost_report",
    "embedding_filters",
    "format_cost_report",
    "layer_cost",
    "mean_attention_distance",
    "mean_window_attention_distance",
    "param_breakdown",
    "pos_embed_similarity",
    "swin_cost_report",
    "window_token_centres",
]
