"""CommSchedule: every transfer a Plan implies, derived once from its placement.

Notation (docs/design.md): P ranks, nB blocks of B tokens (last one short), a tile (qb, kb) runs on
``tile_rank`` in ``tile_stage``; ``block_home[b]`` owns the q, k, v, out and gradients of block b.

Tables are int32 ``[m, 5]`` with columns ``(stage, src, dst, kind, block)``, sorted
lexicographically; that order is the wire order, so a sender and its receiver enumerate the
same rows for their (stage, peer) in the same sequence.

Rules (the executor and ``Plan.stats()`` both follow exactly these rows):

* Q / KV (forward): a rank receives each remote block its tiles read, once, in the first stage
  that needs it. Q always comes from the block's home; KV comes from the home unless the plan's
  relay table ``kv_relay`` (rows ``(block, dst, src)``, planner/relay.py) names another source,
  which must hold the block strictly before that stage (home, or received in an earlier stage).
  A *transit* source (one that computes no tile of the block) receives it from the home one stage
  before the earliest of its relay rows needs it: a KV row no tile asks for.
* OUT: one partial (out, lse) per remote q-block the rank computed tiles of, sent to the home at
  ``last compute stage + 1`` (may equal ``num_stages``).
* Backward stages: the backward runs the same S stages, but each tile has its own backward stage
  (``tile_stage_bwd``, planner/stages_bwd.py ``backward_stages``), since every forward input is
  already resident then. Backward first / last stages below are over those.
* DO (backward): dO + lse + delta of such a q-block, home -> rank, at its first backward stage
  (never stage 0).
* DQ / DKV (backward): partial gradients of remote q-blocks / kv-blocks (in the plan's
  ``grad_comm_dtype``, summed in fp32) back to the home at ``last backward stage + 1``. Q/KV received
  in the forward are kept, never re-fetched.
* DKV reduce tree (mirror of a relay): a rank that got KV b from a *proxy* p (a rank with tiles of b
  that got it from the home or from a transit source) sends its dK/dV partial to p instead, at
  ``last + 1``, when that leaves p room to forward the sum: p sends on at
  ``max(last_p + 1, max over such children (last_child + 2))`` <= num_stages. A rank that got b from
  a transit source t sends its partial (or its sum) through t, which has none of its own and
  forwards it home one stage after the last arrival, when that is <= num_stages. Otherwise a child
  sends home.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .comm_loops import dkv_routes as comm_dkv_routes
from .comm_loops import relay_free_rows, relayed_kv_rows
from .group_loops import group_stages, group_tiles
from .jit import read_only_int64
from .sort_loops import rows_in_wire_order
from .tile_loops import covered_rows_and_columns, real_groups

KIND_Q, KIND_KV, KIND_OUT, KIND_DO, KIND_DQ, KIND_DKV = range(6)
KIND_NAMES = ("Q", "KV", "OUT", "DO", "DQ", "DKV")
FWD_KINDS = (KIND_Q, KIND_KV, KIND_OUT)
BWD_KINDS = (KIND_DO, KIND_DQ, KIND_DKV)
COLUMNS = ("stage", "src", "dst", "kind", "block")


def payload_bytes(kind, block_len, *, num_q_heads: int, num_kv_heads: int, head_dim: int, element_size: int,
                  grad_element_size: int = 4):
    """Bytes of one transfer of ``kind`` for a block of ``block_len`` valid tokens (numpy-vectorized);
    -1 for an unknown kind. Every payload is linear in the token count (``bytes_per_token``)."""
    rows = np.asarray(block_len, dtype=np.int64)
    per_token = bytes_per_token(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                element_size=element_size, grad_element_size=grad_element_size)
    if isinstance(kind, (int, np.integer)) and 0 <= kind < per_token.size:
        return per_token[kind] * rows  # (one kind for every block: the common call, ~3x faster)
    kind = np.asarray(kind, dtype=np.int64)
    valid = (kind >= 0) & (kind < per_token.size)
    return np.where(valid, per_token[np.where(valid, kind, 0)] * rows, -1)


def kv_block_bytes(block_len, **sizes) -> np.ndarray:
    """Each block's KV payload in bytes, as float64 (the weight the placement heuristics price a read
    or a cut block by); ``sizes`` as ``payload_bytes``' keywords."""
    return payload_bytes(KIND_KV, block_len, **sizes).astype(np.float64)


