"""Reading the LightningModule's parameters during fit: a Callback that saves the adapters with the ecosystem's own
call (PEFT's ``model.save_pretrained``, LitGPT's LoRA checkpoint of ``model.state_dict()``).

With the tensor manager a unit parameter's ``data`` is its unit's buffer only while the unit is held; between uses
it is a NaN placeholder in the compute dtype (not even the parameter's own: a bf16 base reads as fp32). A
``state_dict()`` during fit would silently give those NaNs, so while a run is open the ``state_dict`` of every module
that owns a unit parameter refuses (:class:`PlaceholderRead`), naming the fix: :func:`readable` (the strategy's
``parameters_readable``) binds the parameters to their current values for a block. The strategy's own state dicts
(Lightning's checkpoints, ``full_state_dict``) pass: they stream from the tiers.

Threads: the training thread (Lightning's hooks and callbacks, between optimizer steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor, nn

from lightning_greedysnake.tensor_manager import TieredTensorStore
from lightning_greedysnake.unit_state import UnitReader


class PlaceholderRead(RuntimeError):
    """A module's state dict was asked for during fit, outside ``parameters_readable``: its unit parameters are
    NaN placeholders between uses."""


class ReadGuard:
    """``state_dict`` pre-hooks on every module of ``root`` that owns one of ``params`` (so a call on any module
    that reaches them refuses), open inside :meth:`open`. :meth:`remove` at the end of the run."""

    def __init__(self, root: nn.Module, params: list[nn.Parameter], name: str) -> None:
        self.message = (
            f"{name}'s parameters are read during fit outside trainer.strategy.parameters_readable(): greedysnake keeps "
            "them in its tiers, and between uses they are NaN placeholders, so this state_dict would hold NaNs. Fix: "
            "read them inside `with trainer.strategy.parameters_readable(): ...` (from a Callback hook between "
            "optimizer steps, e.g. on_train_epoch_end or on_save_checkpoint; trainable_only=True binds only the "
            "trained ones, the adapters of a LoRA run), or use trainer.strategy.full_state_dict(), or save with "
            "ModelCheckpoint / trainer.save_checkpoint.")
        self._open = 0
        owned = {id(p) for p in params}
        self._handles = [m.register_state_dict_pre_hook(self._refuse) for m in root.modules()
                         if any(id(p) in owned for p in m.parameters(recurse=False))]

    def _refuse(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not self._open:
            raise PlaceholderRead(self.message)

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@contextlib.contextmanager
def readable(manager: TieredTensorStore, reader: UnitReader, guard: ReadGuard | None, trainable_only: bool
             ) -> Iterator[None]:
    """Every unit parameter (``trainable_only``: every trained one) bound to a new tensor holding its current value
    in its own dtype for the block (pending optimizer steps completed first), and the guard open; what they were
    bound to before comes back after it. Read only: what the block writes into them is not kept. Whole units are
    read one at a time (by ``reader``: ``manager.values``, or a gather of every rank's chunks, collective, with
    partitioned state), the base with them: ``trainable_only`` saves memory, not reading. What stays bound for the
    block is the whole model's weights (``trainable_only``: the trained ones)."""
    values, weights = manager.values, manager.weights
    held = [u for u in range(values.num_units) if weights.is_held(u)]
    if held:
        raise RuntimeError(
            f"parameters_readable() was entered while units {held} are in use by the training step. Fix: enter it "
            "between optimizer steps, from a Callback hook such as on_train_batch_end, on_train_epoch_end or "
            "on_save_checkpoint, not from inside training_step or a forward.")
    before: list[tuple[nn.Parameter, Tensor]] = []
    try:
        for u in range(values.num_units):
            slots = values.layouts[u].params
            if trainable_only and all(slot.group is None for slot in slots):
                continue
            current = reader.unit_master_weights(u)
            for p, slot, value, dtype in zip(values.params[u], slots, current, weights.dtypes[u], strict=True):
                if trainable_only and slot.group is None:
                    continue
                before.append((p, p.data))
                p.data = value if value.dtype == dtype else value.to(dtype)
            del current
        with guard.open() if guard is not None else contextlib.nullcontext():
            yield
    finally:
        for p, data in reversed(before):
            p.data = data
