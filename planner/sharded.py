"""Planning shared by a process group: each rank plans every G-th batch and hands its plans to the others.

Every rank of a context-parallel group needs the same plan for every batch, and plans are
deterministic, so planning each batch on every rank repeats the same work G times. Shared instead
(``PlanAhead.map(..., group=...)``), batch k is planned only by the group's rank ``k % G``, in its
PlanAhead workers, ahead of time, and handed to the other ranks by a broadcast: a rank spends 1/G of
the planning time per batch. At 1M tokens / 64 ranks a plan takes seconds of CPU; a group of 64
plans 64 batches in the time one rank plans one.

The hand-over runs in a background thread per rank, on a gloo group of the same ranks made for it
(``_handover_group``: CPU tensors whatever the training backend, and the training's own collectives
never interleave with it), so the training step only takes finished plans from a queue. Lifecycle of
batch k, in every rank's thread, in order:

1. post: read the batches ahead until ``depth`` of this rank's own are being planned.
2. header: one all_gather of (has batch k, its mask signature's hash, the owner's status, the
   payload's size, whether this rank's consumer has stopped). Every rank sees the same table and so
   decides the same: all ranks done ends the iteration; ranks disagreeing on the batch count or the
   mask raise the same ValueError; a stopped consumer stops every rank's iteration.
3. payload: one broadcast from the owner: the pickled plan, or its error (type and message), which
   every rank then raises alike - never one rank raising while the others wait in a collective.
4. wait: the plan is unpickled and queued (at most ``depth`` ahead of the consumer).

The owner waits at most ``timeout`` for its worker before it posts the header (a TimeoutError
then); the others wait in the header's all_gather, bounded by the hand-over group's timeout
(``timeout`` plus HANDOVER_MARGIN_S).
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import pickle
import queue
import threading
from collections import deque
from typing import Iterable

import numpy as np
import torch

HANDOVER_MARGIN_S = 300.0  # the hand-over group's collectives may wait this much longer than an owner
_POLL_S = 0.1  # a blocked queue operation rechecks whether the other side stopped this often
_CLOSE_WAIT_S = 10.0  # PlanAhead.close waits this long for a stopped hand-over's last collective
# header columns
_HAS_BATCH, _SIGNATURE, _STATUS, _NBYTES, _STOPPED = range(5)
_NOT_OWNER, _PLANNED, _FAILED = -1, 0, 1
# errors rebuilt on every rank as the type the owner's planning raised (others: RuntimeError)
_ERROR_TYPES = {cls.__name__: cls for cls in (ValueError, TypeError, RuntimeError, TimeoutError, MemoryError)}
_END = object()


# The gloo groups plans are handed over on, one per ranks tuple, made at the first shared ``map`` over
# them and kept for the process's life (under the default process group they were made in): a group
# destroyed and made again over the same ranks reuses its hashed name, and peers that still hold the old
# one, or the store's keys of its rendezvous, then hang or refuse the connection. One iteration at a time
# runs on each (``_RUNNING``): a new one ends the last, whichever PlanAhead started it.
_GROUPS: dict = {}
_RUNNING: dict = {}
_GROUPS_WORLD: list = [None]  # the default process group _GROUPS belong to


def _handover_group(ranks: tuple, timeout: float | None):
    """The hand-over gloo group of ``ranks`` (made by the first caller; every rank of it calls this)."""
    import torch.distributed as dist

    if _GROUPS_WORLD[0] is not dist.group.WORLD:  # torch.distributed initialized anew: its groups are gone
        _GROUPS.clear()
        _RUNNING.clear()
        _GROUPS_WORLD[0] = dist.group.WORLD
    if ranks not in _GROUPS:
        wait = None if timeout is None else datetime.timedelta(seconds=timeout + HANDOVER_MARGIN_S)
        _GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", timeout=wait, use_local_synchronization=True)
    return _GROUPS[ranks]


class HandOver:
    """A PlanAhead's shared iterations: ``start`` ends the one running on the same ranks (each rank's
    hand-over group carries one iteration at a time) and starts a new one; ``close`` ends its own."""

    def __init__(self):
        self._mine: dict = {}  # ranks -> the SharedPlans this PlanAhead started

    def start(self, planner, mask_specs: Iterable, *, depth: int, timeout: float | None, group) -> "SharedPlans":
        import torch.distributed as dist

        ranks = tuple(dist.get_process_group_ranks(group))
        handover = _handover_group(ranks, timeout)
        _end(_RUNNING.pop(ranks, None), None)
        shared = SharedPlans(planner, mask_specs, depth=depth, timeout=timeout, group=handover)
        _RUNNING[ranks] = self._mine[ranks] = shared
        return shared

    def close(self) -> None:
        """End the iterations this PlanAhead started, waiting briefly for each one's last collective (it
        needs the peers: a thread still waiting on a lost peer is left to its group's timeout)."""
        for ranks, shared in self._mine.items():
            if _RUNNING.get(ranks) is shared:
                del _RUNNING[ranks]
            _end(shared, _CLOSE_WAIT_S)
        self._mine.clear()


def _end(shared, wait_s: float | None) -> None:
    """Stop a SharedPlans iteration (None: nothing) and wait for its thread (at most ``wait_s``)."""
    if shared is not None:
        shared.close()
        shared._thread.join(wait_s)


