"""A random search over make_plan's arguments: every plan checked, and dcp against what it promises.

Each batch draws a mask (Wikipedia-length documents, documents of 1-3 tokens, a few long documents;
causal documents, lambda, shared question, causal-blockwise, sliding window, bidirectional documents,
one causal sequence), a length of 1-40K tokens, 1-64 ranks with 1-8 per node or all on one, a block
size (16-256 or the default) - or, one batch in eight, 40-160K tokens on 2-64 ranks of one node in
blocks of 128 or the default (planned on merged blocks) -, query / KV heads, dtypes and the gradient
partials' dtype, and one batch in four other hardware than the default H200 cost model's (link
speeds and latencies, attention TFLOP/s: ``OTHER_HARDWARE``), and plans it with every strategy with
``check_plan`` on, and the batch under a window of an eighth of its length on dcp's homes
(``make_plan(homes_from=...)``, a model's local layers). A batch fails if planning raises, if the local tokens are not a partition of the
batch, if a rank holds more blocks than the placements promise (the mean plus make_plan's default
``memory_slack`` or the contiguous cuts' slack, and two blocks, merged where dcp merges them), or if dcp
is slower (simulated fwd + bwd) than what planner/dcp.py promises: on several nodes
no slower than zigzag, allgather, ring or the fcp strategy; on one node no slower than the baselines
where its plan is over GOOD_ENOUGH of the bound and the batch is planned on its real blocks, and by
at most RIVAL_GAIN where its plan is within GOOD_ENOUGH. Session 41 ran 4310
such batches (docs/planner_log.md).

    python bench/search_planner.py [--seed 0] [--minutes 10 | --batches N] [--out bench/results/search_planner.json]
                                   [--seqlens ../shared/data/wikipedia_seqlens.txt]
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from bench_planner import SEQLENS
from blockattn.masks import MaskSpec
from blockattn.planner import CostModel, Topology, clear_plan_cache, make_plan
from blockattn.planner.candidates import coarsening_factor
from blockattn.planner.dcp import DEFAULT_MEMORY_SLACK, RIVAL_GAIN
from blockattn.planner.first_pass import GOOD_ENOUGH
from blockattn.planner.starts import CUT_SLACK
from blockattn.planner.tiles import TileSet

STRATEGIES = ("dcp", "fcp", "zigzag", "ring", "allgather")
BASELINES = ("zigzag", "ring", "allgather")
WORLD_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
LARGE_ONE_NODE = 0.125
OTHER_HARDWARE = 0.25  # batches planned for a cost model other than the default (``hardware``)


def draw_batch(rng: np.random.Generator, wiki: np.ndarray) -> tuple[MaskSpec, dict, dict]:
    """(mask, make_plan arguments, a JSON-ready record of both) of one random batch."""
    # one batch in eight large and on one node: planned on merged blocks, where dcp's one-node shortcuts are
    # (its re-plan there once returned an unscored plan: a TypeError, found by such a search)
    large = rng.random() < LARGE_ONE_NODE
    T = int(rng.integers(40000, 160000) if large else
            rng.choice([rng.integers(1, 300), rng.integers(300, 8000), rng.integers(8000, 40000)]))
    kind = int(rng.integers(0, 6))
    lens: list[int] = []
    while sum(lens) < T:
        if kind == 0:
            n = int(wiki[rng.integers(wiki.size)])
        elif kind == 1:
            n = int(rng.integers(1, 4))
        else:
            n = int(rng.integers(1, max(2, T // int(rng.integers(1, 6)))))
        lens.append(max(1, min(n, T - sum(lens))))
    T = sum(lens)
    mask = int(rng.integers(0, 7))
    names = ("causal_docs", "lambda_docs", "shared_question", "causal_blockwise", "sliding_window",
             "bidirectional_docs", "causal")
    name = names[mask] if mask != 2 or len(lens) > 1 else names[0]
    docs = MaskSpec.documents(lens)
    if mask == 1:
        spec = docs & MaskSpec.lambda_mask(T, int(rng.integers(0, 64)), int(rng.integers(1, 4096)))
    elif mask == 2 and len(lens) > 1:
        spec = MaskSpec.shared_question(lens[0], lens[1:])
    elif mask == 3:
        spec = MaskSpec.causal_blockwise(T, block=int(rng.choice([64, 256, 1000])), k_local=int(rng.integers(1, 4)))
    elif mask == 4:
        spec = MaskSpec.sliding_window(T, int(rng.integers(1, 3000)))
    elif mask == 5:
        spec = MaskSpec.documents(lens, causal=False)
    elif mask == 6:
        spec = MaskSpec.causal(T)
    else:
        spec = docs
    P = int(rng.choice(WORLD_SIZES[1:] if large else WORLD_SIZES))
    rpn = P if large else int(rng.choice([1, 2, 3, 4, 8, P]))
    block = rng.choice([0, 128] if large else [0, 16, 32, 64, 128, 256])
    hq = int(rng.choice([4, 8, 32]))
    hkv = int(rng.choice([g for g in (1, 2, 4, 8) if hq % g == 0]))
    dtype = [torch.bfloat16, torch.float16][int(rng.integers(0, 2))]
    grad = [torch.float32, torch.bfloat16][int(rng.integers(0, 2))] if dtype == torch.bfloat16 else torch.float32
    args = dict(world_size=P, ranks_per_node=rpn, block_size=int(block) or None, num_q_heads=hq, num_kv_heads=hkv,
                head_dim=64, dtype=dtype, grad_comm_dtype=grad, hardware=None)
    if rng.random() < OTHER_HARDWARE:
        # from PCIe-class links to links as fast as NVLink, from slow kernels to compute-bound heads
        args["hardware"] = dict(intra_bw=float(rng.choice([64e9, 450e9, 900e9])),
                                inter_bw=float(rng.choice([12.5e9, 50e9, 100e9, 450e9])),
                                intra_lat=float(rng.choice([0.0, 5e-6, 30e-6])),
                                inter_lat=float(rng.choice([0.0, 15e-6, 100e-6])),
                                fwd_tflops=float(rng.choice([60, 200, 500, 2000])),
                                bwd_tflops=float(rng.choice([40, 200, 500, 1500])))
    record = dict(args, tokens=T, documents=len(lens) if name.endswith("docs") or mask == 2 else 1, mask=name,
                  dtype=str(dtype), grad_comm_dtype=str(grad), large=large)
    return spec, args, record


SHARED_HOMES = "dcp on dcp's homes, windowed"  # (check_batch's key of the windowed mask's plan on dcp's homes)


def check_batch(spec: MaskSpec, args: dict) -> tuple[dict, str | None]:
    """({strategy: fwd + bwd over the bound}, None or what failed) of one batch."""
    P, rpn, hardware = args["world_size"], args["ranks_per_node"], args.get("hardware")
    kw = {k: v for k, v in args.items() if k not in ("world_size", "ranks_per_node", "hardware")}
    if hardware is None:
        kw["topology"] = Topology(ranks_per_node=rpn)
    else:
        links = {k: v for k, v in hardware.items() if not k.endswith("tflops")}
        kw["cost_model"] = CostModel.from_kernel_tflops(hardware["fwd_tflops"], hardware["bwd_tflops"],
                                                        topology=Topology(ranks_per_node=rpn, **links))
    over = {}
    dcp_merged = 1  # (the factor dcp merges blocks by, for its memory promise and its promise on one node)
    for strategy in STRATEGIES:
        plan = make_plan(spec, P, strategy=strategy, check=True, **kw)
        tokens = torch.cat([plan.local_tokens(r) for r in range(P)])
        if not torch.equal(tokens.sort().values, torch.arange(spec.total_len)):
            return over, f"{strategy}: the ranks' local tokens are not a partition of the batch"
        # what the placements promise (docs/design.md): the mean plus dcp's memory slack or the contiguous
        # start's two cuts' slack, and two blocks (zigzag's chunks i and 2P-1-i each round up), merged ones
        # where dcp plans on merged blocks
        held = np.bincount(plan.block_home.numpy(), minlength=P).max()
        if strategy == "dcp":
            dcp_merged = coarsening_factor(TileSet.from_block_mask(spec.block_mask(plan.block_size)), P,
                                               plan.topology)
        merged = dcp_merged if strategy == "dcp" else 1
        if held > plan.num_blocks * (1 + max(DEFAULT_MEMORY_SLACK, 2 * CUT_SLACK)) / P + 2 * merged:
            return over, (f"{strategy}: a rank holds {held} of {plan.num_blocks} blocks, over the mean plus "
                          f"the memory slack and two (merged) blocks")
        over[strategy] = plan.stats()["sim_over_bound"]
        if strategy == "dcp":
            # a local layer's mask (the batch under a window of an eighth of it) planned on these homes
            local = spec & MaskSpec.sliding_window(spec.total_len, max(1, spec.total_len // 8))
            shared = make_plan(local, P, check=True, homes_from=plan, **kw)
            if not torch.equal(shared.block_home, plan.block_home):
                return over, "dcp on given homes (homes_from) changed them"
            over[SHARED_HOMES] = shared.stats()["sim_over_bound"]
    slack = 1e-9
    if P > rpn:
        promised = BASELINES + ("fcp",)
    elif over["dcp"] <= GOOD_ENOUGH:
        promised, slack = BASELINES, RIVAL_GAIN + 1e-9
    else:
        promised = BASELINES if dcp_merged == 1 else ()
    faster = [s for s in promised if over[s] * (1 + slack) < over["dcp"]]
    return over, (f"dcp slower than {', '.join(faster)}" if faster else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--batches", type=int, default=None, help="stop after this many batches (else --minutes)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "search_planner.json"))
    ap.add_argument("--seqlens", default=str(SEQLENS), help="document lengths to draw from, one per line")
    opts = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(opts.seed)
    wiki = np.loadtxt(opts.seqlens, dtype=np.int64, ndmin=1)
    deadline = time.time() + 60 * opts.minutes
    done, failures, slowest = 0, [], (0.0, None)
    drawn = {"large_one_node": 0, "other_hardware": 0}  # (how many batches of each special kind were drawn)
    while (done < opts.batches) if opts.batches is not None else (time.time() < deadline):
        spec, args, record = draw_batch(rng, wiki)
        drawn["large_one_node"] += record["large"]
        drawn["other_hardware"] += record["hardware"] is not None
        t0 = time.perf_counter()
        try:
            over, failure = check_batch(spec, args)
        except Exception:  # (a planning error is a finding: recorded with its batch, the search goes on)
            over, failure = {}, traceback.format_exc(limit=3)
        seconds = time.perf_counter() - t0
        if failure is not None:
            failures.append(dict(record, failure=failure, over_bound=over))
            print("FAIL", record, failure, flush=True)
        if seconds > slowest[0]:
            slowest = (seconds, record)
        done += 1
        clear_plan_cache()
    report = {"seed": opts.seed, "batches": done, **drawn, "failures": failures,
              "slowest_batch": {"seconds_all_strategies": slowest[0], "batch": slowest[1]}}
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"{done} batches ({drawn['large_one_node']} large on one node, {drawn['other_hardware']} on other hardware), "
          f"{len(failures)} failures -> {opts.out}")


if __name__ == "__main__":
    main()
