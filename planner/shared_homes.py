"""Several masks over one batch on one data placement: plans that share their block homes.

Notation (docs/design.md): nB blocks, P ranks, tile (qb, kb); ``home[b]`` owns block b; a plan's time is
its simulated forward + backward time (planner/cost_model.py).

Why: a model whose layers attend under different masks - global layers over causal documents and local
ones under a sliding window (Gemma 2 / 3, GPT-OSS, Mistral), Llama 4's chunked layers - shards its
activations once per batch, so every layer's plan must hold the same tokens on each rank in the same
order: the same block homes (a rank's local order is its blocks ascending). Each mask planned on its
own gets its own homes, and moving activations between them would cost an all-to-all per layer.

``make_plan(mask, ..., homes_from=plan)`` keeps ``plan``'s homes and plans only what follows from them
for this mask (``dcp_on_homes``). ``make_plans(masks, ..., weights=...)`` chooses the homes: where each
mask's plan would put them alone, or where dcp puts them for the joint mask (every mask's tiles, their
unmasked pairs summed with the weights: ``joint_tiles``), every mask planned on each candidate's homes,
and the candidate with the least weighted time kept. Measured (README, "Masks that share homes"): no
candidate wins everywhere; on one node sharing costs under 1%, on several nodes a window mask on a
global mask's homes can read most of its window from other ranks.

``dcp_on_homes``, each step kept where the cost model says it is faster (the homes never change):
1. the tiles balanced from their q-homes, staged (planner/stages.py) and, on several nodes, relayed;
   on several nodes also balanced relay-aware and with the NICs priced slower (the NIC-shy scales of
   planner/passes.py), every candidate given its transit relays; the fastest kept;
2. restaged (front-loaded, both ends, adaptive budgets) where not within GOOD_ENOUGH of the bound;
3. the backward's remote-KV groups deferred out of stage 0 (``with_deferred_backward``);
4. with ``effort="full"``, the forward and backward polishes (planner/polish.py, polish_bwd.py), from
   the thresholds dcp polishes from.
"""

from __future__ import annotations

import numbers
from dataclasses import replace

import numpy as np
import torch

from .candidates import _lower_bound, _place, _restaged, _with_transit, with_deferred_backward
from .cost_model import CostModel
from .dcp import DEFAULT_MEMORY_SLACK, POLISH_FROM_MULTI_NODE, POLISH_FROM_ONE_NODE, _polished, dcp
from .first_pass import GOOD_ENOUGH
from .passes import NIC_SHY_FROM, NIC_SHY_SCALES
from .placement import Placement
from .tiles import TileSet

HOME_STRATEGIES = ("dcp", "ring", "zigzag", "allgather")  # (make_plans: fcp and hypergraph choose homes per mask)


def dcp_on_homes(tiles: TileSet, world_size: int, home: np.ndarray, *, cost_model: CostModel, max_stages: int,
                 sizes: dict, effort: str = "full") -> Placement:
    """dcp's tile placement, stages and relays for ``tiles`` on the fixed block homes ``home`` [nB]
    (module docstring); the result records its steps in ``Placement.search``."""
    home = np.ascontiguousarray(home, dtype=np.int64)
    multi_node = world_size > cost_model.topology.ranks_per_node
    bound = _lower_bound(tiles, world_size, cost_model, sizes)
    steps = []
    place = dict(home=home, relays=multi_node)
    result = _place(tiles, world_size, None, cost_model, max_stages, sizes, **place)[0]
    if multi_node:
        # the balancer's other views of the NICs, as dcp's finalists and NIC-shy pass take them (a plan
        # on given homes has no other candidates to fall back on)
        result = _with_transit(tiles, result, world_size, cost_model, sizes)
        views = [dict(relay_aware=True)]
        if result.sim_time > NIC_SHY_FROM * bound:
            views += [dict(nic_scale=scale) for scale in NIC_SHY_SCALES]
        for view in views:
            alt = _place(tiles, world_size, None, cost_model, max_stages, sizes, **place, **view)[0]
            alt = _with_transit(tiles, alt, world_size, cost_model, sizes)
            if alt.sim_time < result.sim_time:
                result = alt
    steps.append(("given homes", result.sim_time))  # (Plan.explain: a plan placed on another plan's homes)
    if world_size > 1 and result.sim_time > GOOD_ENOUGH * bound:
        result = _restaged(tiles, result, world_size, cost_model, max_stages, sizes)
        steps.append(("restaging", result.sim_time))
    result = with_deferred_backward(tiles, result, world_size, cost_model, sizes)
    steps.append(("backward deferral", result.sim_time))
    polish_from = POLISH_FROM_MULTI_NODE if multi_node else POLISH_FROM_ONE_NODE
    if effort == "full" and world_size > 1 and result.sim_time > polish_from * bound:
        result = _polished(tiles, result, world_size, cost_model, sizes)
        steps.append(("polish", result.sim_time))
    assert np.array_equal(result.block_home, home), "a step changed the given homes"
    return replace(result, search=tuple(steps))


