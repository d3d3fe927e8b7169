"""Giving freed heap pages back to the OS (glibc's ``malloc_trim``)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()

TRIM_MIN_BYTES = 4 << 20


def trim_heap(freed_bytes: int = TRIM_MIN_BYTES) -> None:
    """Give freed heap pages back to the OS. Backward allocates and frees unit-sized gradient tensors
    every micro-batch; glibc's adaptive mmap threshold moves such sizes onto the heap, whose free pages
    it keeps, and host memory would creep up by several units' worth. About a millisecond per call, so
    only worth it when the unit's tensors are large (``freed_bytes``)."""
    if _MALLOC_TRIM is not None and freed_bytes >= TRIM_MIN_BYTES:
        _MALLOC_TRIM(0)
