"""Explicit point-to-point communication for executing a Plan's stages over torch.distributed.

Notation (docs/design.md): P ranks, B block size, stages 0..S-1 of a Plan; "peer" is a rank of the
process group the plan runs on (group rank, not global rank).

One `StageExchange` holds everything one rank sends to and receives from its peers in one exchange
of one stage: per peer one packed byte buffer each way (several blocks of several kinds concatenated
in the CommSchedule's row order, so both sides agree on the layout without any handshake). Its
lifecycle is explicit and checked:

    ex = StageExchange(send={peer: [tensors...]}, recv_nbytes={peer: n}, group=g)
    ex.post()        # starts the transfers (async work handles; on CUDA on a side stream)
    ...compute...
    bufs = ex.wait() # {peer: uint8 tensor}; usable on the current stream after this returns

Two wire methods, chosen per exchange: "p2p" (`dist.batch_isend_irecv`, only the peers with data)
and "a2a" (`dist.all_to_all_single` over the whole group, every rank takes part). p2p is the default:
timing the exchanges of real plans alone (bench/bench_distributed.py: 4 gloo ranks, 16K tokens, five
strategies x two masks) it was faster in 9 of 10 cases in each of two runs (e.g. dcp on documents
16.6 vs 27.1 ms fwd+bwd), and it never makes a rank without traffic join a collective.

Process groups (the plan's group and FCP sub-groups) are created once per rank set and cached.
`count_bytes()` wraps the torch.distributed send calls to measure the bytes actually put on the wire.
"""
from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "StageExchange",
    "ByteCounter",
    "count_bytes",
    "get_group",
    "group_size",
    "group_rank",
    "as_bytes",
    "from_bytes",
    "COMM_METHODS",
]

COMM_METHODS = ("p2p", "a2a")

_GROUP_CACHE: dict[tuple, object] = {}


def get_group(ranks: tuple[int, ...] | list[int] | None = None, *, timeout_s: float | None = None):
    """The process group over `ranks` (global ranks), created once and cached; None = the world group.

    Like `dist.new_group`, creating a group is collective over the *whole world*: every rank must ask for
    the same sub-groups in the same order (e.g. all FCP groups of a plan, in plan order).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group(...) "
            "(backend 'gloo' on CPU, 'nccl' on GPUs) before running a distributed plan"
        )
    if ranks is None:
        return dist.group.WORLD
    key = tuple(sorted(int(r) for r in ranks))
    if len(set(key)) != len(key) or not key:
        raise ValueError(f"get_group: ranks must be a non-empty list of distinct ranks, got {list(ranks)}")
    world = dist.get_world_size()
    if key[0] < 0 or key[-1] >= world:
        raise ValueError(f"get_group: ranks {list(key)} out of range for world size {world}")
    if key == tuple(range(world)):
        return dist.group.WORLD
    if key not in _GROUP_CACHE:
        kwargs = {}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        _GROUP_CACHE[key] = dist.new_group(list(key), **kwargs)
    return _GROUP_CACHE[key]


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's contents (copies only when t is not contiguous)."""
    return t.contiguous().view(-1).view(torch.uint8)


