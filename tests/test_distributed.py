"""Distributed block attention on CPU: gloo process groups in spawned processes (127.0.0.1, free port).

One spawn per test runs several cases inside (process start-up dominates on a 2-core machine). Every
case checks, on every rank: forward out / lse and q, k, v gradients against the float64 reference
(error bounded relative to the same-dtype torch eager error), and the bytes actually handed to
torch.distributed (counted by wrapping its send calls) against plan.stats(), forward and backward.
Most cases use the "torch" backend (fast on CPU); one runs the Triton kernels under the interpreter.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from spawn_gloo import spawn

from blockattn import MaskSpec

# as in the kernel tests (tests/test_kernels.py): error <= FACTOR x same-dtype eager error + ATOL
FACTOR = 4.0
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


# ----------------------------------------------------------------------------- harness
def _inputs(T, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(T, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv, Hq))
    return q, k, v, dout


def _reference(spec, q, k, v, dout, dtype, softcap=None):
    """(out, lse, dq, dk, dv) of the dense reference computed in `dtype` (fully masked rows: grads 0)."""
    from blockattn.reference import attention

    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention(*leaves, spec, dtype=dtype, softcap=softcap)
    out.backward(dout.to(dtype))
    return [out.detach(), lse.detach()] + [torch.nan_to_num(t.grad) for t in leaves]


def _assert_close(name, got, ref64, eager, dtype, rows):
    """got (this rank's rows) vs the float64 reference: error <= FACTOR x the eager same-dtype error + ATOL."""
    pick = (lambda t: t[:, rows]) if name == "lse" else (lambda t: t[rows])
    ref64, eager = pick(ref64), pick(eager)
    finite = torch.isfinite(ref64)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: -inf/NaN pattern differs from the reference"
    err = (got.double() - ref64).abs()[finite].max().item() if finite.any() else 0.0
    eager_err = (eager.double() - ref64).abs()[finite].max().item() if finite.any() else 0.0
    bound = FACTOR * eager_err + ATOL[dtype]
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g} (eager {dtype} error {eager_err:.3g})"


def random_plan(spec, world, *, seed, num_q_heads, num_kv_heads, head_dim, dtype, block_size, max_stage=3,
                empty_rank=None, grad_comm_dtype=torch.float32):
    """A valid Plan with random block homes, tile ranks and stages: tiles run away from their q-block's
    home too, so Q / OUT / DO / DQ transfers and the home-side merge of partials are exercised (the
    planner's strategies keep every tile at its q home). `empty_rank` holds no tokens (it still computes)."""
    import numpy as np

    from blockattn.planner import check_plan
    from blockattn.planner.api import build_plan
    from blockattn.planner.cost_model import CostModel
    from blockattn.planner.placement import Placement
    from blockattn.planner.tiles import TileSet

    tiles = TileSet.from_block_mask(spec.block_mask(block_size))
    rng = np.random.default_rng(seed)
    home = rng.integers(0, world, tiles.num_blocks)
    if empty_rank is not None:
        home = np.where(home == empty_rank, (home + 1) % world, home)
    rank = rng.integers(0, world, tiles.num_tiles)
    at_home = (home[tiles.q] == rank) & (home[tiles.kv] == rank)
    n = tiles.num_tiles
    stage = np.where(at_home, rng.integers(0, max_stage, n), rng.integers(1, max_stage + 1, n))
    plan = build_plan(tiles, Placement(home, rank, stage), strategy=f"random{seed}", world_size=world,
                      num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                      mask_signature=spec.signature(), cost_model=CostModel(), grad_comm_dtype=grad_comm_dtype)
    check_plan(plan)
    return plan


