"""blockattn.planner: per-batch placement of token blocks and attention tiles across ranks.

Public entry: ``make_plan`` (re-exported as ``blockattn.make_plan``). See docs/design.md.
"""

from .ahead import PlanAhead
from .api import STRATEGIES, clear_plan_cache, default_block_size, make_plan
from .check import PlanConsistencyError, check_plan
from .cost_model import CostModel, Topology
from .plan import Plan
from .shared_homes import make_plans
from .schedule import (BWD_KINDS, FWD_KINDS, KIND_DKV, KIND_DO, KIND_DQ, KIND_KV, KIND_NAMES, KIND_OUT, KIND_Q,
                       CommSchedule, derive_schedule, payload_bytes)

__all__ = [
    "make_plan", "make_plans", "PlanAhead", "Plan", "CommSchedule", "Topology", "CostModel", "STRATEGIES", "clear_plan_cache",
    "default_block_size", "check_plan", "derive_schedule", "payload_bytes", "PlanConsistencyError",
    "KIND_Q", "KIND_KV", "KIND_OUT", "KIND_DO", "KIND_DQ", "KIND_DKV", "KIND_NAMES", "FWD_KINDS", "BWD_KINDS",
]