def check_weights(weights, count: int | None = None) -> list:
    """``weights`` (layers under each mask) as a list, ValueError unless they are positive finite numbers,
    ``count`` of them where given (make_plans: one per mask; PlanAhead: checked per batch)."""
    try:
        listed = [] if isinstance(weights, (str, bytes)) else list(weights)
    except TypeError:  # (not a sequence at all)
        listed = []
    if not listed or (count is not None and len(listed) != count) or not all(
            isinstance(w, numbers.Real) and not isinstance(w, bool) and np.isfinite(w) and w > 0 for w in listed):
        many = "a list of" if count is None else f"one for each of the {count} masks:"
        raise ValueError(f"weights must be {many} positive numbers (the layers under each mask), got {weights!r}")
    return listed


def joint_tiles(tile_sets: list, weights: list) -> TileSet:
    """The union of several masks' tiles over one batch (same blocks), each tile's unmasked pairs summed
    over the masks with ``weights``: the compute of a layer stack, whose homes dcp can place at once."""
    first = tile_sets[0]
    nB = first.num_blocks
    key = np.concatenate([t.q * nB + t.kv for t in tile_sets])
    unique, where = np.unique(key, return_inverse=True)  # (sorted by (q, kv), as a TileSet is)
    pairs = np.bincount(where, weights=np.concatenate([t.pairs * w for t, w in zip(tile_sets, weights)]))
    full = np.zeros(unique.size, dtype=bool)
    np.logical_or.at(full, where, np.concatenate([t.full for t in tile_sets]))
    return TileSet(total_len=first.total_len, block_size=first.block_size, num_blocks=nB, q=unique // nB,
                   kv=unique % nB, full=full, pairs=np.rint(pairs).astype(np.int64))


def make_plans(mask_specs, world_size: int, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
               weights=None, **kwargs) -> tuple:
    """Plans of several masks over one batch that share one data placement (the same block homes, so
    ``local_tokens(r)`` and ``shard`` are the same for all of them): for a model whose layers attend
    under different masks, e.g. global layers over ``MaskSpec.documents(seqlens)`` and local ones under
    ``documents(seqlens) & sliding_window(T, W)``, with activations sharded once.

    ``weights``: how many layers attend under each mask (default 1 each); the homes kept are those whose
    plans take the least weighted time (``plan_candidates``, module docstring). ``kwargs`` are
    make_plan's (``homes_from`` excepted); ``block_size`` None takes the largest of the masks' default
    block sizes (one block size for all). "ring", "zigzag" and "allgather" place every mask on the same
    homes: each mask is planned so. Returns the plans in the order of ``mask_specs``."""
    candidates = plan_candidates(mask_specs, world_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                 head_dim=head_dim, weights=weights, **kwargs)
    plans = min(candidates, key=lambda c: c[2])[1]  # (the first of the cheapest)
    assert all(torch.equal(plan.block_home, plans[0].block_home) for plan in plans), "plans differ in homes"
    return plans


