"""Plan: the frozen result of planning one batch (data placement, tile placement, stages, transfers).

Notation (docs/design.md): T tokens, B block size, nB blocks (last one short), P ranks, a tile is a
(q-block, kv-block) pair, S = num_stages. A rank's *local order* is its blocks ascending, each
block's tokens in order, so ``local_tokens(rank)`` is the row order of every per-rank tensor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from .cost_model import CostModel
from .placement import concatenated_ranges
from .schedule import BWD_KINDS, FWD_KINDS, KIND_NAMES, CommSchedule


@dataclass(frozen=True, eq=False)
class Plan:
    """A per-batch placement; see docs/design.md for the field table. Build with ``make_plan``."""

    strategy: str
    world_size: int
    total_len: int
    block_size: int
    num_blocks: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    mask_signature: str
    block_home: torch.Tensor  # int32 [nB]
    local_blocks: tuple  # P x int32 [n_r], ascending
    tile_q: torch.Tensor  # int32 [ntiles], sorted by (q, kv)
    tile_kv: torch.Tensor  # int32 [ntiles]
    tile_full: torch.Tensor  # bool [ntiles]
    tile_rank: torch.Tensor  # int32 [ntiles]
    tile_stage: torch.Tensor  # int32 [ntiles]
    num_stages: int
    schedule: CommSchedule
    tile_pairs: torch.Tensor  # int64 [ntiles] unmasked (q, k) pairs (FLOPs = 4*D*Hq*pairs)
    cost_model: CostModel = field(default_factory=CostModel)
    # int32 [m, 3] rows (block, dst, src): dst receives KV `block` from src, not the home (planner/relay.py)
    kv_relay: torch.Tensor = field(default_factory=lambda: torch.zeros((0, 3), dtype=torch.int32))
    # int32 [ntiles] backward stage of every tile (planner/stages_bwd.py backward_stages); None: the forward's
    tile_stage_bwd: torch.Tensor | None = None
    # dtype of the dQ / dK / dV partials on the wire (summed in fp32 at the home)
    grad_comm_dtype: torch.dtype = torch.float32
    # dcp: its search's steps, as (step, simulated fwd + bwd seconds of the plan kept after it), in the
    # order they ran (planner/dcp.py; None: not scored there, this plan's own time); how the plan was
    # found, not what it is, so not in ``fingerprint``. Empty for the other strategies
    search: tuple = ()

    def __post_init__(self):
        if self.tile_stage_bwd is None:
            object.__setattr__(self, "tile_stage_bwd", self.tile_stage)

    # ------------------------------------------------------------------ tokens and tensors
    @property
    def topology(self):
        return self.cost_model.topology

    def _check_rank(self, rank) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}) for this plan, got {rank!r}")
        return int(rank)

    @cached_property
    def _local_tokens(self) -> tuple:
        B, T = self.block_size, self.total_len
        result = []
        for blocks in self.local_blocks:
            starts = blocks.numpy().astype(np.int64) * B
            # token = block start + offset inside the block, blocks concatenated (last may be short)
            result.append(torch.from_numpy(concatenated_ranges(starts, np.minimum(T - starts, B))))
        return tuple(result)

    def local_tokens(self, rank: int) -> torch.Tensor:
        """int64 global token indices held by ``rank``, in local order."""
        return self._local_tokens[self._check_rank(rank)]

    def local_len(self, rank: int) -> int:
        """Number of tokens held by ``rank``."""
        return int(self._local_tokens[self._check_rank(rank)].numel())

    def shard(self, x: torch.Tensor, rank: int, *, dim: int = 0) -> torch.Tensor:
        """Rows of a global ``[T, ...]`` tensor (token axis ``dim``) held by ``rank``, in local order."""
        self._check_token_dim(x, dim, self.total_len, "shard")
        idx = self.local_tokens(rank).to(x.device)
        return x.index_select(dim, idx)

    def unshard(self, parts, *, group=None, dim: int = 0) -> torch.Tensor:
        """Reassemble the global tensor.

        ``unshard([part_0, ..., part_{P-1}])``: per-rank local tensors -> global order.
        ``unshard(local, group=g)``: collective over ``g`` (world size P, this rank = its group rank);
        every rank passes its own local tensor and gets the global tensor. Local sizes differ, so each
        rank pads to the largest local size (known from the plan) before ``all_gather``.
        """
        if group is None and isinstance(parts, torch.Tensor):
            raise TypeError("unshard(local_tensor) needs group=...; to unshard locally pass a list of P per-rank tensors")
        if group is not None:
            return self._unshard_collective(parts, group, dim)
        if not isinstance(parts, (list, tuple)) or len(parts) != self.world_size:
            n = len(parts) if isinstance(parts, (list, tuple)) else type(parts).__name__
            raise ValueError(f"unshard expects a list of {self.world_size} per-rank tensors, got {n}")
        for r, part in enumerate(parts):
            self._check_token_dim(part, dim, self.local_len(r), f"unshard part {r}")
        ref = parts[0]
        shape = list(ref.shape)
        shape[dim] = self.total_len
        out = torch.empty(shape, dtype=ref.dtype, device=ref.device)
        for r, part in enumerate(parts):
            out.index_copy_(dim, self.local_tokens(r).to(out.device), part.to(out.dtype))
        return out

    def _unshard_collective(self, local: torch.Tensor, group, dim: int) -> torch.Tensor:
        import torch.distributed as dist

        if not isinstance(local, torch.Tensor):
            raise TypeError(f"unshard(local, group=...) expects this rank's tensor, got {type(local).__name__}")
        size = dist.get_world_size(group)
        if size != self.world_size:
            raise ValueError(f"unshard: group has {size} ranks but the plan was made for {self.world_size}")
        rank = dist.get_rank(group)
        self._check_token_dim(local, dim, self.local_len(rank), f"unshard on rank {rank}")
        max_len = max(self.local_len(r) for r in range(size))
        moved = local.movedim(dim, 0).contiguous()
        padded = moved.new_zeros((max_len,) + tuple(moved.shape[1:]))
        padded[: moved.shape[0]] = moved
        gathered = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(gathered, padded, group=group)
        parts = [g[: self.local_len(r)].movedim(0, dim) for r, g in enumerate(gathered)]
        return self.unshard(parts, dim=dim)

    @staticmethod
    def _check_token_dim(x, dim: int, expect: int, what: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"{what}: dim={dim} out of range for a tensor of shape {tuple(x.shape)}")
        if x.shape[dim] != expect:
            raise ValueError(f"{what}: token axis {dim} has {x.shape[dim]} rows, the plan needs {expect} "
                             f"(tensor shape {tuple(x.shape)})")

    # ------------------------------------------------------------------ identity
    def fingerprint(self) -> str:
        """sha256 hex over every field but ``search`` (same on every process and Python hash seed)."""
        h = hashlib.sha256()
        scalars = (self.strategy, self.world_size, self.total_len, self.block_size, self.num_blocks,
                   self.num_q_heads, self.num_kv_heads, self.head_dim, str(self.dtype), self.mask_signature,
                   self.num_stages, self.cost_model.topology.key(), self.cost_model.fwd_rate,
                   self.cost_model.bwd_flops_factor)
        if self.grad_comm_dtype != torch.float32:  # only then, so fp32 plans keep their fingerprints
            scalars += (str(self.grad_comm_dtype),)
        h.update(repr(scalars).encode())
        tensors = [self.block_home, self.tile_q, self.tile_kv, self.tile_full, self.tile_rank, self.tile_stage,
                   self.tile_pairs, self.schedule.fwd, self.schedule.bwd, *self.local_blocks]
        if self.kv_relay.numel():  # only when relays exist, so relay-free plans keep their fingerprints
            tensors.append(self.kv_relay)
        tensors.append(self.tile_stage_bwd)
        for t in tensors:
            arr = np.ascontiguousarray(t.numpy())
            h.update(f"{arr.dtype.str}{arr.shape}".encode())
            h.update(arr.astype(arr.dtype.newbyteorder("<")).tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------------ cost
    def transfer_bytes(self, direction: str) -> np.ndarray:
        """int64 bytes of every row of the ``"fwd"`` / ``"bwd"`` table."""
        return self.schedule.bytes(self.schedule.table(direction), self)

    @cached_property
    def _stats(self) -> dict:
        P, S, cm = self.world_size, self.num_stages, self.cost_model
        rank = self.tile_rank.numpy().astype(np.int64)
        stage = self.tile_stage.numpy().astype(np.int64)
        stage_bwd = self.tile_stage_bwd.numpy().astype(np.int64)
        flops = cm.tile_flops(self.tile_pairs.numpy(), num_q_heads=self.num_q_heads, head_dim=self.head_dim)
        compute = np.bincount(rank * S + stage, weights=flops, minlength=P * S).reshape(P, S) / cm.fwd_rate
        compute_bwd = np.bincount(rank * S + stage_bwd, weights=flops, minlength=P * S).reshape(P, S) / cm.fwd_rate
        tokens = [self.local_len(r) for r in range(P)]
        result = {"strategy": self.strategy, "world_size": P, "num_stages": S, "tokens": tokens,
                  "flops_fwd": np.bincount(rank, weights=flops, minlength=P).tolist()}
        comm = {}
        node_of = cm.topology.node_of
        for direction in ("fwd", "bwd"):
            table = self.schedule.table(direction).numpy().astype(np.int64)
            nbytes = self.transfer_bytes(direction)
            result[f"bytes_inter_node_{direction}"] = int(nbytes[node_of(table[:, 1]) != node_of(table[:, 2])].sum())
            result[f"bytes_sent_{direction}"] = np.bincount(table[:, 1], weights=nbytes, minlength=P).astype(np.int64).tolist()
            result[f"bytes_recv_{direction}"] = np.bincount(table[:, 2], weights=nbytes, minlength=P).astype(np.int64).tolist()
            comm[direction] = cm.stage_comm_time(table, nbytes, P, S)
        times = cm.step_times(compute, comm["fwd"], comm["bwd"], compute_bwd)
        for direction, factor, per_rank in zip(("fwd", "bwd"), (1.0, cm.bwd_flops_factor), times):
            result[f"sim_time_{direction}_per_rank"] = per_rank.tolist()
            result[f"sim_time_{direction}"] = float(per_rank.max()) if P else 0.0
            result[f"lower_bound_{direction}"] = float(flops.sum()) * factor / (P * cm.fwd_rate)
        bound = result["lower_bound_fwd"] + result["lower_bound_bwd"]
        result["sim_over_bound"] = (result["sim_time_fwd"] + result["sim_time_bwd"]) / bound if bound > 0 else 1.0
        per_rank_flops = np.asarray(result["flops_fwd"])
        mean = per_rank_flops.mean()
        result["compute_imbalance"] = float(per_rank_flops.max() / mean) if mean > 0 else 1.0
        tok = np.asarray(tokens, dtype=np.float64)
        result["memory_imbalance"] = float(tok.max() / tok.mean()) if tok.mean() > 0 else 1.0
        result["bytes_fwd"] = int(sum(result["bytes_sent_fwd"]))
        result["bytes_bwd"] = int(sum(result["bytes_sent_bwd"]))
        counts = {}
        for direction, kinds in (("fwd", FWD_KINDS), ("bwd", BWD_KINDS)):
            t = self.schedule.table(direction)
            for k in kinds:
                counts[KIND_NAMES[k]] = int((t[:, 3] == k).sum())
        result["transfers"] = counts
        result["kv_relays"] = int(self.kv_relay.shape[0])
        return result

    def stats(self) -> dict:
        """Per-rank ``tokens, flops_fwd, bytes_sent_fwd, bytes_recv_fwd, bytes_sent_bwd, bytes_recv_bwd``
        (lists over ranks) and ``sim_time_fwd / sim_time_bwd`` (max over ranks, seconds, see
        planner/cost_model.py), ``lower_bound_fwd / _bwd`` (total FLOPs over P ranks at the compute rate),
        ``sim_over_bound`` (fwd + bwd simulated time over fwd + bwd bound: 1.0 is ideal), imbalances, transfer counts and
        ``kv_relays`` (KV transfers whose source is a relay, not the home). Bytes are the sums of
        the CommSchedule rows, i.e. exactly what the executor sends; ``bytes_inter_node_fwd / _bwd``
        are those of rows between nodes (the slow links; a relay's NVLink hop counts in ``bytes_*``
        only)."""
        return {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                for k, v in self._stats.items()}

    def explain(self) -> str:
        """Short text summary: balance, bytes, stages, simulated time."""
        s = self._stats
        mb = 1 / 2**20

        def inter(direction):  # the slow links' share, on several nodes
            if self.world_size <= self.topology.ranks_per_node:
                return ""
            return f" ({s[f'bytes_inter_node_{direction}'] * mb:.1f} between nodes)"

        lines = [
            f"Plan[{self.strategy}] P={self.world_size} T={self.total_len} B={self.block_size} "
            f"blocks={self.num_blocks} tiles={self.tile_q.numel()} stages={self.num_stages}",
            f"  memory: tokens/rank min {min(s['tokens'])} max {max(s['tokens'])} (max/mean {s['memory_imbalance']:.3f})",
            f"  compute: max/mean {s['compute_imbalance']:.3f}, total {sum(s['flops_fwd']) / 1e12:.3f} TFLOP fwd",
            f"  bytes: fwd {s['bytes_fwd'] * mb:.1f} MiB{inter('fwd')}, bwd {s['bytes_bwd'] * mb:.1f} MiB{inter('bwd')} "
            f"(gradient partials in {str(self.grad_comm_dtype).removeprefix('torch.')}), "
            f"transfers {s['transfers']}, KV relayed inside nodes {s['kv_relays']}",
            f"  sim time ({self._model_name()}): fwd {s['sim_time_fwd'] * 1e3:.3f} ms (lower bound {s['lower_bound_fwd'] * 1e3:.3f}),"
            f" bwd {s['sim_time_bwd'] * 1e3:.3f} ms (lower bound {s['lower_bound_bwd'] * 1e3:.3f})",
        ]
        if self.search:
            lines.append("  search (fwd + bwd over the bound): "
                         + ", ".join(f"{step} {ratio:.3f}" for step, ratio in self.search_over_bound()))
        return "\n".join(lines)

    def _model_name(self) -> str:
        """The cost model ``explain`` names: the default H200 rates, or the ones given."""
        cm, default = self.cost_model, CostModel()
        if (cm.fwd_rate, cm.bwd_flops_factor) == (default.fwd_rate, default.bwd_flops_factor):
            return "H200 model"
        return f"model at {cm.fwd_rate / 1e12:.4g} TFLOP/s fwd, bwd {cm.bwd_flops_factor:.3g}x fwd"

    def search_over_bound(self) -> list:
        """``search`` as [step, fwd + bwd time of the plan kept after it over the lower bound] (a step
        with no time of its own: this plan's)."""
        s = self._stats
        bound = s["lower_bound_fwd"] + s["lower_bound_bwd"]
        return [[step, s["sim_over_bound"] if seconds is None else seconds / bound] for step, seconds in self.search]

    def __repr__(self) -> str:
        return (f"Plan(strategy={self.strategy!r}, world_size={self.world_size}, total_len={self.total_len}, "
                f"block_size={self.block_size}, tiles={self.tile_q.numel()}, stages={self.num_stages})")
