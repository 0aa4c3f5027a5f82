"""Keep the memory a CPU model step frees, so that the next step reuses it.

A model step on the CPU allocates and frees the same large tensors every
step: the K/V read back through the block tables (tens of MB per layer at a
batch of 32), MLP activations of a prefill. glibc serves allocations above
its mmap threshold with fresh ``mmap``s and gives them back on ``free``, and
gives the top of its heaps back above its trim threshold; both thresholds
move with the allocation history. When they sit low, every step faults its
temporaries in again, page by page, and pays the kernel for zeroing them:
measured here, 30,000-75,000 minor faults per decode step at batch 32 and
143 ms against 87 ms for the same steps without them. Which of the two a
process gets depended on what it had allocated before, so the same
benchmark swung by half between runs.

``keep_freed_memory()`` pins both thresholds high: allocations up to
``MMAP_THRESHOLD`` come from the heap, and freed memory stays in it (up to
``TRIM_THRESHOLD`` of free space at the top of a heap) for the next step.
It changes no result, only where the bytes come from; the process's peak
RSS stays about what one step needs. It applies to the whole process, so
call it only in a process that runs models (a worker, a baseline).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 512 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Pin glibc's mmap and trim thresholds high (see the module docstring).
    True if done; False where the C library is not glibc (nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release_freed_memory() -> bool:
    """Give the heap's free memory back to the system now (``malloc_trim``):
    after the KV cache or the weights are freed on purpose (``sleep``), the
    thresholds above would keep what the heap held. True if done (glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    malloc_trim(0)
    return True


def resident_bytes() -> int:
    """This process's resident memory (RSS), from ``/proc``; 0 where there is none."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def available_bytes() -> int:
    """The memory the host can give new allocations without swapping
    (``MemAvailable`` in ``/proc/meminfo``; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