@functools.lru_cache(maxsize=64)
def bytes_per_token(*, num_q_heads: int, num_kv_heads: int, head_dim: int, element_size: int,
                    grad_element_size: int = 4) -> np.ndarray:
    """int64 [6], read-only: bytes per token of each transfer kind (KIND_Q .. KIND_DKV).

    Activations travel in the model dtype (``element_size`` bytes); lse and delta are fp32; the
    gradient partials dQ / dK / dV travel in the plan's ``grad_comm_dtype`` (``grad_element_size``
    bytes, fp32 by default), as the executor sends them."""
    q_tok = num_q_heads * head_dim
    kv_tok = 2 * num_kv_heads * head_dim
    act = element_size
    per_token = np.array([
        q_tok * act,  # Q
        kv_tok * act,  # KV
        q_tok * act + num_q_heads * 4,  # OUT: out + lse
        q_tok * act + 2 * num_q_heads * 4,  # DO: dout + lse + delta
        q_tok * grad_element_size,  # DQ
        kv_tok * grad_element_size,  # DKV
    ], dtype=np.int64)
    per_token.setflags(write=False)
    return per_token


def row_bytes(rows: np.ndarray, block_len: np.ndarray, **sizes) -> np.ndarray:
    """Payload bytes of int64 schedule rows ``[m, 5]``; ``block_len``: valid tokens of every block."""
    return payload_bytes(rows[:, 3], block_len[rows[:, 4]], **sizes)


