"""``compiled``: the planner's numba decorator, with a lock across processes around compiling.

numba compiles a function on its first call with new argument types and keeps the machine code in an
on-disk cache (``cache=True``), so a later process loads it (~0.3 s for the planner) instead of
compiling it again (~19 s on a new machine). That cache is not safe for processes that fill it at the
same time (numba/numba#4807: one can load another's half-written files and crash), which is what
torchrun's ranks, or the spawned ranks of the tests, do when they plan their first batch together.
So every compile or cache load here (numba's ``_compile_for_args``, which the dispatcher calls only
when no compiled version fits the arguments) holds an exclusive lock on one file: the first process
fills the cache, the others then load it. Calls that find their compiled version take no lock.

numba checks a cached version against its own source file only, while the machine code it keeps also
holds the compiled functions it calls from other files (numba/numba#8396, not merged): after an edit
or an upgrade of one file, the cached callers of its functions run their old code, and mixed caches
have crashed a plan here (a set exception found by the next call). So the first compiled function of
a source folder compares a digest of that folder's sources with the one its cache was filled under,
and where they differ empties the cache (``forget_stale_cache``, under the same lock).
"""

from __future__ import annotations

import functools
import hashlib
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
SOURCES_STAMP = "blockattn-sources.sha256"  # (in numba's cache folder: the digest it was filled under)
_checked_caches: set = set()  # cache folders whose stamp this process has compared


def compiled(fn=None, **options):
    """``numba.njit(cache=True, nogil=True, **options)`` whose compiles and cache loads hold the lock."""
    if fn is None:
        return functools.partial(compiled, **options)
    dispatcher = numba.njit(cache=True, nogil=True, **options)(fn)
    if hasattr(dispatcher, "_compile_for_args"):  # (with NUMBA_DISABLE_JIT=1 numba gives back ``fn``)
        dispatcher._compile_for_args = _locked(dispatcher._compile_for_args)
        cache_path = getattr(getattr(dispatcher, "_cache", None), "cache_path", None)
        if cache_path is not None and cache_path not in _checked_caches:
            _checked_caches.add(cache_path)
            forget_stale_cache(cache_path, os.path.dirname(os.path.abspath(fn.__code__.co_filename)))
    return dispatcher


def sources_digest(source_dir: str) -> str:
    """sha256 of the ``.py`` files of ``source_dir`` (names and contents, in name order)."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(source_dir)):
        if name.endswith(".py"):
            with open(os.path.join(source_dir, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()


def forget_stale_cache(cache_path: str, source_dir: str) -> bool:
    """Remove numba's cached versions (``.nbi`` / ``.nbc``) in ``cache_path`` unless they were filled
    from the sources ``source_dir`` holds now (the digest kept in ``cache_path`` as SOURCES_STAMP);
    True where they were removed. Under the compile lock, so no other process loads or fills the cache
    meanwhile. A cache that cannot be read or written is left to numba (which then compiles without it)."""
    digest = sources_digest(source_dir)
    stamp = os.path.join(cache_path, SOURCES_STAMP)
    with _thread_lock:
        fd = None if _depth else _open_lock()  # (inside a compile this thread holds the lock already)
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                with open(stamp) as f:
                    if f.read() == digest:
                        return False
            except OSError:
                pass
            try:
                os.makedirs(cache_path, exist_ok=True)
                for name in os.listdir(cache_path):
                    if name.endswith((".nbi", ".nbc")):
                        os.remove(os.path.join(cache_path, name))
                with open(stamp, "w") as f:
                    f.write(digest)
            except OSError:
                return False
            return True
        finally:
            if fd is not None:
                os.close(fd)


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
