"""The tensor manager seam: the engine asks it for each unit's weights and saved activations, and
hands it each unit's finished gradient. The in-memory implementation keeps everything where it is; the
SSD tier plugs in behind the same Protocol.

A *saved activation* (the ``*_activation`` methods) is a unit's input for one micro-batch, kept from
forward for backward's recompute; it is not a training checkpoint (the strategy's ``save_checkpoint`` /
``load_checkpoint``, see ``checkpoint/``)."""

from __future__ import annotations

from collections import Counter
from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class TensorStore(Protocol):
    def begin_window(self, num_microbatches: int) -> None:
        """A window of ``num_microbatches`` begins (its saved activations: the input of every unit
        but the first, per micro-batch)."""

    def acquire_unit(self, unit: int) -> None:
        """Make ``unit``'s compute weights usable on the compute device until ``release_unit``."""

    def release_unit(self, unit: int) -> None:
        """The engine is done with ``unit``'s weights for now."""

    def save_activation(self, unit: int, microbatch: int, hidden: Tensor) -> None:
        """Keep the input of ``unit`` for ``microbatch`` (the output of ``unit - 1``): its saved
        activation."""

    def load_activation(self, unit: int, microbatch: int) -> Tensor:
        """The tensor saved by ``save_activation``; it stays stored until ``drop_activation``. The tensor
        returned is valid until ``release_activation`` or ``drop_activation`` of it."""

    def release_activation(self, unit: int, microbatch: int) -> None:
        """The op that loaded it is done with the tensor for now (it stays stored for backward); an
        offloading store may free its memory and read it back at the next load."""

    def drop_activation(self, unit: int, microbatch: int) -> None:
        """The saved activation will not be read again in this window."""

    def gradient_ready(self, unit: int) -> None:
        """``unit``'s parameter gradient for this window is complete (the optimizer may step it)."""

    def prefetch(self, unit: int) -> None:
        """A hint: ``unit``'s weights will be acquired next; start bringing them in if that is cheap."""

    def prefetch_activation(self, unit: int, microbatch: int) -> None:
        """A hint: that saved activation will be loaded soon; start reading it if that is cheap."""

    def prefetch_step(self, unit: int, last: bool = True) -> bool:
        """A hint: ``unit``'s optimizer step comes (``last``: it is the window's last, which the next forward
        waits for); start reading what it reads if that is cheap. Returns whether the step's reads are under
        way (now or before) or it has none to start; False where they could not start now (the budget), so
        the hints for the steps after it wait their turn."""

    def end_window(self, completed: bool = True) -> None:
        """The window is over: forget its saved activations; ``completed=False``: it was abandoned
        before its optimizer step, so its gradients are dropped too."""

    def close(self) -> None:
        """Release every resource (buffers, files, threads). Idempotent."""


class InMemoryTensorStore:
    """Everything stays on the compute device; counts what an offloading store would have to move.
    Lightning steps the user's optimizer on the resident parameters."""

    def __init__(self) -> None:
        self._activations: dict[tuple[int, int], Tensor] = {}
        self.weight_loads: Counter[int] = Counter()
        """Times each unit's weights were acquired, since construction."""
        self.gradient_ready_order: list[int] = []
        """Units in the order their gradients completed, since construction."""

    def begin_window(self, num_microbatches: int) -> None:
        pass

    def acquire_unit(self, unit: int) -> None:
        self.weight_loads[unit] += 1

    def release_unit(self, unit: int) -> None:
        pass

    def save_activation(self, unit: int, microbatch: int, hidden: Tensor) -> None:
        key = (unit, microbatch)
        assert key not in self._activations, f"activation {key} saved twice in one window"
        self._activations[key] = hidden

    def load_activation(self, unit: int, microbatch: int) -> Tensor:
        return self._activations[(unit, microbatch)]

    def release_activation(self, unit: int, microbatch: int) -> None:
        pass

    def drop_activation(self, unit: int, microbatch: int) -> None:
        self._activations.pop((unit, microbatch), None)

    def gradient_ready(self, unit: int) -> None:
        self.gradient_ready_order.append(unit)

    def prefetch(self, unit: int) -> None:
        pass

    def prefetch_activation(self, unit: int, microbatch: int) -> None:
        pass

    def prefetch_step(self, unit: int, last: bool = True) -> bool:
        return False  # (nothing is read: no later step's hint is worth asking)

    @property
    def num_saved_activations(self) -> int:
        return len(self._activations)

    def end_window(self, completed: bool = True) -> None:
        self._activations.clear()

    def close(self) -> None:
        self._activations.clear()