class SharedPlans:
    """Iterator of ``PlanAhead.map(..., group=...)``'s plans, in order (see the module docstring), handed
    over on the gloo group ``group`` (``_handover_group``'s). ``close()`` stops it (every rank's iteration
    then ends with a RuntimeError)."""

    def __init__(self, planner, mask_specs: Iterable, *, depth: int, timeout: float | None, group):
        import torch.distributed as dist

        self._group = group
        self._size, self._me = dist.get_world_size(group), dist.get_rank(group)
        self._planner, self._specs, self._depth, self._timeout = planner, iter(mask_specs), depth, timeout
        self._ready: queue.Queue = queue.Queue(maxsize=depth)
        self._stopped = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._hand_over, name="blockattn-plan-handover", daemon=True)
        self._thread.start()

    def __iter__(self) -> "SharedPlans":
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        while True:
            try:
                kind, value = self._ready.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._ready.empty():
                    self._finished = True
                    raise RuntimeError("the plan hand-over thread stopped without a result") from None
        if kind == "plan":
            return value
        self._finished = True
        if kind == "end":
            raise StopIteration
        raise value

    def close(self) -> None:
        """Stop the hand-over: this rank posts no batch after the one in flight, and every rank's
        iteration ends (a RuntimeError on the ranks still consuming)."""
        self._stopped.set()
        self._finished = True

    # ------------------------------------------------------------------ the hand-over thread
    def _hand_over(self) -> None:
        import torch.distributed as dist

        size, me = self._size, self._me
        window = deque()  # (spec, Future[bytes] or None, error or None) of the batches read, oldest first
        read = own = 0  # batches read; of those, this rank's still in the window
        exhausted = False
        try:
            for k in itertools.count():
                stopping = self._stopped.is_set()  # (then posted at once: the peers stop too)
                while not stopping and not exhausted and own < self._depth:  # post
                    spec = next(self._specs, _END)
                    if spec is _END:
                        exhausted = True
                        break
                    future = error = None
                    if read % size == me:
                        try:
                            future = self._planner._submit_pickled(spec)
                        except Exception as err:  # noqa: BLE001 - raised on every rank at this batch's hand-over
                            error = err
                        own += 1
                    window.append((spec, future, error))
                    read += 1
                spec, future, error = window.popleft() if window and not stopping else (None, None, None)
                owner = k % size
                payload, status = b"", _NOT_OWNER
                if owner == me and spec is not None:
                    own -= 1
                    payload, status = _wait(self._planner, future, error, self._timeout)
                header = torch.tensor([spec is not None, _signature_hash(spec), status, len(payload), stopping],
                                      dtype=torch.int64)
                table = [torch.zeros(5, dtype=torch.int64) for _ in range(size)]
                dist.all_gather(table, header, group=self._group)
                table = torch.stack(table).numpy()
                if table[:, _STOPPED].any():
                    raise RuntimeError(f"PlanAhead.map(group=...): ranks {np.flatnonzero(table[:, _STOPPED]).tolist()} "
                                       f"of the group stopped consuming plans at batch {k}; every rank of the "
                                       "group must consume every plan")
                if not table[:, _HAS_BATCH].any():
                    self._put(("end", None))
                    return
                _check_agreement(table, k)
                buf = torch.empty(int(table[owner, _NBYTES]), dtype=torch.uint8)
                if owner == me:
                    buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
                dist.broadcast(buf, src=dist.get_global_rank(self._group, owner), group=self._group)
                received = payload if owner == me else buf.numpy().tobytes()
                if table[owner, _STATUS] == _FAILED:
                    name, message = pickle.loads(received)
                    raise _ERROR_TYPES.get(name, RuntimeError)(
                        f"{message} (batch {k}, planned by rank {owner} of the group)")
                self._put(("plan", pickle.loads(received)))  # (dropped once stopped: the next header says so)
        except Exception as err:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(("error", err))

    def _put(self, item) -> None:
        """Queue ``item`` for the consumer (dropped once the consumer has stopped)."""
        while not self._stopped.is_set():
            try:
                self._ready.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue


def _wait(planner, future, error, timeout: float | None) -> tuple[bytes, int]:
    """(payload, status) of this rank's own batch: its pickled plan, or its error pickled as (type, message)."""
    if error is None:
        try:
            return planner._wait_for(future, timeout), _PLANNED
        except Exception as err:  # noqa: BLE001 - make_plan's error or a stuck / dead worker: raised on every rank
            error = err
    return pickle.dumps((type(error).__name__, str(error))), _FAILED


def _signature_hash(spec) -> int:
    """int63 hash of a batch's mask signature; 0: no batch; 1: no signature to compare (a broken spec,
    whose error its owner's planning raises on every rank)."""
    if spec is None:
        return 0
    try:
        # (a batch of several masks, planned on shared homes: their signatures in order)
        signature = "|".join(str(one.signature()) for one in spec) if isinstance(spec, tuple) else str(spec.signature())
    except Exception:  # noqa: BLE001 - e.g. a mask_mod failing on the full batch, reported via its owner
        return 1
    return int.from_bytes(hashlib.sha256(signature.encode()).digest()[:8], "little") >> 1 | 2


def _check_agreement(table: np.ndarray, k: int) -> None:
    """The same ValueError on every rank where the group's ranks disagree on batch k (``table``: the
    gathered headers)."""
    has = table[:, _HAS_BATCH].astype(bool)
    if not has.all():
        raise ValueError(f"PlanAhead.map(group=...): at batch {k}, ranks {np.flatnonzero(~has).tolist()} of the "
                         f"group have no batch left while ranks {np.flatnonzero(has).tolist()} do; every rank of "
                         "the group must pass the same batches")
    signatures = table[:, _SIGNATURE]
    if (signatures != signatures[0]).any():
        ranks = {}
        for rank, value in enumerate(signatures.tolist()):
            ranks.setdefault(value, []).append(rank)
        raise ValueError(f"PlanAhead.map(group=...): at batch {k} the ranks of the group pass different mask specs "
                         f"(ranks by mask signature: {sorted(ranks.values())}); every rank of the group must "
                         "iterate the same batches in the same order")
