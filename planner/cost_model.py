"""Cost model: H200 compute and NVLink / 400 Gb/s interconnect, used to score plans.

Notation (docs/design.md): P ranks, a plan's stages s = 0..S-1, transfers of stage s in 0..S.

Model (stated once, used by ``Plan.stats()`` and by the dcp stage splitter):

* Compute: forward FLOPs of a tile = ``4 * D * Hq * pairs`` (QK^T and PV, 2 FLOPs per MAC, over the
  exact unmasked pair count). Backward = ``bwd_flops_factor`` (2.5) x forward. Rates are attainable
  attention throughputs on one H200 (bf16 dense peak ~990 TFLOP/s; FlashAttention-3 class kernels
  reach ~500 TFLOP/s forward), so time = FLOPs / ``fwd_rate``.
* Exchanges, as the executor runs them (blockattn/distributed.py): exchange j (j = 0..S) carries the
  *inputs* of stage j + 1 (Q / KV forward, DO backward: schedule rows of stage j + 1) and the
  *results* computed in stage j - 1 (OUT / DQ / DKV: rows of stage j); it is posted before stage j
  computes and overlaps that compute. So a partial computed in the last stage travels in exchange
  S, after all compute: exposed.
* Communication of rank r in exchange j: bytes it sends and bytes it receives, split into intra-node
  and inter-node. Links are full duplex and NVLink and the NIC work in parallel, so
  ``comm(r, j) = max(send_intra, recv_intra) / intra_bw`` vs the same for inter-node, whichever is
  larger, plus one latency (the inter-node one if any inter-node row exists).
* Overlap: ``time(r) = sum_{j<S} max(compute(r, j), comm(r, j)) + comm(r, S)``. The plan's time is
  the max over ranks. This is per-rank: it does not model a rank waiting on a slower peer, so it is
  a lower estimate of lock-step execution but exact for the bytes and FLOPs.
* Lower bound: total FLOPs / (P x rate), i.e. perfect balance and fully hidden communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .comm_loops import exchange_times
from .schedule import KIND_DO, KIND_KV, KIND_NAMES, KIND_Q, bytes_per_token
from .spread_loops import overlapped_times

# Q, KV, DO travel one exchange before their stage; by kind (a lookup: np.isin per call costs more
# than the rest of stage_comm_time)
_IS_INPUT = np.isin(np.arange(len(KIND_NAMES)), (KIND_Q, KIND_KV, KIND_DO))
_IS_INPUT_INT = _IS_INPUT.astype(np.int64)
BWD_FLOPS_RATIO = 2.5  # backward FLOPs / forward FLOPs (dQ, dK, dV + recompute of P)


@dataclass(frozen=True)
class Topology:
    """Interconnect: consecutive ranks ``[k * ranks_per_node, (k + 1) * ranks_per_node)`` share a node.

    Bandwidths are bytes/s per GPU per direction, latencies seconds per stage transfer.
    Defaults: H200 HGX (NVLink 4, ~450 GB/s per direction) and one 400 Gb/s NIC per GPU.
    """

    ranks_per_node: int = 8
    intra_bw: float = 450e9
    inter_bw: float = 50e9
    intra_lat: float = 5e-6
    inter_lat: float = 15e-6

    def __post_init__(self):
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"Topology.ranks_per_node must be a positive int, got {self.ranks_per_node!r}")
        for name in ("intra_bw", "inter_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Topology.{name} must be > 0 bytes/s, got {getattr(self, name)!r}")
        for name in ("intra_lat", "inter_lat"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Topology.{name} must be >= 0 seconds, got {getattr(self, name)!r}")

    def node_of(self, rank):
        """Node index of rank(s)."""
        return np.asarray(rank) // self.ranks_per_node

    def key(self) -> tuple:
        return (self.ranks_per_node, float(self.intra_bw), float(self.inter_bw),
                float(self.intra_lat), float(self.inter_lat))


def _check_positive_number(name: str, value, unit: str) -> None:
    """TypeError unless ``value`` is a real number (not a bool), ValueError unless it is finite and > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number ({unit}), got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0 ({unit}), got {value!r}")


# dcp's balancer: donors shed compute until within this fraction of the mean (the target is 5%)
BALANCE_SLACK = 0.02


