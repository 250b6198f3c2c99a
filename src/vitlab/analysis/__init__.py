"""The paper's analyses: cost per layer (more in later modules)."""

from vitlab.analysis.cost import cost_report, format_cost_report, layer_cost, param_breakdown

__all__ = ["cost_report", "format_cost_report", "layer_cost", "param_breakdown"]
