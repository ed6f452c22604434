"""make_plan: validate arguments, classify the mask, run a strategy, build and check the Plan.

Notation (docs/design.md): T tokens, B block size, nB blocks, P ranks (world size).
Plans are cached (LRU, by count and by bytes) by the mask signature and every argument, so repeated
batches with the same mask cost one dictionary lookup.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections import OrderedDict

import numpy as np
import torch

from . import baselines, dcp, fcp, hypergraph
from .dcp import DEFAULT_MEMORY_SLACK
from .check import check_plan
from .cost_model import BALANCE_SLACK, CostModel, Topology
from .finish import finish_placement
from .shared_homes import dcp_on_homes
from .placement import Placement, positions_by_key, stage_renumbering
from .plan import Plan
from .schedule import CommSchedule, as_relay_table, derive_schedule, int_array
from .tiles import TileSet, forget_tile_sets

DEFAULT_BLOCK_SIZE = 128
MIN_AUTO_BLOCK_SIZE = 16
# The default block size grows (x2, up to MAX_AUTO_BLOCK_SIZE, keeping >= MIN_AUTO_BLOCKS_PER_RANK
# blocks per rank) while the mask has more than MAX_AUTO_TILES non-empty tiles at it: planning time and
# memory follow the tile count. One 1M-token causal document on 64 ranks (make_plan, check included):
# 33.6M tiles at 128 were killed for memory (24 GB) after 4 minutes; at 512 (2.1M tiles) 17 s, 2.2 GB,
# 1.002x the bound. On 256 ranks: 8.4M tiles at 256 took 319 s and 6.2 GB, 2.1M at 512 81 s and 2 GB,
# both 1.104x the bound. A 720K-token one on 64 ranks at 128 (15.9M tiles): 129 s, 15.3 GB. Memory
# stays balanced (8 whole blocks per rank at the least); the kernels run any power-of-two block (in
# BLOCK_M x BLOCK_N sub-tiles), and a partial (diagonal) tile's masked part stays a sliver of the work.
MAX_AUTO_TILES = 1 << 22
MAX_AUTO_BLOCK_SIZE = 1024
MIN_AUTO_BLOCKS_PER_RANK = 8
# More tiles than this are refused, naming the block size to use (the default grows past its limits
# above to stay under it).
MAX_PLAN_TILES = 1 << 23
MAX_WORLD_SIZE = 4096  # per-rank x per-block tables stay small (P * nB booleans)
_CACHE_SIZE = 32
# ... and at most this many bytes of index tensors (the newest plan is always kept): a plan holds ~30 bytes
# per tile, 8 MB for a 1M-token Wikipedia batch on 64 ranks but 63 MB for one 512K-token causal document
# (2.1M tiles), and in a PlanAhead worker, where every batch is new, 32 of those would hold 2 GB for nothing.
_CACHE_BYTES = 1 << 30
_cache: "OrderedDict[tuple, Plan]" = OrderedDict()
_cache_bytes: dict = {}  # key -> the plan's bytes


def _strategies() -> dict:
    """Strategy name -> placement function(tiles, world_size, **sizes) -> Placement."""
    return {
        "dcp": dcp.dcp,
        "fcp": fcp.fcp,
        "ring": baselines.ring,
        "zigzag": baselines.zigzag,
        "allgather": baselines.allgather,
        "hypergraph": hypergraph.hypergraph,
    }


STRATEGIES = ("dcp", "fcp", "ring", "zigzag", "allgather", "hypergraph")
# dcp's search: "full" runs every pass of planner/dcp.py; "fast" stops after the NIC-shy and spread passes
# (and the fcp strategy's plan), skipping the later passes (planner/dcp.py FAST_SKIPS)
EFFORTS = ("full", "fast")
MAX_MEMORY_SLACK = 0.5  # (make_plan's ``memory_slack``; its default, DEFAULT_MEMORY_SLACK, is planner/dcp.py's)


def default_block_size(total_len: int, world_size: int, mask_spec=None) -> int:
    """128 (the kernels' tile), halved (down to 16) while there are fewer than 4 blocks per zigzag
    chunk, so small batches still split evenly over 2P chunks; with ``mask_spec``, doubled while the
    mask has more than MAX_AUTO_TILES tiles at it (see there), up to MAX_AUTO_BLOCK_SIZE and keeping
    MIN_AUTO_BLOCKS_PER_RANK blocks per rank, and past those while it has more than MAX_PLAN_TILES
    (which make_plan refuses)."""
    B = DEFAULT_BLOCK_SIZE
    while B > MIN_AUTO_BLOCK_SIZE and -(-total_len // B) < 8 * world_size:
        B //= 2
    if mask_spec is not None:
        while B < total_len:
            roomy = B < MAX_AUTO_BLOCK_SIZE and -(-total_len // (2 * B)) >= MIN_AUTO_BLOCKS_PER_RANK * world_size
            if not (more_tiles_than(mask_spec, B, MAX_PLAN_TILES)
                    or (roomy and more_tiles_than(mask_spec, B, MAX_AUTO_TILES))):
                break
            B *= 2
    return B


def more_tiles_than(mask_spec, block_size: int, limit: int) -> bool:
    """Whether ``mask_spec`` has more than ``limit`` non-empty tiles at ``block_size``, counted only
    where its nB^2 block pairs could exceed it: a 128K-token batch at 128 (1024 blocks) never counts,
    which would cost ~1 ms of make_plan's few."""
    nB = -(-mask_spec.total_len // block_size)
    return nB * nB > limit and mask_spec.num_tiles(block_size) > limit


def check_tile_count(mask_spec, block_size: int, world_size: int) -> None:
    """ValueError, naming the block size to use (the default), where ``mask_spec`` has more than
    MAX_PLAN_TILES tiles at ``block_size``: such a plan would take minutes and tens of GB to make."""
    if more_tiles_than(mask_spec, block_size, MAX_PLAN_TILES):
        B = default_block_size(mask_spec.total_len, world_size, mask_spec)
        raise ValueError(
            f"{mask_spec!r} has {mask_spec.num_tiles(block_size):,} non-empty tiles at block_size={block_size} "
            f"(at most {MAX_PLAN_TILES:,} are planned: planning time and memory grow with the tiles); use "
            f"block_size={B} ({mask_spec.num_tiles(B):,} tiles), the default for this mask on {world_size} ranks "
            "(block_size=None) - the kernels run any power-of-two block size")


def _check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


GRAD_COMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_plan_args(world_size: int, *, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    block_size: int | None, strategy: str, topology: Topology | None, max_stages: int,
                    grad_comm_dtype: torch.dtype = torch.float32, effort: str = "full",
                    cost_model: CostModel | None = None, memory_slack: float = DEFAULT_MEMORY_SLACK) -> tuple:
    """Validate make_plan's arguments other than the mask (TypeError / ValueError naming the bad one);
    returns (world_size, num_q_heads, num_kv_heads, head_dim, max_stages, cost_model) normalized, the
    cost model holding the topology (``topology`` or ``cost_model``'s, which must agree where both are
    given)."""
    world_size = _check_positive_int("world_size", world_size)
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(f"world_size {world_size} exceeds the supported maximum {MAX_WORLD_SIZE}")
    num_q_heads = _check_positive_int("num_q_heads", num_q_heads)
    num_kv_heads = _check_positive_int("num_kv_heads", num_kv_heads)
    head_dim = _check_positive_int("head_dim", head_dim)
    max_stages = _check_positive_int("max_stages", max_stages)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) for GQA")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    if grad_comm_dtype not in GRAD_COMM_DTYPES:
        raise TypeError(f"grad_comm_dtype must be one of torch.float32 (default), torch.bfloat16 or torch.float16 "
                        f"(the dtype the dQ/dK/dV partials travel in), got {grad_comm_dtype!r}")
    if grad_comm_dtype == torch.float16 and dtype != torch.float16:
        # fp16's range (65504) is narrower than bf16's and fp32's: partials of such a model could overflow
        raise ValueError(f"grad_comm_dtype=torch.float16 needs dtype=torch.float16 (got dtype={dtype}); "
                         "use torch.bfloat16 or torch.float32 for the gradient partials")
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if not isinstance(effort, str) or effort not in EFFORTS:
        raise ValueError(f"unknown effort {effort!r}; choose \"full\" (default: dcp's whole search) or \"fast\" "
                         "(dcp without its later passes: 1.3-4x less planning time on several nodes)")
    if block_size is not None:
        _check_positive_int("block_size", block_size)
    if isinstance(memory_slack, bool) or not isinstance(memory_slack, (int, float, np.integer, np.floating)):
        raise TypeError(f"memory_slack must be a number (the fraction of the mean tokens per rank a rank may hold "
                        f"beyond it, e.g. 0.05), got {type(memory_slack).__name__}")
    if not (0 <= memory_slack <= MAX_MEMORY_SLACK):
        raise ValueError(f"memory_slack must be in [0, {MAX_MEMORY_SLACK}] (a fraction of the mean tokens per rank; "
                         f"0: no re-plan with memory slack), got {memory_slack!r}")
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"topology must be a blockattn.planner.Topology, got {type(topology).__name__}")
    if cost_model is None:
        cost_model = CostModel(topology=Topology() if topology is None else topology)
    elif not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a blockattn.planner.CostModel, got {type(cost_model).__name__}")
    elif topology is not None and topology != cost_model.topology:
        raise ValueError(f"topology ({topology}) and cost_model.topology ({cost_model.topology}) disagree: give the "
                         "topology inside the cost model, CostModel(topology=..., fwd_rate=...), or only one of them")
    if not cost_model.is_plain():
        raise ValueError("cost_model's balance_overlap, balance_duplex, balance_level_nodes, balance_priced_rows, "
                         "balance_slack and home_memory_slack are dcp's internal search settings: leave them at their "
                         f"defaults (0.0, False, False, True, {BALANCE_SLACK}, 0.0); make_plan's memory_slack sets how "
                         "far memory may be unbalanced")
    return world_size, num_q_heads, num_kv_heads, head_dim, max_stages, cost_model


