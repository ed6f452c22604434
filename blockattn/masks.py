"""MaskSpec: a declarative attention mask over a packed batch of ``total_len`` tokens.

True means "query q attends key k". Structured masks are stored as at most two key intervals per
query row (``row_intervals``), which is all the kernels need to apply the exact mask by index
arithmetic and all the block classifier needs to find empty, partial and full tiles without ever
materialising a ``[T, T]`` tensor. Masks that do not fit that form (an arbitrary ``mask_mod``, or
compositions whose rows need more than two intervals) fall back to chunked evaluation of the
vectorised ``mask_mod`` and to per-tile bitmasks.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import numbers
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from blockattn.intervals import intersect, union

MaskMod = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Rows of q evaluated per chunk when a mask has no interval form (bounds peak memory at
# roughly _EVAL_CHUNK_ELEMS booleans).
_EVAL_CHUNK_ELEMS = 1 << 24
# A mask without two key intervals per row (``from_mask_mod``, a composition that does not fit) is
# evaluated at every (q, k) pair on the CPU, to sign it and to classify its tiles: O(T^2), ~1e8 pairs/s
# (32K tokens: 6 s to sign, 11 s to classify at block 128; 128K about 4.5 minutes). Longer ones are
# refused at construction, naming the O(T) alternative, instead of computing for hours.
MAX_EVALUATED_LEN = 1 << 17
_STRUCTURED = ("the structured constructors (causal, documents, sliding_window, lambda_mask, shared_question, "
               "causal_blockwise) combined with & and |, classified in O(T) while every row keeps at most two "
               "key intervals")


def _check_evaluable(T: int, what: str) -> None:
    """ValueError where a mask of T tokens evaluated pair by pair (``what``) would take hours."""
    if T > MAX_EVALUATED_LEN:
        raise ValueError(
            f"{what} is evaluated at every (q, k) pair: {T * T:.2e} pairs for total_len={T}, about "
            f"{T * T / 1e8 / 60:.0f} minutes on a CPU; at most total_len={MAX_EVALUATED_LEN} is evaluated. "
            f"Express it with {_STRUCTURED}")


def _as_int(value):
    """``value`` as a Python int if it is an integral number (int, numpy integer, one-element integer
    tensor or 0-d array), else None. Booleans are not lengths: they are rejected."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, torch.Tensor):
        integral = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        return int(value) if integral and value.numel() == 1 else None
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
        return int(value)
    return None


def _check_int(name: str, value, minimum: int) -> int:
    n = value if type(value) is int else _as_int(value)
    if n is None:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if n < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {n}")
    return n


def _check_lengths(name: str, lengths) -> list[int]:
    """Lengths as a list of Python ints >= 1 (from a sequence of ints or numpy integers, a 1-D integer
    numpy array or tensor)."""
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    elif isinstance(lengths, np.ndarray) and lengths.ndim == 1 and lengths.dtype.kind in "iu":
        lengths = lengths.tolist()  # Python ints, checked below like any list
    try:
        lengths = list(lengths)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {type(lengths).__name__}") from None
    for i, n in enumerate(lengths):
        if type(n) is not int:
            m = _as_int(n)
            if m is None:
                raise TypeError(f"{name}[{i}] must be an int, got {type(n).__name__} ({n!r})")
            lengths[i] = n = m
        if n < 1:
            raise ValueError(
                f"{name}[{i}] = {n}: every length must be >= 1 (drop empty documents before packing)"
            )
    return lengths


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, torch.Tensor):
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(p, np.ndarray):
            h.update(np.ascontiguousarray(p).tobytes())
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return h.hexdigest()[:16]


# Structured constructors write their canonical interval tables (see blockattn/intervals.py)
# directly, in numpy, one slice per region of rows: at 1M tokens building the table this way costs
# a few milliseconds, where merging generic per-row pieces costs tens.
def _table(T: int) -> np.ndarray:
    """An all-empty int32 ``[4, T]`` interval table."""
    return np.zeros((4, T), dtype=np.int32)


_IOTA = np.arange(0, dtype=np.int32)


