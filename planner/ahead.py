"""PlanAhead: plan upcoming batches in worker processes while the current batch trains.

A plan depends only on the batch's mask, so it can be built as soon as the data loader knows the
document lengths - a step or more before the batch reaches the GPU (DCP plans in its data loader).
PlanAhead keeps planning off the training step's critical path: ``submit(mask_spec)`` returns at
once with a Future; the plan is built by ``make_plan`` in a worker process and arrives pickled.

Lifecycle: construct (validates the planning arguments, starts the workers), ``submit`` / ``map``,
``close`` (or use it as a context manager). Every rank can run its own PlanAhead: plans are
deterministic, so every rank receives the identical plan (``block_attention`` checks fingerprints).
With ``map(..., group=...)`` the ranks of a group share the work instead: each plans every G-th
batch and broadcasts it to the others (planner/sharded.py).
Workers start with "spawn" (safe beside CUDA and threads), which re-imports the main module: as
with DataLoader workers, the training script needs the ``if __name__ == "__main__":`` guard.

What stays on the caller's thread: pickling the spec (its constructor call, a few hundred bytes,
``blockattn.masks``) and unpickling the plan (one copy of its index tensors, done by the executor's
result thread before ``result()`` is asked for). ``bench/bench_plan_ahead.py`` measures both.
"""

from __future__ import annotations

import itertools
import pickle
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Iterable, Iterator

import multiprocessing as mp

import torch

from .api import DEFAULT_MEMORY_SLACK, check_mask_spec, check_plan_args, make_plan
from .cost_model import CostModel, Topology
from .plan import Plan
from .shared_homes import check_weights, make_plans
from .sharded import HandOver

_DEAD_WORKER = ("a planning worker process died (killed, e.g. out of memory, or crashed); the plans in flight "
                "are lost: close this PlanAhead and create a new one")
DEFAULT_TIMEOUT_S = 600.0  # longest wait for one plan in ``map`` (a 1M-token / 64-rank plan takes 3-18 s)


def _init_worker() -> None:
    """Worker process start: one thread (the trainer keeps the other cores), planner imported."""
    torch.set_num_threads(1)


def _plan_pickled(spec_bytes: bytes, world_size: int, kwargs: dict, weights=None) -> bytes:
    """Worker side: rebuild the spec, plan it, return the plan pickled by value (no shared-memory
    handles, whose file descriptors a long run would exhaust). A tuple of specs: their plans on shared
    homes (``make_plans`` with ``weights``), as a tuple."""
    spec = pickle.loads(spec_bytes)
    if isinstance(spec, tuple):
        plan = make_plans(spec, world_size, weights=weights, **kwargs)
    else:
        plan = make_plan(spec, world_size, **kwargs)
    return pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)


def _ready() -> bool:
    return True