class CommSchedule:
    """Forward and backward transfer tables of a Plan (see module docstring): ``fwd`` int32 [m_fwd, 5]
    (kinds Q, KV, OUT) and ``bwd`` int32 [m_bwd, 5] (kinds DO, DQ, DKV), in wire order.

    A schedule made ``from_rows`` sorts its rows into wire order on first use of a table: dcp scores
    its candidates by sums over their rows (``cost_rows``, any order) and keeps one, so most of the
    schedules it derives are never sorted."""

    def __init__(self, fwd: torch.Tensor, bwd: torch.Tensor, num_stages: int, world_size: int):
        self._init({"fwd": fwd, "bwd": bwd}, None, num_stages, world_size)

    def _init(self, tables: dict, unsorted: dict | None, num_stages: int, world_size: int) -> None:
        self._tables = tables  # direction -> int32 table in wire order, once sorted
        self._unsorted = unsorted  # {"fwd", "bwd"}: int64 [m, 5] rows in any order, or None
        self.num_stages, self.world_size = int(num_stages), int(world_size)

    @classmethod
    def from_rows(cls, fwd: np.ndarray, bwd: np.ndarray, *, num_stages: int, world_size: int) -> "CommSchedule":
        """A schedule of int64 ``[m, 5]`` row arrays in any order (sorted into wire order on first use)."""
        sched = cls.__new__(cls)
        sched._init({}, {"fwd": fwd, "bwd": bwd}, num_stages, world_size)
        return sched

    @property
    def fwd(self) -> torch.Tensor:
        return self.table("fwd")

    @property
    def bwd(self) -> torch.Tensor:
        return self.table("bwd")

    def table(self, direction: str) -> torch.Tensor:
        """The ``"fwd"`` or ``"bwd"`` table."""
        if direction not in ("fwd", "bwd"):
            raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
        if direction not in self._tables:
            self._tables[direction] = _sorted_table([self._unsorted[direction]])
        return self._tables[direction]

    def cost_rows(self, direction: str) -> np.ndarray:
        """int64 ``[m, 5]``: the rows of one table in any order, for sums over them (bytes, times)."""
        if self._unsorted is not None:
            return self._unsorted[direction]
        return self.table(direction).numpy().astype(np.int64)

    def with_num_stages(self, num_stages: int) -> "CommSchedule":
        """The same rows in a schedule of ``num_stages`` stages (one stage more that carries no row)."""
        sched = CommSchedule.__new__(CommSchedule)
        sched._init(dict(self._tables), self._unsorted, num_stages, self.world_size)
        return sched

    def in_wire_order(self) -> "CommSchedule":
        """This schedule with both tables sorted and no unsorted rows kept (what a Plan holds: the
        executor, the check and other processes read it, and it pickles without the rows twice)."""
        return CommSchedule(self.fwd, self.bwd, self.num_stages, self.world_size)

    def rows(self, direction: str, *, stage=None, src=None, dst=None, kind=None) -> torch.Tensor:
        """Rows of one table filtered by any of stage / src / dst / kind (wire order kept)."""
        t = self.table(direction)
        keep = torch.ones(t.shape[0], dtype=torch.bool)
        for col, value in ((0, stage), (1, src), (2, dst), (3, kind)):
            if value is not None:
                keep &= t[:, col] == int(value)
        return t[keep]

    def sends(self, rank: int, stage: int, direction: str = "fwd") -> torch.Tensor:
        """What ``rank`` sends in ``stage``, in wire order."""
        return self.rows(direction, stage=stage, src=rank)

    def recvs(self, rank: int, stage: int, direction: str = "fwd") -> torch.Tensor:
        """What ``rank`` receives in ``stage``, in wire order."""
        return self.rows(direction, stage=stage, dst=rank)

    def bytes(self, rows, plan) -> np.ndarray | int:
        """Payload bytes of one row ``(stage, src, dst, kind, block)`` (an int) or of a ``[m, 5]``
        table (int64 array), for the shapes and dtype of ``plan``."""
        arr = np.asarray(rows.numpy() if isinstance(rows, torch.Tensor) else rows, dtype=np.int64)
        single = arr.ndim == 1
        arr = arr.reshape(-1, 5)
        block = arr[:, 4]
        block_len = np.minimum(plan.block_size, plan.total_len - block * plan.block_size)
        out = payload_bytes(
            arr[:, 3],
            block_len,
            num_q_heads=plan.num_q_heads,
            num_kv_heads=plan.num_kv_heads,
            head_dim=plan.head_dim,
            element_size=plan.dtype.itemsize,
            grad_element_size=plan.grad_comm_dtype.itemsize,
        )
        return int(out[0]) if single else out


def receive_groups(rank: np.ndarray, block: np.ndarray, stage: np.ndarray, num_blocks: int):
    """Unique (rank, block) pairs, ascending by ``rank * nB + block``, with the first and last stage in
    which they occur (for the remote inputs of tiles: one receive group each, one CommSchedule row).

    Dense over the [P, nB] grid (min / max of the stages per cell) instead of sorting the (large) tile
    arrays.
    """
    if rank.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    key = rank * num_blocks + block
    size = int(key.max()) + 1
    stage = np.asarray(stage, dtype=np.int64)
    # only the cells of present keys are initialized and read (filling all P * nB costs more at 1M/64)
    first = np.empty(size, dtype=np.int64)
    last = np.empty(size, dtype=np.int64)
    first[key] = np.iinfo(np.int64).max
    last[key] = np.iinfo(np.int64).min
    np.minimum.at(first, key, stage)
    np.maximum.at(last, key, stage)
    present = np.zeros(size, dtype=bool)
    present[key] = True
    uniq = np.flatnonzero(present)
    return uniq // num_blocks, uniq % num_blocks, first[uniq], last[uniq]


class InputGroups:
    """The (q, kv) ``receive_groups`` of the tiles' remote q-blocks (``remote_q``) and kv-blocks
    (``remote_kv``), for fixed tile ranks, under any per-tile stages: one receive group per remote
    (rank, block) input. Which tiles form each group is worked out once (a sort), so each staging
    costs one compiled pass over the grouped tiles instead of a pass over the [P, nB] grid (a placement's
    stagings are tried by the dozen: backward splits, deferral rounds, relay variants)."""

    def __init__(self, rank: np.ndarray, q: np.ndarray, kv: np.ndarray, remote_q: np.ndarray, remote_kv: np.ndarray):
        self._parts = [_grouping(rank, block, np.flatnonzero(remote))
                       for block, remote in ((q, remote_q), (kv, remote_kv))]

    def __call__(self, stage: np.ndarray) -> tuple:
        stage = np.asarray(stage, dtype=np.int64)
        out = []
        for tiles, heads, group_rank, group_block in self._parts:
            out.append((group_rank, group_block, *group_stages(tiles, heads, stage)))
        return tuple(out)


