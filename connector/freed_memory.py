"""Handing the host memory kvreel frees back to the system.

glibc's malloc serves a request below its mmap threshold from its heaps, and
it raises that threshold (up to 32 MiB) each time a larger block is freed. A
long session's history and the host tier's chunks are tensors of a few MiB
each, so they soon live in the heaps, and freeing them (a session ends, chunks
are evicted) leaves the engine's resident memory where it was: at the end
of ``bench/engine_memory.py``'s run, 2.0 GiB beyond what its parts and plain
vLLM's engine explain. ``malloc_trim`` returns the heaps' free
pages. kvreel calls it once it has freed ``TRIM_AFTER_BYTES`` since the last
call, on a thread of its own (the call walks the heaps; ctypes releases the
GIL for it), never in a step. Where the C library has no ``malloc_trim``
(not glibc) nothing is done."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

TRIM_AFTER_BYTES = 256 << 20

_lock = threading.Lock()
_freed = 0
_trimming = False


def _find_malloc_trim():
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None)
    except OSError:
        return None


_malloc_trim = _find_malloc_trim()


def freed(nbytes: int) -> None:
    """kvreel let go of ``nbytes`` of host memory; past ``TRIM_AFTER_BYTES`` since
    the last trim, the free pages go back to the system (in the background)."""
    global _freed, _trimming
    if _malloc_trim is None:
        return
    with _lock:
        _freed += nbytes
        if _freed < TRIM_AFTER_BYTES or _trimming:
            return
        _freed, _trimming = 0, True
    threading.Thread(target=_trim, name="kvreel-malloc-trim", daemon=True).start()


def _trim() -> None:
    global _trimming
    try:
        _malloc_trim(0)
    finally:
        with _lock:
            _trimming = False
