"""Keep the memory a training step on a CPU frees, for the next step, instead of returning it to the OS.

glibc's ``malloc`` serves large blocks by mapping fresh pages (above 128 KiB at first, a bound it
raises as such blocks are freed) and returns the free top of its heap to the kernel past a
threshold. A training step allocates and frees its activations every step, so on a CPU each step's
activations land on pages the kernel maps and zeroes again on first touch: 80,000 to 250,000 page
faults a step for the 30M-parameter benchmark model, about 2,000 for the shipped one. PyTorch's CUDA
allocator caches GPU memory for the same reason; PyTorch has no such cache for CPU memory, so
``keep_freed_memory`` asks glibc to serve blocks up to 32 MiB (the largest bound it accepts) from its
heap and never to trim the heap. The process's resident memory then stays near its peak between
steps; blocks above 32 MiB are still mapped and returned.
"""

from __future__ import annotations

import ctypes
import functools
import platform

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest mapping threshold on 64-bit systems
_NEVER = -1  # read by glibc as the largest size_t: the heap is never trimmed


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's ``malloc`` to keep freed memory for reuse, once per process (it cannot be undone).
    Returns whether it is set: False where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success; fixing either bound also stops glibc from moving the other
    return mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, _NEVER) == 1