def _grouping(rank: np.ndarray, block: np.ndarray, tiles: np.ndarray) -> tuple:
    """(tiles ordered by ``rank * nB + block``, each group's first position, each group's rank and
    block) of the given tile indices, as ``receive_groups`` orders its groups; read-only. Compiled
    (planner/group_loops.py ``group_tiles``)."""
    parts = group_tiles(np.asarray(rank, dtype=np.int64), np.asarray(block, dtype=np.int64),
                        np.asarray(tiles, dtype=np.int64))
    for part in parts:
        part.setflags(write=False)
    return parts


def _rows(stage, src, dst, kind: int, block) -> np.ndarray:
    rows = np.empty((len(stage), 5), dtype=np.int64)  # (np.stack: ~3x the time on a finisher's small groups)
    rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4] = stage, src, dst, kind, block
    return rows


def _sorted_table(parts: list[np.ndarray]) -> torch.Tensor:
    table = np.concatenate(parts, axis=0) if parts else np.zeros((0, 5), dtype=np.int64)
    if table.shape[0] == 0:
        return torch.zeros((0, 5), dtype=torch.int32)
    # Lexicographic order of the 5 columns, ties in row order: stable counting passes, compiled (the
    # common case: rows are non-negative); lexsort otherwise. Same order either way.
    table = np.ascontiguousarray(table, dtype=np.int64)
    if table.min() >= 0:
        return torch.from_numpy(rows_in_wire_order(table))
    order = np.lexsort(tuple(table[:, c] for c in (4, 3, 2, 1, 0)))
    return torch.from_numpy(np.ascontiguousarray(table[order]).astype(np.int32))


def as_relay_table(kv_relay) -> np.ndarray:
    """int64 [m, 3] ``(block, dst, src)`` rows of a relay table (None or empty: no relays)."""
    if kv_relay is None:
        return np.zeros((0, 3), dtype=np.int64)
    arr = np.asarray(kv_relay.numpy() if isinstance(kv_relay, torch.Tensor) else kv_relay, dtype=np.int64)
    if arr.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"kv_relay must be [m, 3] rows (block, dst, src), got shape {tuple(arr.shape)}")
    return arr


def int_array(values) -> np.ndarray:
    """Integer indices (a numpy array or a CPU tensor) as a numpy array, without a copy where they are
    int32 or int64 already (the callers compute their keys in int64)."""
    array = values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    return array if array.dtype in (np.int32, np.int64) else array.astype(np.int64)


def derive_schedule(block_home, tile_q, tile_kv, tile_rank, tile_stage, *, num_blocks: int,
                    num_stages: int, world_size: int, kv_relay=None, tile_stage_bwd=None,
                    remote: tuple | None = None) -> CommSchedule:
    """Build the CommSchedule of a placement (numpy or torch int inputs); ``kv_relay`` rows
    ``(block, dst, src)`` make ``dst`` receive KV ``block`` from ``src`` (see the module docstring);
    ``tile_stage_bwd`` gives the backward stages (default: the forward ones). ``remote``: the tiles'
    (remote q, remote kv) masks where the caller has them (``home[q] != rank``, ``home[kv] != rank``)."""
    home = np.asarray(block_home, dtype=np.int64)
    q, kv, rank, stage = (int_array(x) for x in (tile_q, tile_kv, tile_rank, tile_stage))
    remote_q, remote_kv = (home[q] != rank, home[kv] != rank) if remote is None else remote
    groups = InputGroups(rank, q, kv, remote_q, remote_kv)
    bwd_groups = None if tile_stage_bwd is None else groups(int_array(tile_stage_bwd))
    return schedule_from_groups(home, *groups(stage), num_blocks=num_blocks, num_stages=num_stages,
                                world_size=world_size, kv_relay=kv_relay, bwd_groups=bwd_groups)