def plan_candidates(mask_specs, world_size: int, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                    weights=None, dtype: torch.dtype = torch.bfloat16, block_size: int | None = None,
                    strategy: str = "dcp", topology=None, max_stages: int = 4,
                    grad_comm_dtype: torch.dtype = torch.float32, effort: str = "full", check: bool = True,
                    cost_model: CostModel | None = None, memory_slack: float = DEFAULT_MEMORY_SLACK) -> list:
    """make_plans' candidates, as [(name, plans in the order of ``mask_specs``, weighted seconds)]: with dcp
    every mask on the homes of each mask's own plan ("mask <i>'s homes") and on dcp's homes for the joint
    mask ("joint homes"); with a baseline one candidate ("<strategy>'s homes"). Arguments as make_plans."""
    from .api import _check_positive_int, _make_plan, check_mask_spec, check_plan_args, default_block_size

    world_size, num_q_heads, num_kv_heads, head_dim, max_stages, cost_model = check_plan_args(
        world_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
        block_size=block_size, strategy=strategy, topology=topology, max_stages=max_stages,
        grad_comm_dtype=grad_comm_dtype, effort=effort, cost_model=cost_model, memory_slack=memory_slack)
    specs = list(mask_specs) if isinstance(mask_specs, (list, tuple)) else []
    if not specs:
        raise ValueError(f"make_plans needs a non-empty list or tuple of MaskSpecs, got {mask_specs!r}")
    for spec in specs:
        check_mask_spec(spec)
    lengths = sorted({int(spec.total_len) for spec in specs})
    if len(lengths) > 1:
        raise ValueError(f"make_plans: the masks cover different token counts {lengths}; masks sharing homes "
                         "describe one batch")
    weights = [1.0] * len(specs) if weights is None else check_weights(weights, len(specs))
    if strategy not in HOME_STRATEGIES:
        raise ValueError(f"make_plans shares homes with strategy 'dcp' or a baseline ('ring', 'zigzag', "
                         f"'allgather'), got {strategy!r}: fcp and hypergraph choose homes per mask")
    if block_size is None:
        block_size = max(default_block_size(lengths[0], world_size, spec) for spec in specs)
    block_size = _check_positive_int("block_size", block_size)
    args = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                block_size=block_size, strategy=strategy, cost_model=cost_model, max_stages=max_stages,
                grad_comm_dtype=grad_comm_dtype, effort=effort, check=check, memory_slack=memory_slack)
    alone = [_make_plan(spec, world_size, **args) for spec in specs]
    weighed = lambda plans: sum(w * _seconds(plan) for w, plan in zip(weights, plans))  # noqa: E731
    if strategy != "dcp" or len(specs) == 1:
        return [(f"{strategy}'s homes", tuple(alone), weighed(alone))]
    sizes = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 element_size=dtype.itemsize, grad_element_size=grad_comm_dtype.itemsize)
    joint = joint_tiles([TileSet.from_block_mask(spec.block_mask(block_size)) for spec in specs], weights)
    joint_home = dcp(joint, world_size, cost_model=cost_model, max_stages=max_stages, effort=effort,
                     memory_slack=memory_slack, **sizes).block_home
    homes = [(f"mask {i}'s homes", plan.block_home.numpy().astype(np.int64)) for i, plan in enumerate(alone)]
    homes += [("joint homes", joint_home)]
    candidates = []
    for c, (name, home) in enumerate(homes):
        plans = tuple(plan if c == i else _make_plan(spec, world_size, **args, given_home=home)
                      for i, (spec, plan) in enumerate(zip(specs, alone)))
        candidates.append((name, plans, weighed(plans)))
    return candidates


def _seconds(plan) -> float:
    """A plan's simulated forward + backward time."""
    stats = plan.stats()
    return float(stats["sim_time_fwd"] + stats["sim_time_bwd"])
