"""I/O between offload files and aligned host buffers (IOEngine protocol + the default backend)."""

from lightning_greedysnake.io.aligned import ALIGN_BYTES, AlignedBuffer, align_up
from lightning_greedysnake.io.engine import (
    InlineIOEngine,
    IOConfig,
    IOEngine,
    OffloadFile,
    OffloadIOError,
    ShortReadError,
    ThreadedIOEngine,
    default_engine,
    open_offload_file,
    when_all,
)

__all__ = [
    "ALIGN_BYTES",
    "AlignedBuffer",
    "IOConfig",
    "InlineIOEngine",
    "IOEngine",
    "OffloadFile",
    "OffloadIOError",
    "ShortReadError",
    "ThreadedIOEngine",
    "default_engine",
    "align_up",
    "open_offload_file",
    "when_all",
]