def _balanced_without_relays(spec, world, *, init, ranks_per_node, num_q_heads, num_kv_heads, head_dim, dtype,
                             block_size, inter_bw=2e9, grad_comm_dtype=torch.float32):
    """(tiles, cost model, build_plan keywords, sizes, dcp's balancing of the ``init`` data placement
    without relays) on nodes of ``ranks_per_node`` with a slow inter-node link: the base that the relay
    and transit cases add their relays to."""
    from test_relay import dcp_placement_without_relays

    from blockattn.planner import CostModel, Topology
    from blockattn.planner.tiles import TileSet

    sizes = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 element_size=dtype.itemsize, grad_element_size=grad_comm_dtype.itemsize)
    kw = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, grad_comm_dtype=grad_comm_dtype,
              dtype=dtype, world_size=world, mask_signature=spec.signature())
    cost_model = CostModel(topology=Topology(ranks_per_node=ranks_per_node, inter_bw=inter_bw))
    tiles = TileSet.from_block_mask(spec.block_mask(block_size))
    own = dcp_placement_without_relays(tiles, world, cost_model, sizes, init=init)
    return tiles, cost_model, kw, sizes, own


def relay_plan(spec, world, *, ranks_per_node, num_q_heads, num_kv_heads, head_dim, dtype, block_size,
               inter_bw=2e9, grad_comm_dtype=torch.float32):
    """dcp's plan with node-level KV relays (planner/relay.py) on a slow inter-node link: the relayed
    variant with DKV reduce trees and delayed tiles if one has them."""
    import numpy as np

    from blockattn.planner import check_plan
    from blockattn.planner.api import build_plan
    from blockattn.planner.placement import Placement
    from blockattn.planner.relay import relay_variants

    # dcp's balancing of a zigzag placement (not dcp's own choice among its candidates, which changes as
    # the planner does): it has receivers that need a block in their proxy's stage, so relayed variants
    # delay tiles; the test counts them against this relay-free placement
    tiles, cost_model, kw, sizes, own = _balanced_without_relays(
        spec, world, init="zigzag", ranks_per_node=ranks_per_node, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, block_size=block_size, inter_bw=inter_bw,
        grad_comm_dtype=grad_comm_dtype)
    base = build_plan(tiles, own, strategy="dcp", cost_model=cost_model, **kw)
    as64 = lambda t: t.numpy().astype(np.int64)  # noqa: E731
    # every relayed variant dcp weighs (not only the one it keeps): this test is about executing
    # relays, DKV reduce trees and delayed tiles, so it takes the variant with the most of them
    _, variants = relay_variants(tiles, Placement(as64(base.block_home), as64(base.tile_rank), as64(base.tile_stage)),
                                 world_size=world, cost_model=cost_model, max_stages=4, sizes=sizes)
    plans = [build_plan(tiles, v, strategy="dcp+relay", cost_model=base.cost_model, **kw) for v in variants]
    if not plans:
        raise AssertionError(f"no relay candidates for {spec}")

    def exercised(plan):
        bwd, home = plan.schedule.bwd, plan.block_home.long()
        trees = int(((bwd[:, 3] == 5) & (bwd[:, 2] != home[bwd[:, 4].long()])).sum())
        return (trees > 0, int((plan.tile_stage != base.tile_stage).sum()) > 0, plan.kv_relay.shape[0])

    plan = max(plans, key=exercised)
    check_plan(plan)
    return base, plan


def fanout_plan(spec, world, *, num_q_heads, num_kv_heads, head_dim, dtype, block_size):
    """(dcp's balancing of the "contiguous" data placement on one node, its fan-out variant with the most
    relays and delayed tiles, planner/fanout.py): readers of a widely read block that get it from an
    earlier reader (one per proxy here, from 3 readers, so 6 ranks have some)."""
    import numpy as np

    from blockattn.planner import check_plan
    from blockattn.planner.api import build_plan
    from blockattn.planner.fanout import fanout_variants

    tiles, cost_model, kw, sizes, own = _balanced_without_relays(
        spec, world, init="contiguous", ranks_per_node=world, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, block_size=block_size)
    base = build_plan(tiles, own, strategy="dcp", cost_model=cost_model, **kw)
    variants = fanout_variants(tiles, own, world_size=world, cost_model=cost_model, max_stages=4, sizes=sizes,
                               degree=1, min_readers=3)
    if not variants:
        raise AssertionError(f"no fan-out candidates for {spec}")
    plans = [build_plan(tiles, v, strategy="dcp+fanout", cost_model=cost_model, **kw) for v in variants]
    plan = max(plans, key=lambda p: (int((p.tile_stage != base.tile_stage).sum()) > 0, p.kv_relay.shape[0]))
    check_plan(plan)
    assert np.array_equal(own.block_home, plan.block_home.numpy()), "a fan-out moves no block"
    return base, plan


