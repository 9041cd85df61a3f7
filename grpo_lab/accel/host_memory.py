"""Keep the memory a training step on a CPU frees, for the next step, instead of returning it to the OS.

glibc's ``malloc`` serves large blocks by mapping fresh pages (above 128 KiB at first, a bound it
raises as such blocks are freed) and returns the free top of its heap to the kernel past a
threshold. A training step allocates and frees its activations every step, so on a CPU each step's
activations land on pages the kernel maps and zeroes again on first touch: tens of thousands of
page faults a step (benchmarks/README.md). PyTorch's CUDA allocator caches GPU memory for
the same reason; PyTorch has no such cache for CPU memory, so ``keep_freed_memory`` asks glibc to
serve blocks up to 32 MiB (the largest bound it accepts) from its heap and never to trim the heap.
The process's resident memory then stays near its peak; blocks above 32 MiB are still mapped and
returned, and ``release_freed_memory`` hands the rest back when training ends.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest mapping threshold on 64-bit systems
_NEVER = -1  # read by glibc as the largest size_t: the heap is never trimmed

_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


@functools.cache
def _glibc():
    """glibc's ``mallopt`` and ``malloc_trim``, or None where malloc is not glibc's: another C
    library, or an allocator loaded in its place (jemalloc, tcmalloc, mimalloc, usually through
    ``LD_PRELOAD``)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        with open("/proc/self/maps") as maps:
            if any(name in maps.read() for name in _ALLOCATORS):
                return None
    except OSError:
        return None
    return ctypes.CDLL(None)


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's ``malloc`` to keep freed memory for reuse, for the rest of the process. Returns
    whether it was set: not where malloc is not glibc's, nor where the user tuned glibc's malloc
    (``MALLOC_*_`` variables, ``GLIBC_TUNABLES`` with ``glibc.malloc``), whose choice stands.
    Decided once: libraries may change the environment later for the processes they start (vLLM
    sets ``LD_PRELOAD``)."""
    libc = _glibc()
    if libc is None or any(name in os.environ for name in _USER_SETTINGS) or "glibc.malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success; fixing either bound also stops glibc from moving the other
    return mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, _NEVER) == 1


def release_freed_memory() -> None:
    """Return the free memory ``keep_freed_memory`` kept to the kernel (``malloc_trim``); the
    setting itself stays, for the next training in the process."""
    if keep_freed_memory.cache_info().currsize and keep_freed_memory():
        _glibc().malloc_trim(0)