def from_bytes(buf: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Read a `shape`/`dtype` tensor at byte `offset` of a uint8 buffer (a view when aligned)."""
    esize = torch.empty((), dtype=dtype).element_size()
    n = esize
    for s in shape:
        n *= int(s)
    piece = buf[offset : offset + n]
    if piece.numel() != n:
        raise RuntimeError(f"received message too short: need bytes [{offset}, {offset + n}), have {buf.numel()}")
    if offset % esize:
        piece = piece.clone()  # view(dtype) needs an element-aligned storage offset
    return piece.view(dtype).view(shape)


@dataclass
class ByteCounter:
    """Bytes this process handed to torch.distributed send and receive calls (payload only, all peers)."""

    sent: int = 0
    received: int = 0
    calls: int = 0
    per_peer: dict = field(default_factory=dict)  # peer -> bytes sent to it

    def add(self, peer: int, nbytes: int) -> None:
        self.sent += int(nbytes)
        self.per_peer[int(peer)] = self.per_peer.get(int(peer), 0) + int(nbytes)


@contextlib.contextmanager
def count_bytes():
    """Count the bytes sent and received by `dist.batch_isend_irecv` and `dist.all_to_all_single` here.

    Wraps the torch.distributed functions themselves (the executor looks them up at call time), so what
    is counted is what is actually handed to the backend, not what the executor believes it sends.
    """
    counter = ByteCounter()
    orig_batch, orig_a2a = dist.batch_isend_irecv, dist.all_to_all_single

    def batch_isend_irecv(ops):
        counter.calls += 1
        for op in ops:
            nbytes = op.tensor.numel() * op.tensor.element_size()
            if op.op is dist.isend:
                counter.add(op.group_peer if op.group_peer is not None else op.peer, nbytes)
            elif op.op is dist.irecv:
                counter.received += nbytes
        return orig_batch(ops)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        counter.calls += 1
        n = dist.get_world_size(group)
        me = dist.get_rank(group)
        for tensor, splits, sending in ((input, input_split_sizes, True), (output, output_split_sizes, False)):
            row_bytes = (tensor[0].numel() if tensor.dim() > 1 else 1) * tensor.element_size()
            splits = splits if splits is not None else [tensor.shape[0] // n] * n
            for peer, rows in enumerate(splits):
                if peer != me and rows:
                    if sending:
                        counter.add(peer, rows * row_bytes)
                    else:
                        counter.received += rows * row_bytes
        return orig_a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.batch_isend_irecv, dist.all_to_all_single = batch_isend_irecv, all_to_all_single
    try:
        yield counter
    finally:
        dist.batch_isend_irecv, dist.all_to_all_single = orig_batch, orig_a2a


class StageExchange:
    """One exchange of one stage on this rank: packed per-peer sends and receives, post() then wait()."""

    _NEW, _POSTED, _DONE = "new", "posted", "done"

    def __init__(
        self,
        send: dict[int, list[torch.Tensor]],
        recv_nbytes: dict[int, int],
        *,
        group=None,
        device: torch.device | str = "cpu",
        method: str = "p2p",
        tag: int = 0,
        name: str = "exchange",
    ):
        if method not in COMM_METHODS:
            raise ValueError(f"StageExchange: method must be one of {COMM_METHODS}, got {method!r}")
        self.group = group if group is not None else get_group()
        self.me = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        for peer in list(send) + list(recv_nbytes):
            if not 0 <= peer < self.world or peer == self.me:
                raise ValueError(f"{name}: invalid peer {peer} (this rank is {self.me} of {self.world})")
        self.device = torch.device(device)
        self.method = method
        self.tag = tag
        self.name = name
        self._send_parts = {p: parts for p, parts in send.items() if sum(t.numel() for t in parts) > 0}
        self._recv_nbytes = {p: int(n) for p, n in recv_nbytes.items() if n > 0}
        self._state = self._NEW
        self._works: list = []
        self._send_bufs: dict[int, torch.Tensor] = {}
        self._recv_bufs: dict[int, torch.Tensor] = {}
        self._a2a_in: torch.Tensor | None = None
        self._a2a_out: torch.Tensor | None = None
        self._stream = _comm_stream(self.device)

    @property
    def state(self) -> str:
        return self._state

    def post(self) -> "StageExchange":
        """Pack the send buffers and start all transfers (non-blocking)."""
        if self._state != self._NEW:
            raise RuntimeError(f"{self.name}: post() called twice (state is {self._state!r}); "
                               "build a new StageExchange per exchange")
        self._state = self._POSTED
        # Buffers are packed and allocated on the current (compute) stream: packing reads what the compute
        # just wrote, and the received bytes are read back on it after wait().
        self._send_bufs = {p: torch.cat([as_bytes(t) for t in parts]) for p, parts in sorted(self._send_parts.items())}
        if self.method == "p2p":
            self._recv_bufs = {p: torch.empty(n, dtype=torch.uint8, device=self.device)
                               for p, n in sorted(self._recv_nbytes.items())}
            buffers = list(self._send_bufs.values()) + list(self._recv_bufs.values())
        else:
            self._a2a_in_splits = [int(self._send_bufs[p].numel()) if p in self._send_bufs else 0
                                   for p in range(self.world)]
            self._a2a_out_splits = [int(self._recv_nbytes.get(p, 0)) for p in range(self.world)]
            parts = [self._send_bufs[p] for p in range(self.world) if p in self._send_bufs]
            self._a2a_in = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=self.device)
            self._a2a_out = torch.empty(sum(self._a2a_out_splits), dtype=torch.uint8, device=self.device)
            buffers = [self._a2a_in, self._a2a_out]
        stream_ctx = contextlib.nullcontext()
        if self._stream is not None:
            self._stream.wait_event(torch.cuda.current_stream(self.device).record_event())
            for buf in buffers:
                buf.record_stream(self._stream)  # keep the memory until the comm stream is done with it
            stream_ctx = torch.cuda.stream(self._stream)
        with stream_ctx:
            if self.method == "p2p":
                self._post_p2p()
            else:
                work = dist.all_to_all_single(self._a2a_out, self._a2a_in, self._a2a_out_splits, self._a2a_in_splits,
                                              group=self.group, async_op=True)
                self._works = [work] if work is not None else []
        return self

    def _post_p2p(self) -> None:
        ops = []
        # Receives first, then sends, each by ascending peer: the same order on every rank.
        for peer, buf in self._recv_bufs.items():
            ops.append(dist.P2POp(dist.irecv, buf, group=self.group, group_peer=peer, tag=self.tag))
        for peer, buf in self._send_bufs.items():
            ops.append(dist.P2POp(dist.isend, buf, group=self.group, group_peer=peer, tag=self.tag))
        if ops:
            self._works = list(dist.batch_isend_irecv(ops) or [])

    def wait(self) -> dict[int, torch.Tensor]:
        """Block until this exchange is complete; returns {peer: received uint8 buffer}."""
        if self._state == self._NEW:
            raise RuntimeError(f"{self.name}: wait() before post(); call post() first")
        if self._state == self._DONE:
            raise RuntimeError(f"{self.name}: wait() called twice; the buffers were already returned")
        stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with stream_ctx:
            for w in self._works:
                w.wait()  # on CUDA: makes the comm stream wait for the transfer
        if self._stream is not None:
            done = self._stream.record_event()
            torch.cuda.current_stream(self.device).wait_event(done)
        if self.method == "a2a":
            offset = 0
            for peer, n in enumerate(self._a2a_out_splits):
                if n:
                    self._recv_bufs[peer] = self._a2a_out[offset : offset + n]
                offset += n
        self._state = self._DONE
        self._works = []
        self._send_bufs, self._a2a_in = {}, None  # may be freed now (record_stream guards them on CUDA)
        return self._recv_bufs

    def __repr__(self) -> str:
        out = sum(int(sum(t.numel() * t.element_size() for t in parts)) for parts in self._send_parts.values())
        inn = sum(self._recv_nbytes.values())
        return (
            f"StageExchange({self.name}, rank {self.me}/{self.world}, {self.method}, state={self._state}, "
            f"send {out} B to {sorted(self._send_parts)}, recv {inn} B from {sorted(self._recv_nbytes)})"
        )


_STREAMS: dict = {}


def _comm_stream(device: torch.device):
    """One side stream per CUDA device for communication (None on CPU)."""
    if device.type != "cuda":
        return None
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=key)
    return _STREAMS[key]
