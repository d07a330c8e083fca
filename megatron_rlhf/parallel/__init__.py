"""Parallel layouts (TP x PP x DP over an explicit list of ranks) and their process groups."""

from megatron_rlhf.parallel.layout import Layout, RankCoords

__all__ = ["Layout", "RankCoords"]