def transit_plan(spec, world, *, ranks_per_node, num_q_heads, num_kv_heads, head_dim, dtype, block_size,
                 side=None):
    """dcp's balancing of a "hierarchical" placement with every KV block that crosses to a node for one
    reader relayed through a transit rank of that node (planner/relay.py transit_relays), or with
    ``side="home"`` the sends that even out the homes' NICs (counted in blocks) through their
    node-mates; and the numbers of transit receives (KV rows into a rank that computes no tile of the
    block) and of dK/dV partials such a rank forwards home."""
    import numpy as np

    from blockattn.planner import check_plan
    from blockattn.planner.api import build_plan
    from blockattn.planner.placement import Placement, compact_stages
    from blockattn.planner.relay import transit_relays
    from blockattn.planner.schedule import receive_groups

    tiles, cost_model, kw, _, own = _balanced_without_relays(
        spec, world, init="hierarchical", ranks_per_node=ranks_per_node, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, block_size=block_size)
    home, rank = own.block_home, own.tile_rank
    stage, _ = compact_stages(own.tile_stage)
    remote = home[tiles.kv] != rank
    groups = receive_groups(rank[remote], tiles.kv[remote], stage[remote], tiles.num_blocks)
    none = np.zeros((0, 3), np.int64)
    if side == "home":
        r, b = groups[0], groups[1]
        crossing = r // ranks_per_node != home[b] // ranks_per_node
        sends = np.bincount(home[b[crossing]], minlength=world).astype(np.float64)
        relay = transit_relays(home, groups, none, ranks_per_node=ranks_per_node, world_size=world, side="home",
                               load=sends, kv_bytes=np.ones(tiles.num_blocks))
    else:
        relay = transit_relays(home, groups, none, ranks_per_node=ranks_per_node, world_size=world)
    plan = build_plan(tiles, Placement(home, rank, stage, kv_relay=relay), strategy="dcp+transit",
                      cost_model=cost_model, **kw)
    check_plan(plan)
    reads = set(zip(rank.tolist(), tiles.kv.tolist()))
    transit = sum((d, b) not in reads for _, _, d, k, b in plan.schedule.fwd.tolist() if k == 1)
    forwarded = sum((s, b) not in reads for _, s, _, k, b in plan.schedule.bwd.tolist() if k == 5)
    return plan, transit, forwarded


