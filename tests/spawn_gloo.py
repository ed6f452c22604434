"""Run a test case on several CPU ranks: spawned processes in one gloo process group (127.0.0.1, a free
port), ``case(rank, world)`` on each; a case failing on any rank fails the test."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from blockattn.demo import free_port

GLOO_TIMEOUT_S = 120  # a bug that leaves a peer waiting fails the test instead of hanging CI


def _entry(rank: int, world: int, port: int, case) -> None:
    torch.set_num_threads(1)  # several ranks share 2 cores: intra-op threads would only oversubscribe
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    try:
        case(rank, world)
    finally:
        dist.destroy_process_group()


def spawn(case, world: int) -> None:
    """``case(rank, world)`` (a module-level function) on ``world`` spawned gloo ranks."""
    mp.spawn(_entry, args=(world, free_port(), case), nprocs=world, join=True)
