"""Ready-made pieces for the examples: a byte-level corpus that needs no download, and a GPT module."""

from lightning_greedysnake.recipes.data import StdlibBytesDataModule, build_stdlib_corpus
from lightning_greedysnake.recipes.gpt_module import GPTLightningModule

__all__ = ["GPTLightningModule", "StdlibBytesDataModule", "build_stdlib_corpus"]