def run_case(rank, world, spec, *, strategy="dcp", Hq=4, Hkv=2, D=16, dtype=torch.float32, block_size=16,
             backend="torch", comm_method="p2p", lse_grad=False, seed=0, plan=None, grad_comm_dtype=torch.float32,
             softcap=None):
    """Run one plan fwd+bwd on this rank and check it; returns this rank's output rows.
    strategy "random<k>": a random valid placement with seed k (see random_plan); ``plan``: run this one;
    ``softcap``: logit soft-capping (inputs scaled up so that the cap bends most scores)."""
    from blockattn.comms import count_bytes
    from blockattn.distributed import distributed_block_attention
    from blockattn.planner import make_plan

    kw = dict(num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, dtype=dtype, block_size=block_size,
              grad_comm_dtype=grad_comm_dtype)
    if plan is not None:
        pass
    elif strategy.startswith("random"):  # "random<seed>" or "random<seed>-empty<rank>"
        seed_text, _, empty = strategy[6:].partition("-empty")
        plan = random_plan(spec, world, seed=int(seed_text), empty_rank=int(empty) if empty else None, **kw)
        stats = plan.stats()
        assert stats["transfers"]["Q"] and stats["transfers"]["OUT"], "random plan should move q-blocks"
    else:
        plan = make_plan(spec, world, strategy=strategy, **kw)
    T = spec.total_len
    q, k, v, dout = _inputs(T, Hq, Hkv, D, dtype, seed)
    if softcap is not None:
        q, k = (t * 2 for t in (q, k))
    dlse = torch.randn(Hq, T, generator=torch.Generator().manual_seed(seed + 1)) if lse_grad else None
    local = plan.local_tokens(rank)
    ql, kl, vl = (plan.shard(t, rank).requires_grad_() for t in (q, k, v))
    with count_bytes() as sent_fwd:
        out, lse = distributed_block_attention(ql, kl, vl, spec, plan, return_lse=True, backend=backend,
                                               comm_method=comm_method, softcap=softcap)
    loss = (out.float() * dout[local].float()).sum()
    if lse_grad:
        loss = loss + (lse * dlse[:, local]).sum()
    with count_bytes() as sent_bwd:
        loss.backward()
    stats = plan.stats()
    where = f"{strategy} {spec!r} rank {rank}/{world}"
    for direction, counter in (("fwd", sent_fwd), ("bwd", sent_bwd)):
        for what, measured in (("sent", counter.sent), ("recv", counter.received)):
            planned = stats[f"bytes_{what}_{direction}"][rank]
            assert measured == planned, f"{where}: {direction} bytes {what} {measured} != plan.stats() {planned}"

    if lse_grad:  # fold the lse term into the reference by differentiating both outputs
        refs = [_reference_with_lse(spec, q, k, v, dout, dlse, dt, softcap) for dt in (torch.float64, dtype)]
    else:
        refs = [_reference(spec, q, k, v, dout, dt, softcap) for dt in (torch.float64, dtype)]
    for name, got, r64, reager in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, ql.grad, kl.grad, vl.grad), *refs):
        try:
            _assert_close(name, got.detach(), r64, reager, dtype, rows=local)
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
    return out.detach()


def _reference_with_lse(spec, q, k, v, dout, dlse, dtype, softcap=None):
    from blockattn.reference import attention

    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention(*leaves, spec, dtype=dtype, softcap=softcap)
    ((out * dout.to(dtype)).sum() + (lse * dlse.to(lse.dtype)).sum()).backward()
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


