"""blockattn: masked attention over packed variable-length sequences, split across GPUs by a per-batch plan."""

from blockattn.attention import block_attention
from blockattn.masks import MaskSpec
from blockattn.planner import CostModel, Plan, PlanAhead, Topology, make_plan, make_plans

__all__ = ["MaskSpec", "block_attention", "make_plan", "make_plans", "PlanAhead", "Plan", "Topology", "CostModel"]
__version__ = "0.1.0"