def check_mask_spec(mask_spec) -> None:
    """TypeError unless ``mask_spec`` offers what planning reads (a blockattn MaskSpec does)."""
    for attr in ("total_len", "signature", "block_mask", "num_tiles"):
        if not hasattr(mask_spec, attr):
            raise TypeError(f"mask_spec must be a blockattn MaskSpec (missing .{attr}), got {type(mask_spec).__name__}")


def make_plan(mask_spec, world_size: int, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype = torch.bfloat16, block_size: int | None = None, strategy: str = "dcp",
              topology: Topology | None = None, max_stages: int = 4, grad_comm_dtype: torch.dtype = torch.float32,
              effort: str = "full", check: bool = True, cost_model: CostModel | None = None,
              memory_slack: float = DEFAULT_MEMORY_SLACK, homes_from: Plan | None = None) -> Plan:
    """Plan one batch: which rank holds each token block, which rank computes each non-empty tile
    in which stage, and every transfer that implies (see docs/design.md, "Plan").

    ``strategy``: "dcp" (default), "fcp", or a baseline "ring", "zigzag", "allgather", or "hypergraph"
    (placement by hypergraph partitioning, as in DCP, with Mt-KaHyPar: planner/hypergraph.py,
    ``pip install 'blockattn[hypergraph]'``).
    ``block_size``: tokens per block (a power of two >= 16 for the Triton kernels); None picks
    ``default_block_size``: 128, smaller for small batches, larger where the mask has millions of tiles
    at 128 (one long causal document). A mask with more than MAX_PLAN_TILES tiles at the block size is
    refused (ValueError naming the block size to use).
    ``topology``: ranks per node and link speeds (default: 8 H200 per node, NVLink + 400 Gb/s).
    ``cost_model``: the GPUs' attention speed with the topology, for hardware or kernels other than the
    default H200 ones: ``CostModel(topology=..., fwd_rate=FLOP/s, bwd_flops_factor=...)``, or
    ``CostModel.from_kernel_tflops(fwd, bwd, topology=...)`` from measured TFLOP/s
    (bench/bench_kernels.py). It sets the balance between compute and transfers that dcp plans for, and
    what ``Plan.stats()`` simulates. Give the topology there or in ``topology``, not two different ones.
    The default rates are bf16 / fp16 kernels' on an H200 (float32 attention is several times slower).
    ``max_stages``: upper bound on communication stages for dcp/fcp (stage 0 excluded).
    ``grad_comm_dtype``: dtype of the dQ / dK / dV partials sent back to the blocks' homes, which sum
    them in fp32. fp32 (default) keeps the backward as exact as on one device; torch.bfloat16 halves
    the backward's largest transfers for one rounding per partial (as TransformerEngine's CP sends dK/dV);
    torch.float16 only with dtype=torch.float16 (its range could overflow otherwise).
    ``effort`` (dcp; the other strategies plan the same either way): "full" (default) runs dcp's whole
    search; "fast" stops after its first pass, the baselines' check, the second opinion, the backward
    deferral and the NIC-shy and spread passes, skipping the later ones (deal and leveling passes,
    fan-out, polishes, re-plans: planner/dcp.py FAST_SKIPS): 1.3-4x less planning time on several
    nodes for 0.5-11% more simulated time in geomean, up to 24% on a 1M-token batch (README, "Planning
    effort").
    ``memory_slack`` (dcp): how many tokens beyond the mean a rank may hold, as a fraction of the mean
    (default 0.05). dcp's placements first balance memory as before (FCP's packings to the block,
    contiguous runs within 3% of a run at each cut); a plan still over 1.05x the lower bound is planned
    again with FCP's packings allowed this slack, and kept where faster: a document heavier than its
    node's share then no longer forces the lightest documents that fill the node's memory onto it too
    (README, "memory slack"). 0: no such re-plan.
    ``homes_from``: a Plan of the same batch (same world size and total length) whose data placement
    this plan keeps - the same block homes, so ``local_tokens(r)`` are the same on every rank - planning
    only the tiles, stages and transfers of this mask on them (dcp; planner/shared_homes.py). For models
    whose layers attend under different masks (global and sliding-window layers) over activations sharded
    once; ``make_plans`` plans such a set of masks. ``block_size`` defaults to that plan's.
    ``check``: verify the plan's consistency (planner/check.py ``check_plan``) before returning.
    To keep planning out of the training step, plan the next batches ahead with ``PlanAhead``
    (planner/ahead.py), which runs this function in a worker process.
    """
    world_size, num_q_heads, num_kv_heads, head_dim, max_stages, cost_model = check_plan_args(
        world_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
        block_size=block_size, strategy=strategy, topology=topology, max_stages=max_stages,
        grad_comm_dtype=grad_comm_dtype, effort=effort, cost_model=cost_model, memory_slack=memory_slack)
    check_mask_spec(mask_spec)
    given = None
    if homes_from is not None:
        block_size = _check_homes_from(homes_from, world_size, int(mask_spec.total_len), block_size, strategy)
        given = homes_from.block_home.numpy().astype(np.int64)
    return _make_plan(mask_spec, world_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      dtype=dtype, block_size=block_size, strategy=strategy, cost_model=cost_model,
                      max_stages=max_stages, grad_comm_dtype=grad_comm_dtype, effort=effort, check=check,
                      memory_slack=memory_slack, given_home=given)