def derive_schedule_merged(tiles, coarse, of_fine: np.ndarray, factor: int, coarse_home: np.ndarray,
                           coarse_rank: np.ndarray, coarse_stage: np.ndarray, coarse_stage_bwd: np.ndarray, *,
                           num_stages: int, world_size: int, covered: tuple | None = None) -> CommSchedule:
    """``derive_schedule`` of a relay-free placement planned on merged blocks (``coarse``, each real tile
    of ``tiles`` in merged tile ``of_fine``, real block b in merged block b // ``factor``), where every
    real tile has its merged tile's rank and both stages: the same schedule, from the merged tiles'
    receive groups instead of a grouping of every real tile.

    A real (rank, block) group is the union of the merged tiles of its merged group that hold a real
    tile in that block's row (q) or column (kv), and every real tile of a merged tile has its stages, so
    each merged tile stands for its real tiles once it is known which of its ``factor`` rows and columns
    they cover: a scatter over the real tiles, where grouping them is a sort (197K real tiles, 4x merged:
    2.3 against 3.9 ms). ``covered``: ``covered_rows_and_columns`` of these tiles where the caller has
    them (planner/tile_loops.py ``inherit_merged``)."""
    if factor < 1 or factor & (factor - 1):
        raise ValueError(f"derive_schedule_merged takes blocks merged by a power of two, got factor={factor}")
    shift = factor.bit_length() - 1
    coarse_home = np.asarray(coarse_home, dtype=np.int64)
    home = coarse_home[np.arange(tiles.num_blocks) >> shift]
    rank, stage, stage_bwd = (np.asarray(x, dtype=np.int64) for x in (coarse_rank, coarse_stage, coarse_stage_bwd))
    parts = []
    if covered is None:
        covered = covered_rows_and_columns(tiles.q, tiles.kv, of_fine, shift, coarse.num_tiles)
    for covered_blocks, coarse_block in zip(covered, (coarse.q, coarse.kv)):
        remote = np.flatnonzero(coarse_home[coarse_block] != rank)
        order, heads, group_rank, group_block = _grouping(rank, coarse_block, remote)
        if order.size == 0:
            parts.append([(group_rank, group_block, group_rank, group_rank)] * 2)
            continue
        # (ascending rank * nB + block, as receive_groups orders its groups)
        group_rank, block, first, last, first_bwd, last_bwd = real_groups(covered_blocks, order, heads, stage,
                                                                          stage_bwd, group_rank, group_block, factor)
        parts.append([(group_rank, block, first, last), (group_rank, block, first_bwd, last_bwd)])
    (q_fwd, q_bwd), (kv_fwd, kv_bwd) = parts
    return schedule_from_groups(home, q_fwd, kv_fwd, num_blocks=tiles.num_blocks, num_stages=num_stages,
                                world_size=world_size, bwd_groups=(q_bwd, kv_bwd))


def schedule_from_groups(home: np.ndarray, q_groups, kv_groups, *, num_blocks: int, num_stages: int,
                         world_size: int, kv_relay=None, bwd_groups=None, kv_side: tuple | None = None) -> CommSchedule:
    """The CommSchedule from the ``receive_groups`` (rank, block, first, last) of the tiles' remote q-
    and kv-blocks (lets a planner that changes few stages rebuild it without touching every tile);
    ``bwd_groups`` = (q, kv) groups under the backward stages (default: the forward groups);
    ``kv_side``: ``relayed_kv_side`` of these groups and relays, where the caller has it."""
    fwd, bwd = schedule_rows(home, q_groups, kv_groups, num_blocks=num_blocks, num_stages=num_stages,
                             kv_relay=kv_relay, bwd_groups=bwd_groups, kv_side=kv_side)
    return CommSchedule.from_rows(fwd, bwd, num_stages=num_stages, world_size=world_size)


