"""I/O between offload files and aligned host buffers (IOEngine protocol + the default backend)."""

from lightning_greedysnake.io.aligned import ALIGN_BYTES, AlignedBuffer, align_up
from lightning_greedysnake.io.engine import (
    IOConfig,
    IOEngine,
    OffloadFile,
    OffloadIOError,
    ShortReadError,
    ThreadedIOEngine,
    open_offload_file,
)

__all__ = [
    "ALIGN_BYTES",
    "AlignedBuffer",
    "IOConfig",
    "IOEngine",
    "OffloadFile",
    "OffloadIOError",
    "ShortReadError",
    "ThreadedIOEngine",
    "align_up",
    "open_offload_file",
]