def _make_plan(mask_spec, world_size: int, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, block_size: int | None, strategy: str, cost_model: CostModel, max_stages: int,
               grad_comm_dtype: torch.dtype, effort: str, check: bool, memory_slack: float,
               given_home: np.ndarray | None = None) -> Plan:
    """make_plan after its arguments are checked and normalized (``check_plan_args``); ``given_home``
    [nB]: plan on these block homes (planner/shared_homes.py ``dcp_on_homes``), at ``block_size``."""
    total_len = int(mask_spec.total_len)
    if block_size is None:
        block_size = default_block_size(total_len, world_size, mask_spec)
    block_size = _check_positive_int("block_size", block_size)
    memory_slack = float(memory_slack)
    if strategy != "dcp":
        effort = "full"  # (only dcp has a search to cut short: the others' plans are cached once)
        memory_slack = 0.0  # (nor a re-plan to use it)

    key = (mask_spec.signature(), world_size, num_q_heads, num_kv_heads, head_dim, str(dtype), block_size,
           strategy, cost_model.key(), max_stages, str(grad_comm_dtype), effort, memory_slack,
           None if given_home is None else hashlib.sha256(given_home.tobytes()).hexdigest())
    cached = _cache.get(key)
    if cached is not None:
        _cache.move_to_end(key)
        return cached

    check_tile_count(mask_spec, block_size, world_size)
    tiles = TileSet.from_block_mask(mask_spec.block_mask(block_size))
    if given_home is not None:
        sizes = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     element_size=dtype.itemsize, grad_element_size=grad_comm_dtype.itemsize)
        placement = dcp_on_homes(tiles, world_size, given_home, cost_model=cost_model, max_stages=max_stages,
                                 sizes=sizes, effort=effort)
    else:
        placement = _strategies()[strategy](
            tiles, world_size, cost_model=cost_model, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, element_size=dtype.itemsize, grad_element_size=grad_comm_dtype.itemsize,
            max_stages=max_stages, effort=effort, memory_slack=memory_slack)
    plan = build_plan(tiles, placement, strategy=strategy, world_size=world_size, num_q_heads=num_q_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                      mask_signature=mask_spec.signature(), cost_model=cost_model, grad_comm_dtype=grad_comm_dtype)
    if check:
        check_plan(plan)
    _cache[key] = plan
    _cache_bytes[key] = _nbytes(plan)
    while len(_cache) > _CACHE_SIZE or (len(_cache) > 1 and sum(_cache_bytes.values()) > _CACHE_BYTES):
        del _cache_bytes[_cache.popitem(last=False)[0]]
    return plan