class PlanAhead:
    """Background planner: ``make_plan(spec, world_size, **plan_kwargs)`` for each submitted spec, in
    ``workers`` processes (start method ``mp_context``: "spawn" is safe next to CUDA and threads); for a
    submitted tuple of specs (one batch's layer masks), ``make_plans(specs, world_size, weights=weights,
    **plan_kwargs)``: their plans on one data placement, ``weights`` the layers under each mask."""

    def __init__(self, world_size: int, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, block_size: int | None = None, strategy: str = "dcp",
                 topology: Topology | None = None, max_stages: int = 4, grad_comm_dtype: torch.dtype = torch.float32,
                 effort: str = "full", workers: int = 1, mp_context: str = "spawn",
                 cost_model: CostModel | None = None, memory_slack: float = DEFAULT_MEMORY_SLACK, weights=None):
        world_size, num_q_heads, num_kv_heads, head_dim, max_stages, cost_model = check_plan_args(
            world_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
            block_size=block_size, strategy=strategy, topology=topology, max_stages=max_stages,
            grad_comm_dtype=grad_comm_dtype, effort=effort, cost_model=cost_model, memory_slack=memory_slack)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}")
        if mp_context not in mp.get_all_start_methods():
            raise ValueError(f"mp_context {mp_context!r} is not available here; choose one of "
                             f"{', '.join(mp.get_all_start_methods())}")
        self.world_size = world_size
        self._kwargs = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                            block_size=block_size, strategy=strategy, cost_model=cost_model, max_stages=max_stages,
                            grad_comm_dtype=grad_comm_dtype, effort=effort, memory_slack=memory_slack)
        # (make_plans', for batches submitted as tuples of masks; their count is checked per batch)
        self._weights = None if weights is None else tuple(check_weights(weights))
        self._pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context(mp_context),
                                         initializer=_init_worker)
        self._started = self._pool.submit(_ready)  # start the workers now, not at the first batch
        self._handover = HandOver()  # map(group=...)'s iterations

    # ------------------------------------------------------------------ post
    def submit(self, mask_spec) -> "Future[Plan]":
        """Start planning ``mask_spec``; the Future's ``result()`` is the Plan (or raises what
        ``make_plan`` raised, e.g. ValueError for a bad block size). A tuple or list of MaskSpecs (the
        masks of one batch's layers): their plans on one data placement, a tuple (``make_plans``, with
        this PlanAhead's ``weights``)."""
        planned = self._submit_pickled(mask_spec)
        plan: Future = Future()
        planned.add_done_callback(lambda done: _unpickle_into(done, plan))
        return plan

    def _submit_pickled(self, mask_spec) -> "Future[bytes]":
        """``submit``, the plan left pickled (as the worker returns it)."""
        if self._pool is None:
            raise RuntimeError("PlanAhead is closed; create a new one to plan more batches")
        if isinstance(mask_spec, (tuple, list)):
            mask_spec = tuple(mask_spec)
            if not mask_spec:
                raise ValueError("submit got an empty tuple of masks: pass a MaskSpec or the masks of one batch")
            for spec in mask_spec:
                check_mask_spec(spec)
        else:
            check_mask_spec(mask_spec)
        try:
            spec_bytes = pickle.dumps(mask_spec, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError) as err:
            raise TypeError(f"{mask_spec!r} cannot be sent to a planning process ({err}). A MaskSpec.from_mask_mod "
                            "mask needs a module-level function (not a lambda or closure); or plan it in "
                            "this process with make_plan") from err
        try:
            return self._pool.submit(_plan_pickled, spec_bytes, self.world_size, self._kwargs, self._weights)
        except BrokenProcessPool as err:
            raise RuntimeError(_DEAD_WORKER) from err

    # ------------------------------------------------------------------ post + wait, in order
    def map(self, mask_specs: Iterable, *, depth: int = 2, timeout: float | None = DEFAULT_TIMEOUT_S,
            group=None) -> Iterator[Plan]:
        """The plans of ``mask_specs``, in order, keeping ``depth`` of them in flight ahead of the
        one being consumed (iterate it beside the data loader). ``timeout``: seconds to wait for
        one plan before TimeoutError (None: wait forever).

        ``group``: a torch.distributed process group (e.g. the context-parallel group, or
        ``torch.distributed.group.WORLD``) whose ranks all iterate the same ``mask_specs``: planning is
        then shared, batch k planned only by the group's rank k % G and broadcast to the others as it
        is consumed (planner/sharded.py), so each rank plans 1/G of the batches, ``depth`` of its own
        in flight; ``mask_specs`` is then read ahead by a background thread, which also hands the plans
        over (on a gloo group of the same ranks, made at the first such ``map`` with ``timeout`` plus
        HANDOVER_MARGIN_S as its timeout). Every rank of the group must consume every plan, in order
        (a collective); ranks that disagree on the batches, and a batch whose planning fails, raise the
        same error on every rank."""
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        if group is not None and _group_size(group) > 1:
            yield from self._handover.start(self, mask_specs, depth=depth, timeout=timeout, group=group)
            return
        specs = iter(mask_specs)
        pending = deque(self.submit(spec) for spec in itertools.islice(specs, depth))
        while pending:
            plan = pending.popleft()
            for spec in itertools.islice(specs, 1):
                pending.append(self.submit(spec))
            yield self._wait_for(plan, timeout)

    @staticmethod
    def _wait_for(future: Future, timeout: float | None):
        """``future.result(timeout)``, a stuck or dead worker reported as TimeoutError / RuntimeError."""
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            raise TimeoutError(f"no plan after {timeout} s: the planning worker is stuck or far slower than "
                               "expected; raise timeout= or check the worker processes") from None
        except BrokenProcessPool as err:
            raise RuntimeError(_DEAD_WORKER) from err

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the workers (plans in flight are finished first) and a shared ``map``'s hand-over."""
        self._handover.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "PlanAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            try:
                pool.shutdown(wait=False, cancel_futures=True)
            except Exception:  # noqa: BLE001 - interpreter shutdown: the pool's own exit hook stops the workers
                pass


def _group_size(group) -> int:
    """Ranks in a torch.distributed process group (ValueError before torch.distributed is initialized)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("PlanAhead.map(group=...) shares planning over a torch.distributed process group: "
                         "call torch.distributed.init_process_group first, or pass group=None to plan every "
                         "batch on this rank")
    if dist.get_rank(group) < 0:
        raise ValueError(f"PlanAhead.map(group=...): this rank ({dist.get_rank()}) is not a member of the group "
                         f"(ranks {dist.get_process_group_ranks(group)}); pass the group this rank plans with")
    return dist.get_world_size(group)


def _unpickle_into(done: Future, plan: Future) -> None:
    """Executor result thread: turn the worker's bytes into the Plan (or pass its exception on)."""
    if done.cancelled():
        plan.cancel()
        return
    err = done.exception()
    if err is not None:
        plan.set_exception(err)
        return
    try:
        plan.set_result(pickle.loads(done.result()))
    except BaseException as unpickle_err:  # noqa: BLE001 - handed to whoever waits on the plan
        plan.set_exception(unpickle_err)
