"""A window's model inputs, compared: what ``training_step`` hands the model for a micro-batch must be
what the look-ahead captured for it when the window was planned (:class:`InputMismatchError`)."""

from __future__ import annotations


import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten


class InputMismatchError(RuntimeError):
    """The training_step fed the model different inputs than when the window was planned."""


def same_inputs(a: tuple[tuple, dict], b: tuple[tuple, dict], deferred: list[Tensor] | None = None) -> bool:
    """Whether two model calls' inputs are the same. Tensors that are the same view of the same memory
    are equal without reading them; other host tensors are compared now; other device tensors, with
    ``deferred`` given, are compared on the device into a flag appended there (True: they differ), which
    the caller reads once for many (a host read of a device value waits for the device: no
    ``torch.equal`` per micro-batch)."""
    leaves_a, spec_a = tree_flatten(a)
    leaves_b, spec_b = tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            if not (isinstance(x, Tensor) and isinstance(y, Tensor)):
                return False
            if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
                return False
            if x is y or (x.data_ptr() == y.data_ptr() and x.stride() == y.stride()):
                continue  # (training_step handed over the look-ahead's own tensor, or the same slice of it)
            if deferred is not None and x.device.type != "cpu":
                deferred.append(torch.ne(x, y).any())  # (on the device: no host read here)
            elif not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def input_mismatch(microbatches: list[int]) -> InputMismatchError:
    return InputMismatchError(
        f"training_step called the model with different inputs for micro-batch(es) {microbatches} than when "
        "greedysnake planned the window (it runs training_step once ahead of time, up to the model "
        "call, to collect every micro-batch's inputs). Fix: make everything before the model call in "
        "training_step deterministic (e.g. no random augmentation there; do it in the dataloader)."
    )