def _check_homes_from(homes_from, world_size: int, total_len: int, block_size, strategy: str) -> int:
    """make_plan's ``homes_from`` checked against the other arguments; returns the block size to plan at."""
    if not isinstance(homes_from, Plan):
        raise TypeError(f"homes_from must be a Plan from make_plan (the plan whose block homes to keep), "
                        f"got {type(homes_from).__name__}")
    if strategy != "dcp":
        raise ValueError(f"homes_from plans on another plan's homes with dcp's tile placement; got strategy="
                         f"{strategy!r} (ring, zigzag and allgather place every mask on the same homes already: "
                         "plan each mask with that strategy)")
    if homes_from.world_size != world_size or homes_from.total_len != total_len:
        raise ValueError(f"homes_from was planned for {homes_from.total_len} tokens on {homes_from.world_size} ranks, "
                         f"this mask has {total_len} tokens on {world_size}: plans sharing homes cover one batch "
                         "on one group of ranks")
    if block_size is not None and block_size != homes_from.block_size:
        raise ValueError(f"block_size={block_size!r} but homes_from has block_size={homes_from.block_size}: plans "
                         "sharing homes share the block size (leave block_size out to take homes_from's)")
    return homes_from.block_size


def _nbytes(obj) -> int:
    """Bytes of the tensors and arrays in ``obj`` (a Plan: its tensor fields, ``local_blocks`` and its
    schedule's tables). A Plan's other fields (sizes, names, the cost model, the search record) hold
    none and are not walked: that walk was ~0.1 ms of a 5 ms plan."""
    if isinstance(obj, torch.Tensor):
        return obj.element_size() * obj.numel()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(item) for item in obj)
    if isinstance(obj, CommSchedule):
        return _nbytes((obj.fwd, obj.bwd))
    if isinstance(obj, Plan):
        return sum(_nbytes(getattr(obj, name)) for name in _plan_array_fields())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(_nbytes(getattr(obj, field.name)) for field in dataclasses.fields(obj))
    return 0


