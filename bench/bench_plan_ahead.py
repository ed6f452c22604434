"""Planning off the critical path: how much of make_plan's time a training step still sees with PlanAhead.

A training loop consumes one plan per step. Planned in the step (``make_plan``), the whole planning
time is on the critical path; planned ahead (``PlanAhead.map``, one worker process), the step only
waits if the worker fell behind, plus the hand-over (pickling the spec, unpickling the plan). The
step's GPU work is simulated by sleeping ``--step-s`` seconds (on a GPU node the training thread
mostly waits on the device, like a sleep).

For Wikipedia-length batches of 128K tokens / 8 ranks and 1M tokens / 64 ranks (dcp, Llama-3-8B
attention heads; 1M / 64 with one and with two worker processes), it records per step: the
synchronous planning time, the time the loop waited for the planned-ahead plan, and the hand-over
costs, and writes them to JSON. A worker keeps up while planning a batch takes less than a step.

Planning shared by a group (``map(group=...)``): 1M / 64 again with ``--shared-ranks`` gloo ranks on
this machine, one worker each, every rank planning every G-th batch and receiving the others' plans by
broadcast; it records each rank's waits and how many batches it planned.

    python bench/bench_plan_ahead.py [--steps 8] [--step-s 1.0] [--out bench/results/bench_plan_ahead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import time
from pathlib import Path

import numpy as np
import torch

from bench_planner import HEADS, SEQLENS, wiki_batch
from blockattn.masks import MaskSpec
from blockattn.planner import PlanAhead, clear_plan_cache, make_plan


def run_config(tokens: int, world_size: int, steps: int, step_s: float, seed: int, workers: int) -> dict:
    rng = np.random.default_rng(seed)
    wiki = np.loadtxt(SEQLENS, dtype=np.int64)
    lens = [wiki_batch(rng, wiki, tokens) for _ in range(steps)]

    sync_ms = []
    for doc_lens in lens:  # planned in the step: the spec is built there too
        clear_plan_cache()
        t0 = time.perf_counter()
        plan = make_plan(MaskSpec.documents(doc_lens), world_size, check=False, **HEADS)
        sync_ms.append(1e3 * (time.perf_counter() - t0))
    plan_bytes = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    t0 = time.perf_counter()
    pickle.loads(plan_bytes)
    unpickle_ms = 1e3 * (time.perf_counter() - t0)
    spec = MaskSpec.documents(lens[-1])
    t0 = time.perf_counter()
    spec_bytes = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
    spec_pickle_ms = 1e3 * (time.perf_counter() - t0)

    t0 = time.perf_counter()
    planner = PlanAhead(world_size, workers=workers, **HEADS)
    planner._started.result()
    startup_s = time.perf_counter() - t0
    waits_ms, fingerprints_match = [], True
    with planner:
        plans = planner.map((MaskSpec.documents(doc_lens) for doc_lens in lens), depth=2 * workers)
        for step, doc_lens in enumerate(lens):
            t0 = time.perf_counter()
            plan = next(plans)
            waits_ms.append(1e3 * (time.perf_counter() - t0))
            if step == 0:  # same plan as in-process planning (determinism across processes)
                clear_plan_cache()
                fingerprints_match = plan.fingerprint() == make_plan(MaskSpec.documents(doc_lens), world_size,
                                                                    check=False, **HEADS).fingerprint()
            time.sleep(step_s)  # the step's GPU work
    steady = waits_ms[1:]  # the first plan cannot be planned ahead of the loop's start
    return {"tokens": tokens, "world_size": world_size, "workers": workers, "steps": steps, "step_s": step_s,
            "worker_startup_s": startup_s, "sync_plan_ms": sync_ms, "sync_plan_ms_median": float(np.median(sync_ms)),
            "ahead_wait_ms": waits_ms, "ahead_wait_ms_steady_median": float(np.median(steady)),
            "ahead_wait_ms_steady_max": float(np.max(steady)), "plan_pickle_bytes": len(plan_bytes),
            "plan_unpickle_ms": unpickle_ms, "spec_pickle_bytes": len(spec_bytes), "spec_pickle_ms": spec_pickle_ms,
            "fingerprint_matches_in_process_plan": fingerprints_match}


def _shared_rank(rank: int, ranks: int, port: int, tokens: int, world_size: int, steps: int, step_s: float,
                 seed: int, out) -> None:
    """One rank of the shared-planning run: PlanAhead(workers=1).map(group=WORLD) in a simulated loop."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=1800))
    try:
        rng = np.random.default_rng(seed)
        wiki = np.loadtxt(SEQLENS, dtype=np.int64)
        lens = [wiki_batch(rng, wiki, tokens) for _ in range(steps)]
        specs = [MaskSpec.documents(doc_lens) for doc_lens in lens]
        signatures = [spec.signature() for spec in specs]
        with PlanAhead(world_size, workers=1, **HEADS) as planner:
            planner._started.result()
            planned = []  # the batches this rank's workers planned, as submitted
            submit = planner._submit_pickled
            planner._submit_pickled = lambda spec: planned.append(signatures.index(spec.signature())) or submit(spec)
            dist.barrier()
            waits_ms, fingerprints = [], []
            plans = planner.map(iter(specs), depth=2, group=dist.group.WORLD)
            for _ in lens:
                t0 = time.perf_counter()
                plan = next(plans)
                waits_ms.append(1e3 * (time.perf_counter() - t0))
                fingerprints.append(plan.fingerprint())
                time.sleep(step_s)
        out.put({"rank": rank, "waits_ms": waits_ms, "planned_batches": planned, "fingerprints": fingerprints})
    finally:
        dist.destroy_process_group()