def run_sinks_case(rank, world, spec, *, strategy, Hq=4, Hkv=2, D=16, dtype=torch.float32, block_size=16):
    """Learned sinks (blockattn/sinks.py) through block_attention on a plan: this rank's out, lse and q,
    k, v gradients, and the sinks' gradient summed over the ranks (each rank's covers its rows), against
    the float64 reference's softmax with a sink column."""
    from blockattn.attention import block_attention
    from blockattn.reference import attention
    from blockattn.planner import make_plan

    kw = dict(num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, dtype=dtype, block_size=block_size)
    plan = (random_plan(spec, world, seed=int(strategy[6:]), **kw) if strategy.startswith("random")
            else make_plan(spec, world, strategy=strategy, **kw))
    T = spec.total_len
    q, k, v, dout = _inputs(T, Hq, Hkv, D, dtype)
    g = torch.Generator().manual_seed(7)
    sinks, dlse = torch.randn(Hq, generator=g) * 2, torch.randn(Hq, T, generator=g)
    local = plan.local_tokens(rank)
    leaves = [plan.shard(t, rank).requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    out, lse = block_attention(*leaves[:3], spec, plan, sinks=leaves[3], return_lse=True, backend="torch")
    ((out.float() * dout[local].float()).sum() + (lse * dlse[:, local]).sum()).backward()
    dsinks = leaves[3].grad.clone()
    dist.all_reduce(dsinks)
    refs = []
    for dt in (torch.float64, dtype):
        ref_leaves = [t.to(dt).requires_grad_() for t in (q, k, v, sinks)]
        r_out, r_lse = attention(*ref_leaves[:3], spec, dtype=dt, sinks=ref_leaves[3])
        ((r_out * dout.to(dt)).sum() + (r_lse * dlse.to(r_lse.dtype)).sum()).backward()
        refs.append([r_out.detach(), r_lse.detach()] + [t.grad for t in ref_leaves])
    where = f"sinks {strategy} {spec!r} rank {rank}/{world}"
    got = (out, lse, leaves[0].grad, leaves[1].grad, leaves[2].grad)
    for name, got_t, r64, reager in zip(("out", "lse", "dq", "dk", "dv"), got, *refs):
        try:
            _assert_close(name, got_t.detach(), r64, reager, dtype, rows=local)
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
    err = (dsinks.double() - refs[0][5]).abs().max().item()
    bound = FACTOR * (refs[1][5].double() - refs[0][5]).abs().max().item() + ATOL[dtype]
    assert err <= bound, f"{where}: dsinks error {err:.3g} > bound {bound:.3g}"


# ----------------------------------------------------------------------------- cases (run in workers)
def _every_mask_world2(rank, world):
    T = 150  # not a multiple of the block (16)
    specs = [
        MaskSpec.full(T),
        MaskSpec.causal(T),
        MaskSpec.sliding_window(T, 40),
        MaskSpec.lambda_mask(T, 8, 30),
        # mask_mod masks use per-tile bitmasks; this one also has a fully masked row (q = 0)
        MaskSpec.from_mask_mod(lambda qi, ki: (ki < qi) & ((qi + ki) % 3 != 0), T),
    ]
    for spec in specs:
        run_case(rank, world, spec)
    # the real Triton kernels (interpreter on CPU), forward (fused accumulate + merge kernel) and
    # backward, GQA 4:1, partial last block, head dim 24 (32-wide tiles, padding neither read nor written),
    # on a plan that moves q-blocks and partials both ways
    run_case(rank, world, MaskSpec.documents([37, 1, 60, 41]), Hq=4, Hkv=1, D=24, backend="triton",
             strategy="random1")
    # logit soft-capping through the fused accumulate, the merges and the backward's partials (Triton)
    run_case(rank, world, MaskSpec.lambda_mask(90, 8, 30), backend="triton", strategy="random12", softcap=3.0,
             lse_grad=True)


def _masks_world3(rank, world):
    run_case(rank, world, MaskSpec.documents([1, 45, 3, 80, 1, 67]))  # documents of length 1, T = 197
    run_case(rank, world, MaskSpec.shared_question(40, [33, 50, 1, 29]))
    run_case(rank, world, MaskSpec.causal_blockwise(205, block=32, k_local=2))
    run_case(rank, world, MaskSpec.documents([90, 71, 40]) & MaskSpec.sliding_window(201, 25))
    run_case(rank, world, MaskSpec.causal(181), dtype=torch.bfloat16, Hq=4, Hkv=4, strategy="random2")
    run_case(rank, world, MaskSpec.lambda_mask(170, 16, 48), lse_grad=True, strategy="random3")
    run_case(rank, world, MaskSpec.documents([1, 45, 3, 80, 1, 67]), strategy="dcp", softcap=3.0, dtype=torch.bfloat16)
    bits_mask = MaskSpec.from_mask_mod(lambda qi, ki: (ki <= qi) & ((qi // 7 + ki // 5) % 4 != 1), 163)
    run_case(rank, world, bits_mask, strategy="random4", Hq=6, Hkv=2)
    run_case(rank, world, MaskSpec.causal(120), strategy="random9-empty1")  # rank 1 holds no token
    # learned sinks: merged at each row's home after its partials; rows with no key attend only the sink
    holes = MaskSpec.from_mask_mod(lambda qi, ki: (ki <= qi) & (qi % 7 != 3), 150)
    run_sinks_case(rank, world, holes, strategy="random11")
    run_sinks_case(rank, world, MaskSpec.documents([1, 45, 3, 80, 1, 67]), strategy="dcp", dtype=torch.bfloat16)
    # dQ / dK / dV partials sent in bf16 (summed in fp32 at home): within the bf16 bound, bytes as planned
    for strategy in ("random10", "dcp"):
        run_case(rank, world, MaskSpec.documents([1, 45, 3, 80, 1, 67]), dtype=torch.bfloat16, Hkv=1,
                 strategy=strategy, grad_comm_dtype=torch.bfloat16)


def _strategies_world4(rank, world):
    spec = MaskSpec.documents([70, 13, 120, 1, 55, 40])
    strategies = ("dcp", "fcp", "ring", "zigzag", "allgather", "random5")
    outs = {s: run_case(rank, world, spec, strategy=s) for s in strategies}
    # every strategy holds different rows per rank: compare them as global tensors
    from blockattn.planner import make_plan

    glob = {}
    for s, o in outs.items():
        kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16)
        plan = random_plan(spec, world, seed=5, **kw) if s == "random5" else make_plan(spec, world, strategy=s, **kw)
        glob[s] = plan.unshard(o, group=dist.group.WORLD)
    for s, g in glob.items():
        torch.testing.assert_close(g, glob["dcp"], rtol=0, atol=2e-5, msg=lambda m: f"{s} vs dcp: {m}")
    run_case(rank, world, MaskSpec.causal(230), comm_method="a2a", Hq=8, Hkv=2, strategy="random6",
             dtype=torch.float16)


def _strategies_world5(rank, world):
    spec = MaskSpec.causal(211)  # prime length: not a multiple of the block or of 5
    for s in ("dcp", "zigzag", "random7"):
        run_case(rank, world, spec, strategy=s)
    run_case(rank, world, MaskSpec.documents([31, 64, 9, 100, 17, 2]), strategy="fcp")
    run_case(rank, world, MaskSpec.shared_question(30, [40, 41, 42]), strategy="random8", block_size=32)


def _relays_world6(rank, world):
    # 3 "nodes" of 2 ranks on a slow NIC: relayed KV (some tiles delayed for it) and DKV reduce trees
    relayed = delayed = trees = 0
    cases = [(MaskSpec.causal_blockwise(205, block=32, k_local=2), {}),
             # gradient partials in bf16: a relay rounds its sum of its children's partials once more
             (MaskSpec.shared_question(64, [50, 70, 40, 60]), dict(comm_method="a2a", dtype=torch.bfloat16, Hkv=1,
                                                                   grad_comm_dtype=torch.bfloat16))]
    for spec, kw in cases:
        dtype, grad_dtype = kw.get("dtype", torch.float32), kw.get("grad_comm_dtype", torch.float32)
        base, plan = relay_plan(spec, world, ranks_per_node=2, num_q_heads=4, num_kv_heads=kw.get("Hkv", 2),
                                head_dim=16, dtype=dtype, block_size=16, grad_comm_dtype=grad_dtype)
        bwd, home = plan.schedule.bwd, plan.block_home.long()
        relayed += plan.stats()["kv_relays"]
        trees += int(((bwd[:, 3] == 5) & (bwd[:, 2] != home[bwd[:, 4].long()])).sum())
        delayed += int((plan.tile_stage != base.tile_stage).sum())
        run_case(rank, world, spec, plan=plan, strategy=plan.strategy, **kw)
    assert relayed and trees and delayed, f"relay cases ran no relay ({relayed}), tree ({trees}) or delay ({delayed})"
    # transit relays: KV received by a rank that computes nothing with it, only to forward it
    spec = MaskSpec.causal_blockwise(205, block=32, k_local=2)
    plan, transit, forwarded = transit_plan(spec, world, ranks_per_node=2, num_q_heads=4, num_kv_heads=2,
                                            head_dim=16, dtype=torch.float32, block_size=16)
    assert transit and forwarded, f"the transit case has {transit} transit receives, {forwarded} forwarded partials"
    run_case(rank, world, spec, plan=plan, strategy=plan.strategy)
    # transit ranks on the homes' nodes: a node-mate of a hot home sends some of its blocks out for it
    # (and forwards the readers' dK/dV partials home)
    spec = MaskSpec.shared_question(64, [50, 70, 40, 60])
    plan, transit, forwarded = transit_plan(spec, world, ranks_per_node=2, num_q_heads=4, num_kv_heads=2,
                                            head_dim=16, dtype=torch.bfloat16, block_size=16, side="home")
    assert transit and forwarded, f"the home-side case has {transit} transit receives, {forwarded} forwarded partials"
    run_case(rank, world, spec, plan=plan, strategy=plan.strategy, dtype=torch.bfloat16)
    # one node of 6: the question fanned out through its first readers (planner/fanout.py), partials
    # reduced up the same tree
    spec = MaskSpec.shared_question(64, [50, 70, 40, 60])
    base, plan = fanout_plan(spec, world, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                             block_size=16)
    bwd, home = plan.schedule.bwd, plan.block_home.long()
    trees = int(((bwd[:, 3] == 5) & (bwd[:, 2] != home[bwd[:, 4].long()])).sum())
    assert plan.stats()["kv_relays"] and trees, f"the fan-out case has {plan.stats()['kv_relays']} relays, {trees} tree hops"
    run_case(rank, world, spec, plan=plan, strategy=plan.strategy)


def _errors_world3(rank, world):
    from blockattn.comms import StageExchange, get_group
    from blockattn.distributed import distributed_block_attention
    from blockattn.planner import make_plan

    spec = MaskSpec.causal(100)
    kw = dict(num_q_heads=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16)

    def expect_error(fn, *fragments):
        with pytest.raises(ValueError) as info:
            fn()
        for frag in fragments:
            assert frag in str(info.value), f"rank {rank}: {frag!r} not in error: {info.value}"

    q, k, v, _ = _inputs(100, 2, 2, 16, torch.float32)
    # 1. rank 1 holds a different plan: every rank raises the same clear error (no hang)
    plan = make_plan(spec, world, strategy="ring" if rank == 1 else "dcp", **kw)
    expect_error(lambda: distributed_block_attention(plan.shard(q, rank), plan.shard(k, rank), plan.shard(v, rank),
                                                     spec, plan, backend="torch"),
                 "different plans", "[[0, 2], [1]]")
    # 2. rank 2 passes the wrong number of rows: every rank hears about rank 2
    plan = make_plan(spec, world, strategy="zigzag", **kw)
    cut = 1 if rank == 2 else 0
    expect_error(lambda: distributed_block_attention(*(plan.shard(t, rank)[cut:] for t in (q, k, v)), spec, plan,
                                                     backend="torch"),
                 "rank 2: q/k/v have", "plan.local_tokens(2)")
    # 3. a plan for 2 ranks on a 3-rank group
    plan2 = make_plan(spec, 2, strategy="dcp", **kw)
    expect_error(lambda: distributed_block_attention(q[:50], k[:50], v[:50], spec, plan2, backend="torch"),
                 "world_size = 2 but the process group has 3 ranks")
    # 4. the same 2-rank plan on a cached sub-group of ranks {0, 2} runs (rank 1 sits out)
    sub = get_group([0, 2])
    assert get_group([2, 0]) is sub, "sub-groups must be created once and cached"
    if rank != 1:
        me = dist.get_rank(sub)
        out = distributed_block_attention(*(plan2.shard(t, me) for t in (q, k, v)), spec, plan2, backend="torch",
                                          group=sub)
        ref = _reference(spec, q, k, v, torch.zeros_like(q), torch.float64)[0]
        torch.testing.assert_close(out.double(), ref[plan2.local_tokens(me)], rtol=0, atol=2e-5)
    # 5. a mask the plan was not made for
    plan = make_plan(spec, world, strategy="allgather", **kw)
    other = MaskSpec.sliding_window(100, 10)
    expect_error(lambda: distributed_block_attention(*(plan.shard(t, rank) for t in (q, k, v)), other, plan,
                                                     backend="torch"),
                 "mask")
    # 6. inputs every rank gets wrong alike: clear local errors before any communication
    plan = make_plan(spec, world, strategy="dcp", **kw)
    local = [plan.shard(t, rank) for t in (q, k, v)]
    with pytest.raises(TypeError, match="make the plan with dtype=torch.bfloat16"):
        distributed_block_attention(*(t.bfloat16() for t in local), spec, plan, backend="torch")
    with pytest.raises(ValueError, match="comm_method"):
        distributed_block_attention(*local, spec, plan, backend="torch", comm_method="ring")
    with pytest.raises(ValueError, match="softmax_scale"):
        distributed_block_attention(*local, spec, plan, backend="torch", softmax_scale=-1.0)
    with pytest.raises(ValueError, match="same shape"):
        distributed_block_attention(local[0], local[1], local[2][:, :1], spec, plan, backend="torch")
    with pytest.raises(ValueError, match="unknown backend"):
        distributed_block_attention(*local, spec, plan, backend="cuda")
    # 7. explicit exchange lifecycle: wait before post, post twice, wait twice
    peer = (rank + 1) % world
    src = (rank - 1) % world
    ex = StageExchange({peer: [torch.full((3,), float(rank))]}, {src: 12}, name="lifecycle")
    with pytest.raises(RuntimeError, match="wait\\(\\) before post"):
        ex.wait()
    ex.post()
    with pytest.raises(RuntimeError, match="post\\(\\) called twice"):
        ex.post()
    got = ex.wait()[src].view(torch.float32)
    assert got.tolist() == [float(src)] * 3
    with pytest.raises(RuntimeError, match="wait\\(\\) called twice"):
        ex.wait()
    with pytest.raises(ValueError, match="invalid peer"):
        StageExchange({rank: [torch.zeros(1)]}, {}, name="self-send")


def _layer_chain(q, k, v, masks, attend):
    """Two "layers" over the same tokens: out1 = attend(q, k, v, masks[0]), out = attend(out1, k, v, masks[1])
    (the second layer's queries are the first layer's output, as a stack of layers passes activations)."""
    out1 = attend(q, k, v, masks[0], 0)
    return attend(out1, k, v, masks[1], 1)


def _shared_homes_world3(rank, world):
    """A global layer (causal documents) and a local one (the same documents under a sliding window) run
    on activations sharded once: make_plans gives both plans the same homes, so one plan.shard serves
    both layers; values and q, k, v gradients through the chain match the float64 reference chain."""
    from blockattn import make_plan, make_plans
    from blockattn.distributed import distributed_block_attention
    from blockattn.reference import attention

    lens = [70, 1, 130, 45, 23]
    T = sum(lens)
    masks = [MaskSpec.documents(lens), MaskSpec.documents(lens) & MaskSpec.sliding_window(T, 24)]
    kw = dict(num_q_heads=4, num_kv_heads=4, head_dim=16, dtype=torch.float32, block_size=16)
    for plans in (make_plans(masks, world, weights=[1, 3], **kw),
                  (make_plan(masks[0], world, **kw), None)):
        if plans[1] is None:  # the same, built by hand: the local layer planned on the global plan's homes
            plans = (plans[0], make_plan(masks[1], world, homes_from=plans[0], **kw))
        assert torch.equal(plans[0].local_tokens(rank), plans[1].local_tokens(rank))
        q, k, v, dout = _inputs(T, 4, 4, 16, torch.float32, seed=5)
        local = plans[0].local_tokens(rank)
        ql, kl, vl = (plans[0].shard(t, rank).requires_grad_() for t in (q, k, v))
        out = _layer_chain(ql, kl, vl, masks,
                           lambda q_, k_, v_, m, i: distributed_block_attention(q_, k_, v_, m, plans[i], backend="torch"))
        (out * dout[local]).sum().backward()

        def reference(dtype):
            leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
            ref = _layer_chain(*leaves, masks, lambda q_, k_, v_, m, i: attention(q_, k_, v_, m, dtype=dtype)[0])
            (ref * dout.to(dtype)).sum().backward()
            return [ref.detach()] + [t.grad for t in leaves]

        for name, got, r64, eager in zip(("out", "dq", "dk", "dv"), (out.detach(), ql.grad, kl.grad, vl.grad),
                                         reference(torch.float64), reference(torch.float32)):
            _assert_close(name, got, r64, eager, torch.float32, rows=local)


# ----------------------------------------------------------------------------- tests
def test_every_mask_kind_two_ranks_with_triton_case():
    spawn(_every_mask_world2, 2)


def test_masks_gqa_bf16_lse_grad_three_ranks():
    spawn(_masks_world3, 3)


def test_baseline_strategies_agree_four_ranks():
    spawn(_strategies_world4, 4)


def test_strategies_awkward_lengths_five_ranks():
    spawn(_strategies_world5, 5)


def test_mismatches_raise_on_every_rank_and_subgroups():
    spawn(_errors_world3, 3)


def test_layers_with_different_masks_share_homes_three_ranks():
    spawn(_shared_homes_world3, 3)


def test_node_relays_six_ranks_three_nodes():
    spawn(_relays_world6, 6)