@dataclass(frozen=True)
class CostModel:
    """Compute rates plus a Topology (see module docstring). ``make_plan(cost_model=...)`` takes one for
    another GPU or kernel: ``fwd_rate`` is the attention forward's attained FLOP/s on one GPU and
    ``bwd_flops_factor`` the backward's time over the forward's for the same tiles (2.5: its FLOPs
    over the forward's at the same rate); ``from_kernel_tflops`` sets both from measured TFLOP/s."""

    topology: Topology = Topology()
    fwd_rate: float = 500e12  # attainable attention FLOP/s forward on one H200
    bwd_flops_factor: float = BWD_FLOPS_RATIO  # backward time / forward time (2.5: FLOPs ratio, same rate)
    # Not used in scoring: the dcp balancer's fast per-rank estimate, max(compute, transfers) +
    # balance_overlap * min(compute, transfers) (planner/balance.py ``overlap``), where the staged
    # model above is too costly to evaluate per candidate move.
    balance_overlap: float = 0.0
    # ... and with balance_duplex, a rank's transfers as each link's busier direction (sends or receives)
    # instead of their sum (planner/balance.py ``duplex``).
    balance_duplex: bool = False
    # ... and with balance_level_nodes, a node over the balancer's cap then levels its own ranks
    # (planner/balance.py ``level_nodes``).
    balance_level_nodes: bool = False
    # ... and with balance_priced_rows (default), on one node rows go to a kv-home only in pieces no
    # dearer a tile than a rectangle (planner/balance_moves.py ``priced_rows``); dcp re-plans without it.
    balance_priced_rows: bool = True
    # ... and with balance_slack, donors shed until within this fraction of the mean compute (planner/balance.py
    # ``slack``); dcp plans one node's merged blocks with less (planner/first_pass.py ONE_NODE_MERGED_SLACK).
    balance_slack: float = BALANCE_SLACK
    # Not a balancer setting but dcp's too: with home_memory_slack, the FCP packings of dcp's starts pass it
    # to planner/fcp.py ``fcp_home`` ("fcp", "fcp-docs", the "hierarchical" ones' nodes), which may then give
    # a rank (a node) up to this fraction of the mean blocks more than the mean; dcp re-plans its slow plans
    # with make_plan's ``memory_slack`` here (planner/dcp.py MEMORY_REPLAN_FROM).
    home_memory_slack: float = 0.0

    def __post_init__(self):
        if not isinstance(self.topology, Topology):
            raise TypeError(f"CostModel.topology must be a blockattn.planner.Topology, got "
                            f"{type(self.topology).__name__}")
        _check_positive_number("CostModel.fwd_rate", self.fwd_rate, "FLOP/s, e.g. 500e12")
        _check_positive_number("CostModel.bwd_flops_factor", self.bwd_flops_factor, "e.g. 2.5")
        if not (math.isfinite(self.balance_overlap) and self.balance_overlap >= 0):
            raise ValueError(f"CostModel.balance_overlap must be >= 0, got {self.balance_overlap!r}")
        if not (math.isfinite(self.balance_slack) and self.balance_slack >= 0):
            raise ValueError(f"CostModel.balance_slack must be >= 0, got {self.balance_slack!r}")
        if not (math.isfinite(self.home_memory_slack) and self.home_memory_slack >= 0):
            raise ValueError(f"CostModel.home_memory_slack must be >= 0, got {self.home_memory_slack!r}")

    @classmethod
    def from_kernel_tflops(cls, fwd_tflops: float, bwd_tflops: float, *,
                           topology: Topology | None = None) -> "CostModel":
        """The cost model of a GPU whose attention kernels were measured at ``fwd_tflops`` forward and
        ``bwd_tflops`` backward (TFLOP/s, the backward counted as BWD_FLOPS_RATIO x the forward's FLOPs,
        as bench/bench_kernels.py and FlashAttention's benchmarks report it), on ``topology`` (default
        ``Topology()``)."""
        _check_positive_number("fwd_tflops", fwd_tflops, "TFLOP/s")
        _check_positive_number("bwd_tflops", bwd_tflops, "TFLOP/s")
        return cls(topology=Topology() if topology is None else topology, fwd_rate=float(fwd_tflops) * 1e12,
                   bwd_flops_factor=BWD_FLOPS_RATIO * float(fwd_tflops) / float(bwd_tflops))

    def plain(self) -> "CostModel":
        """This cost model with the dcp balancer's settings (``balance_*``) and ``home_memory_slack`` at their
        defaults: they are dcp's internal search settings (its re-plans change them), not part of a cost
        model a caller gives."""
        return replace(self, balance_overlap=0.0, balance_duplex=False, balance_level_nodes=False,
                       balance_priced_rows=True, balance_slack=BALANCE_SLACK, home_memory_slack=0.0)

    def is_plain(self) -> bool:
        """Whether dcp's internal search settings (``balance_*``, ``home_memory_slack``) are their defaults
        (``plain``)."""
        return self == self.plain()

    def key(self) -> tuple:
        """The cache key of what scores a plan: the topology's and the compute rates."""
        return self.topology.key() + (float(self.fwd_rate), float(self.bwd_flops_factor))

    def tile_flops(self, pairs, *, num_q_heads: int, head_dim: int) -> np.ndarray:
        """Forward FLOPs of tiles with ``pairs`` unmasked (q, k) pairs."""
        return 4.0 * head_dim * num_q_heads * np.asarray(pairs, dtype=np.float64)

    def stage_comm_time(self, table: np.ndarray, nbytes: np.ndarray, world_size: int, num_stages: int) -> np.ndarray:
        """float64 [P, S + 1]: communication time of every rank in every exchange (module docstring:
        an input row of stage s travels in exchange s - 1, a result row of stage s in exchange s)."""
        topo = self.topology
        P, S1 = world_size, num_stages + 1
        src, dst = table[:, 1], table[:, 2]
        stage = table[:, 0] - _IS_INPUT[table[:, 3]]  # the exchange index
        inter = topo.node_of(src) != topo.node_of(dst)
        nbytes = nbytes.astype(np.float64)
        size = P * S1
        # one bincount per (end, link): bytes in the low half of the bins, NIC rows in the high half
        at_src = src * S1 + stage + inter.astype(np.int64) * size
        at_dst = at_src + (dst - src) * S1
        busiest = np.maximum(np.bincount(at_src, weights=nbytes, minlength=2 * size),
                             np.bincount(at_dst, weights=nbytes, minlength=2 * size)).reshape(2, P, S1)
        rows = (np.bincount(at_src, minlength=2 * size) + np.bincount(at_dst, minlength=2 * size)).reshape(2, P, S1) > 0
        return self.link_time(busiest, rows)

    def table_comm_time(self, table: np.ndarray, block_len: np.ndarray, world_size: int, num_stages: int,
                        **sizes) -> np.ndarray:
        """``stage_comm_time`` of int64 schedule rows ``table`` [m, 5] with their payload bytes
        (planner/schedule.py ``row_bytes`` of ``block_len`` and ``sizes``), in one compiled pass
        (planner/comm_loops.py); the same floats."""
        topo = self.topology
        return exchange_times(np.ascontiguousarray(table, dtype=np.int64), np.asarray(block_len, dtype=np.int64),
                              bytes_per_token(**sizes), _IS_INPUT_INT, topo.ranks_per_node, float(topo.intra_bw),
                              float(topo.inter_bw), float(topo.intra_lat), float(topo.inter_lat), world_size,
                              num_stages)

    def link_time(self, busiest: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Transfer time from ``busiest`` [2, ...] bytes (the busier of send and receive; NVLink, then
        NIC) and ``rows`` [2, ...] (bool: any row on that link): the slower link, plus one latency, the
        inter-node one if any row crosses nodes."""
        topo = self.topology
        lat = np.where(rows[1], topo.inter_lat, np.where(rows[0], topo.intra_lat, 0.0))
        return np.maximum(busiest[0] / topo.intra_bw, busiest[1] / topo.inter_bw) + lat

    def step_times(self, compute: np.ndarray, comm_fwd: np.ndarray, comm_bwd: np.ndarray,
                   compute_bwd: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per-rank forward and backward time [P]: ``compute`` [P, S] forward seconds per stage,
        ``compute_bwd`` the same per backward stage (default: the forward's; the backward takes
        ``bwd_flops_factor`` times as long), ``comm_*`` [P, S + 1] from stage_comm_time."""
        compute_bwd = compute if compute_bwd is None else compute_bwd
        return (self.overlapped_time(compute, comm_fwd),
                self.overlapped_time(compute_bwd * self.bwd_flops_factor, comm_bwd))

    @staticmethod
    def overlapped_time(compute: np.ndarray, comm: np.ndarray) -> np.ndarray:
        """Per-rank time [P] from compute [P, S] and comm [P, S + 1] per exchange: exchange j < S
        overlaps stage j's compute, exchange S (the last stage's partials) follows it (compiled:
        planner/spread_loops.py ``overlapped_times``, the floats of ``np.maximum(compute, comm[:, :-1])
        .sum(axis=1) + comm[:, -1]``)."""
        return overlapped_times(np.ascontiguousarray(compute, dtype=np.float64),
                                np.ascontiguousarray(comm, dtype=np.float64))