def run_shared(tokens: int, world_size: int, steps: int, step_s: float, seed: int, ranks: int) -> dict:
    """``run_config`` with planning shared by ``ranks`` gloo ranks (one worker each)."""
    import torch.multiprocessing as mp

    from blockattn.demo import free_port

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_shared_rank, args=(ranks, free_port(), tokens, world_size, steps, step_s, seed, queue), nprocs=ranks,
             join=True)
    per_rank = sorted((queue.get() for _ in range(ranks)), key=lambda r: r["rank"])
    steady = [w for r in per_rank for w in r["waits_ms"][1:]]
    return {"tokens": tokens, "world_size": world_size, "shared_by_ranks": ranks, "workers_per_rank": 1,
            "steps": steps, "step_s": step_s, "per_rank": [{k: v for k, v in r.items() if k != "fingerprints"}
                                                          for r in per_rank],
            "ahead_wait_ms_steady_median": float(np.median(steady)), "ahead_wait_ms_steady_max": float(np.max(steady)),
            "same_plans_on_every_rank": all(r["fingerprints"] == per_rank[0]["fingerprints"] for r in per_rank)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--step-s", type=float, default=1.0, help="simulated GPU time of one training step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared-ranks", type=int, default=2, help="ranks sharing the planning (0: skip)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "bench_plan_ahead.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    # one worker keeps up while a plan takes less than a step; at 1M / 64 on a slow CPU it may not
    results = [run_config(tokens, world_size, args.steps, args.step_s, args.seed, workers)
               for tokens, world_size, workers in ((128 * 1024, 8, 1), (1 << 20, 64, 1), (1 << 20, 64, 2))]
    shared = ([run_shared(1 << 20, 64, args.steps, args.step_s, args.seed, args.shared_ranks)]
              if args.shared_ranks > 1 else [])
    report = {"config": {"heads": HEADS, "strategy": "dcp", "host": platform.node(), "cpu_count": os.cpu_count()},
              "results": results, "shared": shared}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for r in results:
        print(f"{r['tokens'] // 1024}K tokens / {r['world_size']} ranks, {r['workers']} worker(s): in-step planning {r['sync_plan_ms_median']:.1f} ms"
              f" median; planned ahead, the step waits {r['ahead_wait_ms_steady_median']:.2f} ms median,"
              f" {r['ahead_wait_ms_steady_max']:.2f} ms max (plan {r['plan_pickle_bytes'] / 2**20:.1f} MiB,"
              f" unpickled in {r['plan_unpickle_ms']:.1f} ms off the loop's thread; spec {r['spec_pickle_bytes']} B"
              f" in {r['spec_pickle_ms']:.2f} ms); worker start {r['worker_startup_s']:.1f} s;"
              f" same plan as in-process: {r['fingerprint_matches_in_process_plan']}")
    for r in shared:
        print(f"{r['tokens'] // 1024}K tokens / {r['world_size']} ranks, planning shared by {r['shared_by_ranks']} ranks"
              f" (one worker each): the step waits {r['ahead_wait_ms_steady_median']:.2f} ms median,"
              f" {r['ahead_wait_ms_steady_max']:.2f} ms max; each rank planned "
              f"{[len(p['planned_batches']) for p in r['per_rank']]} of {r['steps']} batches;"
              f" same plans on every rank: {r['same_plans_on_every_rank']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