@functools.lru_cache(maxsize=1)
def _plan_array_fields() -> tuple:
    """The Plan fields that may hold tensors: those not typed as a scalar, a name, a dtype, the cost
    model or the search record."""
    skip = {"str", "int", "float", "bool", "torch.dtype", "CostModel", "tuple"}
    return tuple(f.name for f in dataclasses.fields(Plan) if f.type not in skip or f.name == "local_blocks")


def clear_plan_cache() -> None:
    """Forget every cached plan, and the TileSets converted from block masks with their memos
    (merged copies, crossing counts, segments): the next plan of a mask starts from scratch."""
    _cache.clear()
    _cache_bytes.clear()
    forget_tile_sets()


def build_plan(tiles: TileSet, placement: Placement, *, strategy: str, world_size: int, num_q_heads: int,
               num_kv_heads: int, head_dim: int, dtype: torch.dtype, mask_signature: str,
               cost_model: CostModel, grad_comm_dtype: torch.dtype = torch.float32) -> Plan:
    """Turn a strategy's Placement into a Plan (stages compacted, schedule derived with its relays)."""
    home = np.asarray(placement.block_home, dtype=np.int64)
    # (int64 or int32 tile columns, as the placement has them: only a derivation below needs int64)
    rank = int_array(placement.tile_rank)
    planned_stage = int_array(placement.tile_stage)
    remap, num_stages, renumbered = stage_renumbering(planned_stage)
    stage = planned_stage if not renumbered else remap[planned_stage]
    relay = as_relay_table(placement.kv_relay)
    schedule, stage_bwd = placement.schedule, placement.tile_stage_bwd
    if stage_bwd is None:
        # backward stages by what each tile sends and needs (planner/stages_bwd.py), local tiles spread
        # where the backward's transfers would be exposed; the forward stages stay as planned
        sizes = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     element_size=dtype.itemsize, grad_element_size=grad_comm_dtype.itemsize)
        rank, stage = (np.asarray(x, dtype=np.int64) for x in (rank, stage))
        done = finish_placement(tiles, home, rank, stage, world_size=world_size, cost_model=cost_model, sizes=sizes,
                                kv_relay=relay if relay.shape[0] else None, spread_forward=False, score=False)
        schedule, stage_bwd = done.schedule, done.tile_stage_bwd
    elif schedule is None or schedule.num_stages != num_stages or renumbered:
        # compaction renumbers stages monotonically, so a relay's "held strictly before" still holds
        schedule = derive_schedule(home, tiles.q, tiles.kv, rank, stage, num_blocks=tiles.num_blocks,
                                   num_stages=num_stages, world_size=world_size, kv_relay=relay,
                                   tile_stage_bwd=stage_bwd)
    schedule = schedule.in_wire_order()
    as32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
    local = tuple(as32(part) for part in positions_by_key(home, world_size))
    tile_q, tile_kv, tile_full = tiles.index_tensors()
    return Plan(
        strategy=strategy, world_size=world_size, total_len=tiles.total_len, block_size=tiles.block_size,
        num_blocks=tiles.num_blocks, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=dtype, grad_comm_dtype=grad_comm_dtype, mask_signature=mask_signature, block_home=as32(home),
        local_blocks=local,
        tile_q=tile_q, tile_kv=tile_kv, tile_full=tile_full,
        tile_rank=as32(rank), tile_stage=as32(stage), num_stages=num_stages, schedule=schedule,
        tile_pairs=torch.from_numpy(np.asarray(tiles.pairs, dtype=np.int64)),  # (the TileSet's: both only read it)
        cost_model=cost_model, kv_relay=as32(relay),
        tile_stage_bwd=as32(stage_bwd),
        search=tuple((str(step), None if t is None else float(t)) for step, t in placement.search))