def _arange(start: int, stop: int) -> np.ndarray:
    """``np.arange(start, stop)`` as int32 (0 <= start), a read-only view of a cached iota: callers copy
    it into a table, and a fresh 1M-entry array per call costs a millisecond."""
    global _IOTA
    stop = max(start, stop)
    if stop > _IOTA.size:
        iota = np.arange(max(stop, 2 * _IOTA.size), dtype=np.int32)
        iota.flags.writeable = False
        _IOTA = iota
    return _IOTA[start:stop]


def _sink_window(T: int, S: int, W: int) -> torch.Tensor:
    """Canonical table of ``k <= q and (k < S or q - k < W)`` (S = 0: a plain sliding window)."""
    out = _table(T)
    out[1] = _arange(1, T + 1)
    if S == 0:  # [max(0, q - W + 1), q + 1)
        out[0, W - 1 :] = _arange(0, T - W + 1)
    else:
        # The window reaches the sink (q - W + 1 <= S) for q < S + W: one interval [0, q + 1).
        # Later rows: [0, S) and [q - W + 1, q + 1), separated by at least one key.
        m = min(T, S + W)
        out[1, m:] = S
        out[2, m:] = _arange(S + 1, T - W + 1)
        out[3, m:] = _arange(m + 1, T + 1)
    return torch.from_numpy(out)


def _recorded(constructor):
    """Remember a public constructor's call on the spec it builds: the spec pickles as that call
    (a few numbers, not a [4, T] table), so worker processes rebuild it (planner/ahead.py)."""

    @functools.wraps(constructor)
    def build(cls, *args, **kwargs):
        spec = constructor(cls, *args, **kwargs)
        # copied: a caller mutating its seqlens list later must not change what the spec rebuilds to
        spec._recipe = (constructor.__name__, *copy.deepcopy((args, kwargs)))
        return spec

    return build


def _rebuild(recipe) -> "MaskSpec":
    """Inverse of ``MaskSpec.__reduce__``: replay the recorded constructor call or composition."""
    name, *rest = recipe
    if name in ("&", "|"):
        left, right = rest
        return left._combine(right, name)
    args, kwargs = rest
    return getattr(MaskSpec, name)(*args, **kwargs)


