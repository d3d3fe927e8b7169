"""Page-aligned host buffers, as O_DIRECT requires.

``torch.empty`` gives no alignment guarantee; an anonymous ``mmap`` is page-aligned by construction and
``torch.frombuffer`` views it without a copy. Buffers of :data:`HUGE_PAGE_BYTES` or more ask the kernel
for transparent huge pages (``MADV_HUGEPAGE``; honoured where THP is ``always`` or ``madvise``): each
O_DIRECT request then pins and maps 2 MiB pages instead of 4 KiB ones, and the first touch faults 512x
less often.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import torch

ALIGN_BYTES = 4096
"""Alignment of offsets, lengths and buffer addresses for O_DIRECT (covers 512 B and 4 KiB sectors)."""


HUGE_PAGE_BYTES = 2 << 20
"""The transparent huge page size (x86-64, arm64 with 4 KiB base pages)."""


def align_up(nbytes: int, alignment: int = ALIGN_BYTES) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


class AlignedBuffer:
    """``nbytes`` (rounded up to the alignment) of page-aligned, zero-filled host memory.

    Owned explicitly: call ``close()`` (or use it as a context manager); views taken from ``tensor``
    must be dropped first.
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"buffer size must be positive, got {nbytes}")
        self.nbytes = align_up(nbytes)
        self._mmap: mmap.mmap | None = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if self.nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):  # (before the first touch)
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._unpin: Callable[[int], None] | None = None

    def pin(self, pin: Callable[[int, int], None], unpin: Callable[[int], None]) -> None:
        """Page-lock the buffer for asynchronous device copies (``pin(ptr, nbytes)``); :meth:`close`
        calls ``unpin(ptr)`` before unmapping it. Once."""
        assert self.tensor is not None and self._unpin is None, "buffer is closed or pinned already"
        pin(self.tensor.data_ptr(), self.nbytes)
        self._unpin = unpin

    def memoryview(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        assert self._mmap is not None, "buffer is closed"
        end = self.nbytes if nbytes is None else offset + nbytes
        assert 0 <= offset <= end <= self.nbytes, (offset, end, self.nbytes)
        return memoryview(self._mmap)[offset:end]

    def view(self, dtype: torch.dtype, numel: int, offset_bytes: int = 0) -> torch.Tensor:
        assert self.tensor is not None, "buffer is closed"
        itemsize = torch.empty((), dtype=dtype).element_size()
        assert offset_bytes % itemsize == 0 and offset_bytes + numel * itemsize <= self.nbytes
        return self.tensor[offset_bytes : offset_bytes + numel * itemsize].view(dtype)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        if self._mmap is None:
            return
        if self._unpin is not None and self.tensor is not None:
            self._unpin(self.tensor.data_ptr())
            self._unpin = None
        self.tensor = None
        try:
            self._mmap.close()
        except BufferError:
            # a tensor or memoryview still points into the buffer: leave the mapping to the GC
            # rather than pull memory from under a live view
            pass
        self._mmap = None

    def __enter__(self) -> AlignedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
