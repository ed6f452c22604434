"""KV fan-out on one node: a block many ranks read is forwarded by the readers that got it first.

Notation (docs/design.md, planner/relay.py): P ranks on one node, S stages; a *receive group*
(r, b, first, last) is rank r's remote KV block b, received in the exchange before stage ``first``;
relay rows are ``(block, dst, src)``; a *proxy* is a reader that forwards the block to others.

Why: on one node every reader gets a block's KV from its home, so the home of a block every rank
reads (a shared question, causal_blockwise's first block, a long document's first blocks) sends it
P - 1 times through its one NVLink port in the exchanges before the readers' first stages. On 32
ranks of one node a question's homes sent 31 copies each behind stage 0's compute (traced, seed-0
shared-question batch: exchange 0 at 157 us against 51 us of compute). Here the block's earliest
readers, one per FANOUT_DEGREE + 1 readers, get it from the home and each forwards it to
FANOUT_DEGREE others over its own port; the backward mirrors the tree (a reader's dK/dV partial
goes to its proxy, which sends one sum home: planner/schedule.py ``dkv_routes``).

A proxy must hold the block before the stage a reader needs it in (the schedule's relay rule), so
a reader that needs it in its proxy's stage either keeps getting it from the home or has its tiles
of the block delayed one stage: the choice planner/relay.py makes for its node proxies, weighed by
its scorer (``RelayScorer.weigh``: no delays, every delay, the per-rank mix). dcp keeps the fastest
where it beats the plan (planner/dcp.py ``FANOUT``).
"""

from __future__ import annotations

import numpy as np

from .cost_model import CostModel
from .placement import Placement, run_heads
from .relay import RelayCandidates, RelayScorer, delay_limit, relay_groups
from .schedule import as_relay_table
from .tiles import TileSet

# Readers a proxy forwards a block to. 32 ranks of one node, three draws' batches (63 plans, with
# dcp's dealt widely-read blocks): 1 and 2 lose the seed-0 shared-question gain (1.081 -> 1.119x
# the bound), 5 gains 0.2% there and loses 0.6% on a causal batch; 3 kept.
FANOUT_DEGREE = 3
FANOUT_MIN_READERS = 8  # blocks read by fewer ranks keep coming from their home


def fanout_candidates(home: np.ndarray, kv_groups, *, degree: int = FANOUT_DEGREE,
                      min_readers: int = FANOUT_MIN_READERS) -> RelayCandidates | None:
    """The non-proxy readers of every KV block that at least ``min_readers`` ranks read, with their
    proxies (RelayCandidates, sorted by block, first need, rank): a block's n readers in order of first
    need (then rank), the first ceil(n / (degree + 1)) of them proxies, the others dealt to them in
    turn, so each proxy serves at most ``degree``. None if no block qualifies."""
    r, b, first, _ = kv_groups
    if degree < 1:
        raise ValueError(f"degree must be >= 1, got {degree}")
    if r.size == 0:
        return None
    readers = np.bincount(b, minlength=home.size)
    idx = np.flatnonzero(readers[b] >= max(min_readers, 2))
    if idx.size == 0:
        return None
    idx = idx[np.lexsort((r[idx], first[idx], b[idx]))]
    head = run_heads(b[idx])
    start = np.flatnonzero(head)
    of_block = np.cumsum(head) - 1
    place = np.arange(idx.size) - start[of_block]  # among the block's readers
    proxies = (-(-readers[b[idx[start]]] // (degree + 1)))[of_block]
    member = place >= proxies
    proxy_idx = idx[start[of_block] + (place - proxies) % proxies][member]
    idx = idx[member]
    return RelayCandidates(block=b[idx], dst=r[idx], proxy=r[proxy_idx], first=first[idx],
                           proxy_first=first[proxy_idx], group=idx)


def fanout_variants(tiles: TileSet, placement: Placement, *, world_size: int, cost_model: CostModel,
                    max_stages: int, sizes: dict, degree: int = FANOUT_DEGREE,
                    min_readers: int = FANOUT_MIN_READERS) -> list[Placement]:
    """Every fan-out variant of ``placement`` (one node, without relays) the scorer weighs (module
    docstring), as scored Placements with their relay tables; none on several nodes (the node relays
    of planner/relay.py serve them) or where no block qualifies or no reader can be relayed."""
    if world_size > cost_model.topology.ranks_per_node or tiles.num_tiles == 0:
        return []
    if as_relay_table(placement.kv_relay).shape[0]:
        raise ValueError("fanout_variants expects a placement without relays (its kv_relay is already set)")
    home = np.asarray(placement.block_home, dtype=np.int64)
    rank = np.asarray(placement.tile_rank, dtype=np.int64)
    groups = relay_groups(tiles, home, rank, placement)
    _, num_stages, _, kv_groups = groups
    cand = fanout_candidates(home, kv_groups, degree=degree, min_readers=min_readers)
    if cand is None:
        return []
    score = RelayScorer.of(tiles, placement, home, rank, groups, world_size=world_size, cost_model=cost_model,
                           sizes=sizes)
    return [v.placement(home, rank, world_size) for v in score.weigh(cand, delay_limit(num_stages, max_stages))]


def add_fanout(tiles: TileSet, placement: Placement, *, world_size: int, cost_model: CostModel, max_stages: int,
               sizes: dict) -> Placement | None:
    """The fastest of ``fanout_variants``, whether or not it beats ``placement`` (dcp weighs it after its
    backward deferral); None where there is none."""
    variants = fanout_variants(tiles, placement, world_size=world_size, cost_model=cost_model,
                               max_stages=max_stages, sizes=sizes)
    return min(variants, key=lambda v: v.sim_time) if variants else None
