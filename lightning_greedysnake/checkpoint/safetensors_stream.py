"""Writing one safetensors file tensor by tensor, so a model larger than RAM exports in one piece.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte range;
padded with spaces to 8 bytes) and the tensors' bytes back to back. Knowing every tensor's dtype and
shape up front (from a checkpoint's manifest) is enough to write the header first and stream the data.
The file is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""torch dtype -> safetensors dtype name."""
NAMES = {v: k for k, v in DTYPES.items()}


def header(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None
           ) -> tuple[bytes, list[int]]:
    """A safetensors header for tensors ``specs`` (name, dtype, shape) laid out back to back: the
    8-byte length and the JSON (padded to 8 bytes), and each tensor's byte offset after it."""
    head: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offsets, offset = [], 0
    for name, dtype, shape in specs:
        size = torch.Size(shape).numel() * dtype.itemsize
        head[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offsets.append(offset)
        offset += size
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, offsets


def write_streamed(path: str | os.PathLike[str], specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                   tensors: Iterable[tuple[str, Tensor]], metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` (yielded in the order of ``specs``: name, dtype, shape) to ``path``; returns the
    file's size. Each tensor is converted to its spec's dtype as it is written."""
    head, _ = header(specs, metadata)
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    expected = iter(specs)
    with open(tmp, "wb") as f:
        f.write(head)
        for name, tensor in tensors:
            spec = next(expected)
            if name != spec[0] or tuple(tensor.shape) != tuple(spec[2]):
                raise ValueError(f"tensor {name} {tuple(tensor.shape)} does not match its spec {spec}")
            data = tensor.detach().to(spec[1]).contiguous().reshape(-1)
            f.write(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        if next(expected, None) is not None:
            raise ValueError("fewer tensors than specs")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return target.stat().st_size
