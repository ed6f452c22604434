"""Properties of the per-rank programs the distributed executor derives from a Plan (no processes).

For random masks, lengths, block sizes, world sizes and placements (the planner's strategies and random
valid placements that move q-blocks too): every tile runs exactly once; each sender's message layout for
(exchange, peer) equals the receiver's; per-rank planned bytes equal plan.stats(); every tile list entry
addresses buffer rows that hold exactly the global tokens it claims; received blocks get disjoint rows.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_distributed import random_plan

from blockattn import MaskSpec
from blockattn.comms import as_bytes, from_bytes
from blockattn.distributed import RankProgram, build_rank_program
from blockattn.planner import KIND_DKV, KIND_DQ, KIND_KV, KIND_OUT, KIND_Q, make_plan

TO_HOME = (KIND_OUT, KIND_DQ, KIND_DKV)
HEADS = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)


@st.composite
def plans(draw):
    T = draw(st.integers(1, 220))
    kind = draw(st.sampled_from(["causal", "documents", "window", "mod"]))
    if kind == "causal":
        spec = MaskSpec.causal(T)
    elif kind == "window":
        spec = MaskSpec.sliding_window(T, draw(st.integers(1, 64)))
    elif kind == "mod":
        spec = MaskSpec.from_mask_mod(lambda q, k: (k <= q) & ((q + 2 * k) % 5 != 0), T)
    else:
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, T - 1)), max_size=6)))) if T > 1 else []
        bounds = [0] + [c for c in cuts if 0 < c < T] + [T]
        spec = MaskSpec.documents([b - a for a, b in zip(bounds, bounds[1:])])
    world = draw(st.integers(1, 6))
    block = draw(st.sampled_from([16, 32]))
    strategy = draw(st.sampled_from(["dcp", "fcp", "ring", "zigzag", "allgather", "random"]))
    if strategy == "random":
        plan = random_plan(spec, world, seed=draw(st.integers(0, 10_000)), block_size=block, **HEADS)
    else:
        plan = make_plan(spec, world, strategy=strategy, block_size=block, **HEADS)
    return spec, plan


def _token_of_rows(plan, prog: RankProgram, rank: int, buffer: str) -> torch.Tensor:
    """Global token index held in each row of a rank's q or kv buffer (-1: never written)."""
    B, T = plan.block_size, plan.total_len
    rows = torch.full((prog.q_buf_rows if buffer == "q" else prog.kv_buf_rows,), -1, dtype=torch.int64)
    rows[: prog.n_local] = plan.local_tokens(rank)
    kind = KIND_Q if buffer == "q" else KIND_KV
    for ex in prog.exchanges["fwd"]:
        for secs in ex.recvs.values():
            for sec in secs:
                if sec.kind == kind:
                    assert bool((rows[sec.rows] == -1).all()), "a received block overwrites rows already in use"
                    starts = sec.blocks * B
                    lens = (T - starts).clamp(max=B)
                    rows[sec.rows] = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), lens.tolist())])
    return rows


def _check_tiles(plan, tiles, work_rows, partner_rows) -> int:
    """Each entry's buffer rows hold the tokens of its glob; returns the number of tiles in the list."""
    B, T = plan.block_size, plan.total_len
    entries = [(tiles.work_row, tiles.work_glob, work_rows), (tiles.full_row, tiles.full_glob, partner_rows),
               (tiles.part_row, tiles.part_glob, partner_rows)]
    for row, glob, buf in entries:
        for r, g in zip(row.tolist(), glob.tolist()):
            n = min(B, T - g)
            assert torch.equal(buf[r : r + n], torch.arange(g, g + n)), f"rows {r}.. do not hold tokens {g}.."
    return tiles.num_full + tiles.num_partial


