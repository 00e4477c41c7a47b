"""The C heap's policy for CPU programs (glibc): memory a tensor frees is kept for the next allocation, not
returned to the kernel.

A compiled CPU graph allocates some tensors afresh on every call: its outputs (the activations a training step
saves for the backward, the gradients), and what library calls allocate themselves (a convolution's result).
glibc serves a request of at least M_MMAP_THRESHOLD bytes by a mapping of its own, unmapped when freed, and
returns freed memory at the top of its heap beyond M_TRIM_THRESHOLD (by default both adapt to the largest mapped
chunk freed so far: a few MB). A step whose tensors take more than that then gets fresh pages from the kernel on
every call, a minor page fault per 4 KiB with the page zeroed: the conv-net train step of bench/dynamic.py took
~2,700 faults a step, about a third of its time. With mapped requests up to 32 MiB (glibc's largest) served from
the heap, and up to TRIM bytes of free heap kept, the same step takes none. The process keeps up to TRIM bytes it
no longer uses (eager code in the same process shares the policy). Set once, when the first compiled C++ graph
loads; config.CPU_KEEP_FREED_MEMORY = False leaves the heap's policy as it was.
"""
from __future__ import annotations

import ctypes
import platform

from ember import config

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20   # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM = 256 << 20
_DONE = [False]


def keep_freed_memory() -> bool:
    """Set the policy (once per process); whether it is set."""
    if _DONE[0] or not config.CPU_KEEP_FREED_MEMORY:
        return _DONE[0]
    _DONE[0] = True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # (setting either one fixes both: glibc stops adapting them)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM))
