"""A byte-level language-modelling corpus built from the Python standard library's own source files.

Every machine with Python has them, so the examples and tests train on real text without downloads.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

SEPARATOR = b"\n\n"


def build_stdlib_corpus(max_bytes: int = 2_000_000, root: str | Path | None = None) -> torch.Tensor:
    """uint8 tensor of up to ``max_bytes`` bytes: the stdlib's ``*.py`` files in sorted path order."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be positive. Fix: e.g. max_bytes=2000000.")
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"standard library source directory {base} not found")
    chunks: list[bytes] = []
    total = 0
    for path in sorted(base.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue  # third-party code and the huge test suite would dominate
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data + SEPARATOR)
        total += len(data) + len(SEPARATOR)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


class _Chunks(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes -> (input, next-byte target)."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.block_size = block_size
        self.length = (len(data) - 1) // block_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : i * self.block_size + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibBytesDataModule(L.LightningDataModule):
    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 8,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.05,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if block_size < 1 or batch_size < 1:
            raise ValueError(
                f"block_size={block_size} and batch_size={batch_size} must be positive integers."
            )
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in (0, 1). Fix: e.g. val_fraction=0.05.")
        self.block_size, self.batch_size = block_size, batch_size
        self.max_bytes, self.val_fraction = max_bytes, val_fraction
        self.seed, self.num_workers = seed, num_workers
        self.train_set: _Chunks | None = None
        self.val_set: _Chunks | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        corpus = build_stdlib_corpus(self.max_bytes)
        split = int(len(corpus) * (1 - self.val_fraction))
        self.train_set = _Chunks(corpus[:split], self.block_size)
        self.val_set = _Chunks(corpus[split:], self.block_size)
        if len(self.train_set) == 0 or len(self.val_set) == 0:
            raise ValueError(
                f"max_bytes={self.max_bytes} is too small for block_size={self.block_size}: no training or "
                "validation sequence fits. Fix: raise max_bytes or lower block_size."
            )

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator,
                          num_workers=self.num_workers, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
