"""Export a checkpoint's model weights as one safetensors file that the plain model class loads.

    python -m lightning_greedysnake.export CKPT OUT [--dtype float32|bfloat16|float16] [--keep-prefix]
    python -m lightning_greedysnake.export CKPT OUT.ckpt --lightning

``CKPT``: a greedysnake checkpoint directory (or a plain Lightning ``.ckpt`` file). ``OUT``: a
``.safetensors`` file, or a directory that gets ``model.safetensors``. Names are the layered model's own
(``blocks.0.attn.qkv.weight``, not ``model.blocks.0...``), so ``model.load_state_dict(load_file(OUT))``
works on the bare model; ``--keep-prefix`` keeps the LightningModule's names instead. Weights are read
and written one unit at a time, checksums verified; the output needs nothing but safetensors and torch
to load. ``--lightning`` writes a plain Lightning checkpoint file instead, which any strategy resumes
from (the whole state gathered in memory).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from lightning_greedysnake.checkpoint.format import CheckpointError, CheckpointReader, is_checkpoint_dir
from lightning_greedysnake.checkpoint.plain import plain_checkpoint
from lightning_greedysnake.checkpoint.safetensors_stream import write_streamed
from lightning_greedysnake.checkpoint.streamed import EXTRA_FILE, model_file

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}

Rename = Callable[[str], "str | None"]
"""Maps a checkpoint name to the exported name; ``None`` drops the entry."""


def _strip(prefix: str) -> Rename:
    def rename(name: str) -> str | None:
        return name[len(prefix):] if name.startswith(prefix) else None

    return rename


def _target(out: str | os.PathLike[str]) -> Path:
    out = Path(out)
    if out.suffix == ".safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        return out
    out.mkdir(parents=True, exist_ok=True)
    return out / "model.safetensors"


def _cast(t: Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if t.is_floating_point() else t.dtype


Spec = tuple[str, torch.dtype, tuple[int, ...]]
"""An exported tensor's name, dtype and shape."""


def model_tensors(checkpoint: str | os.PathLike[str], dtype: str = "float32", keep_prefix: bool = False,
                  rename: Rename | None = None) -> tuple[list[Spec], Iterator[tuple[str, Tensor]]]:
    """The model weights of ``checkpoint`` under their exported names: every tensor's spec (its dtype
    ``dtype`` where it is floating point) up front, and an iterator over ``(name, tensor)`` in the same
    order that reads one unit at a time (tensors as stored: the writer casts them to their spec's dtype).
    Names as :func:`export_checkpoint` documents."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {sorted(DTYPES)}.")
    to = DTYPES[dtype]
    if not is_checkpoint_dir(checkpoint):
        return _plain_tensors(Path(checkpoint), to, rename or (lambda n: n))
    reader = CheckpointReader(checkpoint)
    prefix = "" if keep_prefix else reader.manifest.get("layered_prefix", "")
    rename = rename or _strip(prefix)
    extra = reader.read_tensors(EXTRA_FILE) if EXTRA_FILE in reader.files else {}
    params = reader.manifest["params"]
    order = sorted(params, key=lambda n: (params[n]["unit"], n))
    specs: list[Spec] = []
    for name in order:
        new = rename(name)
        if new is not None:
            p_dtype = getattr(torch, params[name]["dtype"])
            specs.append((new, to if p_dtype.is_floating_point else p_dtype, tuple(params[name]["shape"])))
    extra_names = [n for n in sorted(extra) if rename(n) is not None]
    specs += [(rename(n), _cast(extra[n], to), tuple(extra[n].shape)) for n in extra_names]  # type: ignore[misc]

    def tensors() -> Iterator[tuple[str, Tensor]]:
        by_unit: dict[int, list[str]] = {}
        for name in order:
            if rename(name) is not None:
                by_unit.setdefault(params[name]["unit"], []).append(name)
        for unit in sorted(by_unit):
            values = reader.read_tensors(model_file(unit))
            for name in by_unit[unit]:
                yield rename(name), values[name]  # type: ignore[misc]
            del values
        for name in extra_names:
            yield rename(name), extra[name]  # type: ignore[misc]

    return specs, tensors()


def export_checkpoint(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], dtype: str = "float32",
                      keep_prefix: bool = False, rename: Rename | None = None,
                      metadata: dict[str, str] | None = None) -> Path:
    """Write the model weights of ``checkpoint`` to ``out`` (see the module docstring); returns the file.

    ``rename`` overrides the naming (the Hugging Face export maps names with it)."""
    specs, tensors = model_tensors(checkpoint, dtype, keep_prefix, rename)
    target = _target(out)
    write_streamed(target, specs, tensors, {"format": "pt", **(metadata or {})})
    return target


def _plain_tensors(path: Path, to: torch.dtype, rename: Rename) -> tuple[list[Spec], Iterator[tuple[str, Tensor]]]:
    if not path.is_file():
        raise CheckpointError(f"{path} is neither a greedysnake checkpoint directory nor a checkpoint file.")
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    items = [(rename(n), t) for n, t in state.items() if rename(n) is not None]
    specs = [(n, _cast(t, to), tuple(t.shape)) for n, t in items]
    return specs, iter(items)  # type: ignore[arg-type]


def export_lightning(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """A plain Lightning checkpoint file (``torch.save``; full-precision weights, optimizer state, loops,
    schedulers) from a greedysnake checkpoint directory, which any strategy resumes from and
    ``LightningModule.load_from_checkpoint`` reads. Gathers the whole state in memory."""
    state = plain_checkpoint(checkpoint)  # (checkpoint/plain.py)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, target)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--keep-prefix", action="store_true",
                        help="keep the LightningModule's parameter names (default: the layered model's)")
    parser.add_argument("--lightning", action="store_true",
                        help="write a plain Lightning checkpoint file (weights, optimizer, loops) instead")
    args = parser.parse_args(argv)
    if not Path(args.checkpoint).exists():
        parser.exit(2, f"error: checkpoint {args.checkpoint} does not exist. Fix: pass a checkpoint directory "
                       "(NAME.ckpt/ as ModelCheckpoint writes it) or a Lightning checkpoint file.\n")
    try:
        if args.lightning:
            target = export_lightning(args.checkpoint, args.out)
        else:
            target = export_checkpoint(args.checkpoint, args.out, args.dtype, args.keep_prefix)
    except (CheckpointError, OSError, ValueError) as e:
        parser.exit(1, f"error: {e}\n")
    print(f"wrote {target} ({target.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