def schedule_rows(home: np.ndarray, q_groups, kv_groups, *, num_blocks: int, num_stages: int,
                  kv_relay=None, bwd_groups=None, kv_side: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The forward and backward rows of ``schedule_from_groups``, int64 and *unsorted* (enough for a
    cost estimate, which sums per (rank, stage); ``CommSchedule.from_rows`` puts them in wire order).
    The backward rows follow ``bwd_groups`` (same (rank, block) pairs, backward first / last stages).
    ``kv_side``: ``relayed_kv_side(home, kv_groups, kv_relay, num_blocks)``, where the caller has it
    (it depends on the forward groups and the relays alone, not on the backward stages)."""
    q_bwd, kv_bwd = (q_groups, kv_groups) if bwd_groups is None else bwd_groups
    relay = as_relay_table(kv_relay)
    if kv_bwd is not kv_groups and not (np.array_equal(kv_bwd[0], kv_groups[0])
                                        and np.array_equal(kv_bwd[1], kv_groups[1])):
        raise ValueError("bwd_groups must hold the forward groups' (rank, block) pairs, in the same order")
    if relay.shape[0] == 0:  # (the common case, compiled: planner/comm_loops.py; the same rows)
        as64 = read_only_int64
        return relay_free_rows(as64(home), *map(as64, q_groups), *map(as64, q_bwd), *map(as64, kv_groups[:3]),
                               as64(kv_bwd[3]))
    r, b, first, last = q_groups
    q_in = _rows(first, home[b], r, KIND_Q, b)
    out = _rows(last + 1, r, home[b], KIND_OUT, b)
    r, b, first, last = q_bwd
    d_out = _rows(first, home[b], r, KIND_DO, b)
    d_q = _rows(last + 1, r, home[b], KIND_DQ, b)

    r, b = kv_groups[:2]
    src, kv_in = relayed_kv_side(home, kv_groups, relay, num_blocks) if kv_side is None else kv_side
    last = kv_bwd[3]  # (same pairs: the forward's KV sources are the backward's DKV parents)
    dkv_dst, dkv_stage, transit_dkv = dkv_routes(home, r, b, last, src, num_blocks, num_stages)
    d_kv = np.concatenate([_rows(dkv_stage, r, dkv_dst, KIND_DKV, b), transit_dkv])
    return np.concatenate([q_in, kv_in, out]), np.concatenate([d_out, d_q, d_kv])


def relayed_kv_side(home: np.ndarray, kv_groups, kv_relay, num_blocks: int) -> tuple:
    """(each forward kv receive group's KV source, the forward KV rows [m, 5]) under the relay table
    ``kv_relay`` (non-empty): the KV side of ``schedule_rows``, read-only (planner/comm_loops.py
    ``relayed_kv_rows``; tests/test_comm_times.py checks it against the numpy passes)."""
    r, b, first, _ = kv_groups
    side = relayed_kv_rows(*map(read_only_int64, (home, r, b, first, as_relay_table(kv_relay))), int(num_blocks))
    for part in side:
        part.setflags(write=False)
    return side


def dkv_routes(home, r, b, last, src, num_blocks: int, num_stages: int) -> tuple:
    """(DKV destination [n], stage [n], transit rows [m, 5]) of the (rank r, kv-block b) receive groups
    (``last``: a group's last backward stage; ``src``: its KV source, planner/comm_loops.py
    ``relayed_kv_rows``): home at ``last + 1``, or up a reduce tree.

    A child of a proxy (a rank with tiles of b that got it from the home or from a transit rank)
    reduces into the proxy when the proxy can still forward the sum: the child's partial arrives at
    last + 1, the proxy sends at >= last + 2 <= S. A child of a transit rank t (no tiles of b, so no
    partial of its own) sends through t when t can forward it one stage later (<= S): t's own row,
    the transit row, leaves after its last child's, so the partials cross the NIC from t, not from
    the reader."""
    # (compiled: planner/comm_loops.py; tests/test_comm_times.py checks it against the numpy passes)
    return comm_dkv_routes(*map(read_only_int64, (home, r, b, last, src)), int(num_blocks), int(num_stages))