@given(plans())
def test_rank_programs_agree_with_the_plan_and_each_other(case):
    spec, plan = case
    bm = spec.block_mask(plan.block_size)
    P = plan.world_size
    progs = [build_rank_program(plan, r, bm, torch.device("cpu")) for r in range(P)]
    stats = plan.stats()
    n_tiles = n_tiles_t = 0
    for r, prog in enumerate(progs):
        assert prog.n_local == plan.local_len(r)
        q_rows, kv_rows = _token_of_rows(plan, prog, r, "q"), _token_of_rows(plan, prog, r, "kv")
        for stage in prog.stages:
            if stage.q_tiles is not None:
                n_tiles += _check_tiles(plan, stage.q_tiles, q_rows, kv_rows)
        n_bwd = 0
        for stage in prog.stages_bwd:
            if stage.q_tiles is not None:
                n_bwd += _check_tiles(plan, stage.q_tiles, q_rows, kv_rows)
                n_tiles_t += _check_tiles(plan, stage.kv_tiles, kv_rows, q_rows)
        assert n_bwd == int((plan.tile_rank == r).sum())
        for direction in ("fwd", "bwd"):
            assert prog.planned_bytes[direction] == stats[f"bytes_sent_{direction}"][r]
            sent = sum(sum(ex.send_nbytes.values()) for ex in prog.exchanges[direction])
            assert sent == prog.planned_bytes[direction]
            for j, ex in enumerate(prog.exchanges[direction]):
                for peer, secs in ex.sends.items():
                    theirs = progs[peer].exchanges[direction][j]
                    assert theirs.recv_nbytes[r] == ex.send_nbytes[peer]
                    assert [(s.kind, s.blocks.tolist()) for s in secs] == \
                           [(s.kind, s.blocks.tolist()) for s in theirs.recvs[r]]
                    for mine, other in zip(secs, theirs.recvs[r]):
                        assert mine.rows.numel() == other.rows.numel()
                        if mine.kind in TO_HOME:  # partials land in the home's own rows
                            assert bool((other.rows < progs[peer].n_local).all())
                        else:  # inputs leave the home's own rows for gathered rows on the peer
                            assert bool((mine.rows < prog.n_local).all())
                            assert bool((other.rows >= progs[peer].n_local).all())
    assert n_tiles == n_tiles_t == plan.tile_q.numel()


@given(st.integers(0, 7), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.integers(1, 5))
def test_from_bytes_reads_any_offset(offset, dtype, n):
    x = torch.randn(n, 3).to(dtype)
    buf = torch.cat([torch.zeros(offset, dtype=torch.uint8), as_bytes(x), torch.zeros(3, dtype=torch.uint8)])
    assert torch.equal(from_bytes(buf, offset, (n, 3), dtype), x)


def test_rank_program_for_a_device_is_the_host_program_in_one_copy_per_dtype():
    """Built for another device (here "meta": tensors without data, so any read of a device value on the
    way - a range check, a ``.item()`` - would raise), the program is the host one, its index tensors
    views of one copy per dtype (int32 tile lists, int64 message rows), not a copy per tensor."""
    spec = MaskSpec.documents([120, 37, 143]) & MaskSpec.sliding_window(300, 90)
    plan = random_plan(spec, 3, seed=1, block_size=32, **HEADS)
    bm = spec.block_mask(32)
    fields = ("work_row", "work_glob", "full_ptr", "full_row", "full_glob", "part_ptr", "part_row", "part_glob",
              "part_bits")
    for rank in range(3):
        host = build_rank_program(plan, rank, bm, torch.device("cpu"))
        meta = build_rank_program(plan, rank, bm, torch.device("meta"))
        tiles = [(a, b) for sh, sm in zip(host.stages + host.stages_bwd, meta.stages + meta.stages_bwd)
                 for a, b in ((sh.q_tiles, sm.q_tiles), (sh.kv_tiles, sm.kv_tiles))]
        assert all((a is None) == (b is None) for a, b in tiles) and any(a is not None for a, _ in tiles)
        moved = []
        for a, b in tiles:
            for f in fields if a is not None else ():
                x, y = getattr(a, f), getattr(b, f)
                assert y.device.type == "meta" and y.dtype == x.dtype == torch.int32 and y.shape == x.shape
                moved.append(y)
        rows = []
        for d in ("fwd", "bwd"):
            for eh, em in zip(host.exchanges[d], meta.exchanges[d]):
                for side in ("sends", "recvs"):
                    sh, sm = getattr(eh, side), getattr(em, side)
                    assert list(sh) == list(sm)
                    for peer in sh:
                        for a, b in zip(sh[peer], sm[peer]):
                            assert a.kind == b.kind and torch.equal(a.blocks, b.blocks)
                            assert b.rows.device.type == "meta" and b.rows.shape == a.rows.shape
                            rows.append(b.rows)
        assert rows and (host.q_buf_rows, host.kv_buf_rows, host.planned_bytes) == \
            (meta.q_buf_rows, meta.kv_buf_rows, meta.planned_bytes)
        for group in (moved, rows):
            assert len({id(t._base) for t in group}) == 1 and all(t._base is not None for t in group)
            # each view 16-byte aligned in its copy (Triton compiles a kernel variant per pointer alignment)
            assert all(t.storage_offset() * t.element_size() % 16 == 0 for t in group)


def test_aligned_flat_keeps_every_array_and_aligns_its_start():
    from blockattn.rank_program import aligned_flat

    for dtype in (np.int32, np.int64):
        arrays = [np.arange(n, dtype=dtype) * 7 + n for n in (0, 1, 3, 4, 5, 17, 0, 2)]
        flat, starts = aligned_flat(arrays, 16)
        assert flat.dtype == dtype and starts.size == len(arrays)
        for a, start in zip(arrays, starts.tolist()):
            assert start * flat.itemsize % 16 == 0 and np.array_equal(flat[start:start + a.size], a)
