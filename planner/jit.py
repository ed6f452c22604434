"""``compiled``: the planner's numba decorator, with a lock across processes around compiling.

numba compiles a function on its first call with new argument types and keeps the machine code in an
on-disk cache (``cache=True``), so a later process loads it (~0.3 s for the planner) instead of
compiling it again (~19 s on a new machine). That cache is not safe for processes that fill it at the
same time (numba/numba#4807: one can load another's half-written files and crash), which is what
torchrun's ranks, or the spawned ranks of the tests, do when they plan their first batch together.
So every compile or cache load here (numba's ``_compile_for_args``, which the dispatcher calls only
when no compiled version fits the arguments) holds an exclusive lock on one file: the first process
fills the cache, the others then load it. Calls that find their compiled version take no lock.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading

import numba
import numpy as np

try:
    import fcntl
except ImportError:  # (no flock on this platform: numba's own unlocked compile)
    fcntl = None

LOCK_PATH = os.path.join(tempfile.gettempdir(), "blockattn-numba-compile.lock")
_thread_lock = threading.RLock()
_depth = 0  # (nested compiles in one thread take the file lock once)


def compiled(fn=None, **options):
    """``numba.njit(cache=True, nogil=True, **options)`` whose compiles and cache loads hold the lock."""
    if fn is None:
        return functools.partial(compiled, **options)
    dispatcher = numba.njit(cache=True, nogil=True, **options)(fn)
    if hasattr(dispatcher, "_compile_for_args"):  # (with NUMBA_DISABLE_JIT=1 numba gives back ``fn``)
        dispatcher._compile_for_args = _locked(dispatcher._compile_for_args)
    return dispatcher


def read_only_int64(values) -> np.ndarray:
    """``values`` as one numba argument type for the loops that only read them: a C-contiguous, read-only
    int64 array (a view; a copy only where the dtype or the layout differs). numba compiles a version
    per argument type, and a writable, a read-only (a memo's) and a strided array (a table's column)
    are three: ~0.5-1.4 s of compiling each on a new machine, where the relay schedules' loops had
    twelve versions between three of them."""
    array = np.ascontiguousarray(values, dtype=np.int64)
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


def _locked(compile_for_args):
    @functools.wraps(compile_for_args)
    def locked(*args, **kws):
        global _depth
        with _thread_lock:
            if _depth:
                return compile_for_args(*args, **kws)
            fd = _open_lock()
            _depth += 1
            try:
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                return compile_for_args(*args, **kws)
            finally:
                _depth -= 1
                if fd is not None:
                    os.close(fd)  # (closing releases the lock)

    return locked


def _open_lock():
    """A descriptor of the lock file (read-only is enough for flock, so another user's file works),
    or None where none can be opened: then the compile goes on unlocked, as numba's own would."""
    if fcntl is None:
        return None
    try:
        return os.open(LOCK_PATH, os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError:
        return None