class MaskSpec:
    """An attention mask over ``total_len`` packed tokens (True = attend).

    Build one with the class constructors (``causal``, ``documents``, ``sliding_window``, ...),
    combine with ``&`` and ``|``; lower layers read ``row_intervals()``, ``mask_mod`` and
    ``block_mask(block_size)``.
    """

    __slots__ = ("total_len", "_desc", "_interval_fn", "_intervals", "_user_mod", "_signature", "_block_masks",
                 "_tile_counts", "_recipe")

    def __init__(self, total_len: int, desc: str, *, interval_fn=None, user_mod: Optional[MaskMod] = None):
        # Private: use the named constructors.
        self.total_len = _check_int("total_len", total_len, 1)
        self._desc = desc
        self._interval_fn = interval_fn
        self._intervals = None
        self._user_mod = user_mod
        self._signature = None
        self._block_masks = {}
        self._tile_counts = {}  # block size -> non-empty tiles, counted without a block mask
        self._recipe = None  # how to rebuild it in another process (set by the public constructors)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def _from_intervals(cls, total_len: int, desc: str, fn) -> "MaskSpec":
        return cls(total_len, desc, interval_fn=fn)

    @classmethod
    @_recorded
    def full(cls, total_len: int) -> "MaskSpec":
        """Every query attends every key."""
        T = _check_int("total_len", total_len, 1)

        def fn():
            out = _table(T)
            out[1] = T
            return torch.from_numpy(out)

        return cls._from_intervals(T, f"full(T={T})", fn)

    @classmethod
    @_recorded
    def causal(cls, total_len: int) -> "MaskSpec":
        """Query q attends keys k <= q."""
        T = _check_int("total_len", total_len, 1)

        def fn():
            out = _table(T)
            out[1] = _arange(1, T + 1)
            return torch.from_numpy(out)

        return cls._from_intervals(T, f"causal(T={T})", fn)

    @classmethod
    @_recorded
    def sliding_window(cls, total_len: int, window: int) -> "MaskSpec":
        """Causal with a window: ``0 <= q - k < window``."""
        T = _check_int("total_len", total_len, 1)
        W = _check_int("window", window, 1)
        return cls._from_intervals(T, f"sliding_window(T={T},W={W})", lambda: _sink_window(T, 0, W))

    @classmethod
    @_recorded
    def lambda_mask(cls, total_len: int, sink: int, window: int) -> "MaskSpec":
        """Causal "lambda" mask: ``k <= q and (k < sink or q - k < window)`` (DCP: sink 64, window 4096)."""
        T = _check_int("total_len", total_len, 1)
        S = _check_int("sink", sink, 0)
        W = _check_int("window", window, 1)
        return cls._from_intervals(T, f"lambda(T={T},S={S},W={W})", lambda: _sink_window(T, S, W))

    @classmethod
    @_recorded
    def documents(cls, seqlens: Sequence[int], causal: bool = True) -> "MaskSpec":
        """Block-diagonal packed documents (``total_len = sum(seqlens)``), causal inside each by default.

        ``seqlens`` may hold Python or numpy integers (a list, a 1-D integer array or tensor)."""
        lens = _check_lengths("seqlens", seqlens)
        if not lens:
            raise ValueError("seqlens is empty: pass at least one document length")
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        causal = bool(causal)
        T = sum(lens)
        lens_np = np.array(lens, dtype=np.int64)

        def fn():
            # Row q of document [s, e): keys [s, q + 1) (causal) or [s, e), one interval, never empty.
            ends = np.cumsum(lens_np)
            out = _table(T)
            out[0] = np.repeat((ends - lens_np).astype(np.int32), lens_np)
            out[1] = _arange(1, T + 1) if causal else np.repeat(ends.astype(np.int32), lens_np)
            return torch.from_numpy(out)

        return cls._from_intervals(T, f"documents(n={len(lens)},T={T},causal={causal},h={_digest(lens_np)})", fn)

    @classmethod
    @_recorded
    def shared_question(cls, question_len: int, answer_lens: Sequence[int]) -> "MaskSpec":
        """``[question | answer_1 | ...]``: causal question; each answer sees the question and itself causally."""
        Qn = _check_int("question_len", question_len, 1)
        lens = _check_lengths("answer_lens", answer_lens)
        T = Qn + sum(lens)
        lens_np = np.array([Qn] + lens, dtype=np.int64)

        def fn():
            # The question and the first answer (which starts where the question ends) are causal:
            # [0, q + 1). A later answer starting at s: [0, Qn) and [s, q + 1), with s > Qn.
            out = _table(T)
            out[1] = _arange(1, T + 1)
            m = Qn + lens[0] if lens else T
            if m < T:
                starts = np.cumsum(lens_np) - lens_np
                out[1, m:] = Qn
                out[2, m:] = np.repeat(starts[2:].astype(np.int32), lens_np[2:])
                out[3, m:] = _arange(m + 1, T + 1)
            return torch.from_numpy(out)

        return cls._from_intervals(T, f"shared_question(Q={Qn},n={len(lens)},T={T},h={_digest(lens_np)})", fn)

    @classmethod
    @_recorded
    def causal_blockwise(cls, total_len: int, block: int = 256, k_local: int = 2) -> "MaskSpec":
        """DCP's causal-blockwise mask.

        Block 0 is causal; a middle block attends block 0 plus keys in
        ``[max(block, q - k_local*block), q]``; the last block attends everything before it causally.
        """
        T = _check_int("total_len", total_len, 1)
        Bk = _check_int("block", block, 1)
        K = _check_int("k_local", k_local, 1)

        def fn():
            # Rows of the first and last blocks, and middle rows whose local window reaches block 0
            # (q - K*Bk <= Bk), are causal: [0, q + 1). Other middle rows: [0, Bk) and [q - K*Bk, q + 1).
            out = _table(T)
            out[1] = _arange(1, T + 1)
            a, b = (K + 1) * Bk + 1, ((T - 1) // Bk) * Bk
            if a < b:
                out[1, a:b] = Bk
                out[2, a:b] = _arange(a - K * Bk, b - K * Bk)
                out[3, a:b] = _arange(a + 1, b + 1)
            return torch.from_numpy(out)

        return cls._from_intervals(T, f"causal_blockwise(T={T},b={Bk},k={K})", fn)

    @classmethod
    @_recorded
    def from_mask_mod(cls, mask_mod: Callable, total_len: int) -> "MaskSpec":
        """Any vectorised ``mask_mod(q_idx, kv_idx) -> bool tensor`` (or FlexAttention's ``(b, h, q_idx, kv_idx)``)."""
        T = _check_int("total_len", total_len, 1)
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
        try:
            # Parameters with defaults (e.g. ``lambda q, k, part=part: ...``) are bound already.
            n_params = sum(
                1
                for prm in inspect.signature(mask_mod).parameters.values()
                if prm.default is inspect.Parameter.empty
                and prm.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            )
        except (TypeError, ValueError):
            n_params = 2
        _check_evaluable(T, "a from_mask_mod mask")
        if n_params == 4:
            flex_mod = mask_mod
            zero = torch.zeros((), dtype=torch.int64)

            def mod(q_idx, kv_idx):
                return flex_mod(zero, zero, q_idx, kv_idx)

        elif n_params == 2:
            mod = mask_mod
        else:
            raise TypeError(
                f"mask_mod takes {n_params} arguments; expected (q_idx, kv_idx) or FlexAttention's (b, h, q_idx, kv_idx)"
            )
        name = getattr(mask_mod, "__qualname__", type(mask_mod).__name__)
        spec = cls(T, f"mask_mod({name},T={T})", user_mod=mod)
        # Fail fast, with the user's function in the traceback, rather than deep inside a kernel launch.
        n = min(T, 4)
        probe = spec._eval_user_mod(torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1))
        try:
            ok = torch.broadcast_shapes(probe.shape, (n, n)) == (n, n)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"mask_mod must broadcast over its index tensors: q_idx [{n}, 1], kv_idx [1, {n}] gave shape {tuple(probe.shape)}"
            )
        return spec

    # ------------------------------------------------------------------ composition
    def _check_same_len(self, other, op: str) -> None:
        if not isinstance(other, MaskSpec):
            raise TypeError(f"cannot combine MaskSpec with {type(other).__name__} using {op}")
        if other.total_len != self.total_len:
            raise ValueError(
                f"cannot combine masks of different total_len with {op}: {self.total_len} vs {other.total_len}"
            )

    def _combine(self, other: "MaskSpec", op: str) -> "MaskSpec":
        self._check_same_len(other, op)
        spec = self._combined(other, op)
        spec._recipe = (op, self, other)
        return spec

    def _combined(self, other: "MaskSpec", op: str) -> "MaskSpec":
        T = self.total_len
        desc = f"({self._desc}{op}{other._desc})"
        if self.has_intervals and other.has_intervals:
            combine = intersect if op == "&" else union

            def fn():
                return combine(self.row_intervals(), other.row_intervals(), T)

            spec = MaskSpec(T, desc, interval_fn=fn)
            if spec.row_intervals() is not None:
                return spec
        _check_evaluable(T, f"{desc} needs more than two key intervals in some row, so it")
        a, b = self, other
        if op == "&":
            mod = lambda q, k: a.mask_mod(q, k) & b.mask_mod(q, k)  # noqa: E731
        else:
            mod = lambda q, k: a.mask_mod(q, k) | b.mask_mod(q, k)  # noqa: E731
        return MaskSpec(T, desc, user_mod=mod)

    def __and__(self, other: "MaskSpec") -> "MaskSpec":
        return self._combine(other, "&")

    def __or__(self, other: "MaskSpec") -> "MaskSpec":
        return self._combine(other, "|")

    # ------------------------------------------------------------------ evaluation
    @property
    def has_intervals(self) -> bool:
        """True when the mask is (possibly) expressible as two key intervals per query row."""
        return self._interval_fn is not None

    def row_intervals(self) -> Optional[torch.Tensor]:
        """int32 ``[4, T]`` rows ``lo1, hi1, lo2, hi2``: q attends k iff ``lo1<=k<hi1 or lo2<=k<hi2``; None if not expressible."""
        if self._interval_fn is None:
            return None
        if self._intervals is None:
            iv = self._interval_fn()
            if iv is None:
                self._interval_fn = None
                return None
            self._intervals = iv
        return self._intervals

    def _eval_user_mod(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        out = self._user_mod(q_idx, kv_idx)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"mask_mod must return a bool tensor, got {type(out).__name__}")
        if out.dtype != torch.bool:
            # (a float mask of 0 / -inf cast to bool would be inverted: -inf is True, 0 False)
            raise TypeError(f"mask_mod must return a bool tensor (True: q_idx attends kv_idx), got dtype {out.dtype}; "
                            "an additive mask (0 / -inf) is a score_mod: return a comparison such as kv_idx <= q_idx")
        return out

    def mask_mod(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """Vectorised mask over broadcastable global index tensors (int64)."""
        q_idx = torch.as_tensor(q_idx, dtype=torch.int64)
        kv_idx = torch.as_tensor(kv_idx, dtype=torch.int64)
        iv = self.row_intervals()
        if iv is None:
            return self._eval_user_mod(q_idx, kv_idx)
        T = self.total_len
        in_range = (q_idx >= 0) & (q_idx < T)
        rows = iv.to(torch.int64)[:, q_idx.clamp(0, T - 1)]
        hit = ((kv_idx >= rows[0]) & (kv_idx < rows[1])) | ((kv_idx >= rows[2]) & (kv_idx < rows[3]))
        return hit & in_range

    def to_dense(self) -> torch.Tensor:
        """The mask as ``torch.bool [T, T]`` (for tests and small T only)."""
        T = self.total_len
        rows = max(1, _EVAL_CHUNK_ELEMS // T)
        k = torch.arange(T, dtype=torch.int64).view(1, T)
        out = torch.empty(T, T, dtype=torch.bool)
        for q0 in range(0, T, rows):
            q = torch.arange(q0, min(T, q0 + rows), dtype=torch.int64).view(-1, 1)
            out[q0 : q0 + q.shape[0]] = self.mask_mod(q, k).expand(q.shape[0], T)
        return out

    def signature(self) -> str:
        """Deterministic key (same in every process) identifying this mask, for plan caching."""
        if self._signature is None:
            if self.row_intervals() is not None:
                self._signature = f"iv:{self.total_len}:{_digest(self.row_intervals())}"
            else:
                # A user function has no stable identity across processes: hash what it computes.
                h = hashlib.sha256()
                T = self.total_len
                rows = max(1, _EVAL_CHUNK_ELEMS // T)
                k = torch.arange(T, dtype=torch.int64).view(1, T)
                for q0 in range(0, T, rows):
                    q = torch.arange(q0, min(T, q0 + rows), dtype=torch.int64).view(-1, 1)
                    bits = self.mask_mod(q, k).expand(q.shape[0], T).contiguous().numpy()
                    h.update(bits.tobytes())
                self._signature = f"mod:{T}:{h.hexdigest()[:16]}"
        return self._signature

    def block_mask(self, block_size: int):
        """Classify every (q-block, kv-block) tile as empty, partial or full (cached per block size)."""
        from blockattn.block_mask import BlockMask

        B = _check_int("block_size", block_size, 1)
        bm = self._block_masks.get(B)
        if bm is None:
            bm = BlockMask.from_mask_spec(self, B)
            self._block_masks[B] = bm
        return bm

    def num_tiles(self, block_size: int) -> int:
        """Non-empty (q-block, kv-block) tiles at ``block_size``; counted without listing them where the
        block mask is not built yet (an interval mask), so block sizes can be weighed cheaply."""
        from blockattn.block_mask import count_tiles

        B = _check_int("block_size", block_size, 1)
        bm = self._block_masks.get(B)
        if bm is not None:
            return bm.num_tiles
        if B not in self._tile_counts:
            self._tile_counts[B] = count_tiles(self, B)
        return self._tile_counts[B]

    def __repr__(self) -> str:
        return f"MaskSpec({self._desc})"

    def __reduce__(self):
        # Pickled as the constructor call that built it; a mask_mod spec needs a picklable function.
        if self._recipe is None:
            raise TypeError(f"{self!r} was not built by a public MaskSpec constructor and cannot be pickled")
        return _rebuild, (self._recipe,)

    def __eq__(self, other) -> bool:
        return isinstance(other, MaskSpec) and other.total_len == self.total_len and other.signature() == self.signature()

    def __hash__(self) -> int:
        return hash(self.signature())


__all__ = ["MaskSpec"]
