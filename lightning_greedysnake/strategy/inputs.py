"""A window's micro-batch inputs, ahead of Lightning: the training data read ahead
(:class:`~lightning_greedysnake.lookahead.LookaheadLoader`), each batch prepared exactly as Lightning
prepares the one it hands to ``training_step``, and ``training_step`` run up to its model call to
capture the layered model's inputs (logging muted, the model call answered by an exception).

Training thread only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_greedysnake.engine import WindowEngine
from lightning_greedysnake.lookahead import LookaheadLoader
from lightning_greedysnake.strategy.lightning_api import before_batch_transfer


class _CapturedInputs(BaseException):
    """Raised from the layered model's forward to stop a look-ahead training_step at the model call.

    A BaseException, so that a user's ``except Exception`` around the model call does not swallow it."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args = args
        self.kwargs = kwargs


def tokens_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Tokens in a model call: the elements of its first integer tensor input (token ids), else 0."""
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, Tensor) and not leaf.is_floating_point() and not leaf.is_complex():
            return leaf.numel()
    return 0


def loss_of(output: Any) -> Tensor | None:
    """What Lightning will back-propagate from a training_step output (mirrors ClosureResult)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if isinstance(loss, Tensor) else None
    return None


@contextlib.contextmanager
def forward_replaced(module: nn.Module, fn: Callable[..., Any]) -> Iterator[None]:
    """Answer calls to ``module`` with ``fn``; an instance attribute shadows the class's ``forward``
    while nn.Module.__call__ (and any hooks) stay in place."""
    previous = module.__dict__.get("forward")
    module.forward = fn  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous  # type: ignore[method-assign]


@contextlib.contextmanager
def logging_muted(module: LightningModule) -> Iterator[None]:
    module.log = lambda *a, **k: None  # type: ignore[method-assign]
    module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log
        del module.log_dict


def read_ahead(dataloader: Any, k: int) -> LookaheadLoader:
    """The train dataloader, read ahead far enough for a window of ``k`` micro-batches: what the strategy's
    ``process_dataloader`` returns while training, whether or not its run is set up yet (Lightning may set
    the train dataloader up during the strategy's setup, e.g. for ``trainer.estimated_stepping_batches``
    in ``configure_optimizers``, and keeps that one for the fit)."""
    if isinstance(dataloader, LookaheadLoader):
        dataloader = dataloader.loader
    return LookaheadLoader(dataloader, keep=max(2 * k + 2, 4))


def lookahead_of(data: Any) -> LookaheadLoader:
    """The look-ahead wrapper of the train dataloader Lightning iterates (``trainer.train_dataloader``),
    or the error that says why there is none and how to fix it."""
    if isinstance(data, LookaheadLoader):
        assert data.iterator is not None, "Lightning hands over batches before iterating its dataloader"
        return data
    if isinstance(data, (Mapping, list, tuple)):
        raise ValueError(
            "strategy='greedysnake' reads each accumulation window's micro-batches ahead of Lightning from "
            f"a single train dataloader, not from a {type(data).__name__} of {len(data)}: several train "
            "dataloaders (a list, a dict or a CombinedLoader of them) are not supported. Fix: return one "
            "DataLoader, not wrapped in a list or dict, from train_dataloader() (or pass it to trainer.fit); "
            "to combine datasets, make one Dataset that yields the batch training_step takes."
        )
    raise RuntimeError(
        "greedysnake could not read the training data ahead: the train dataloader Lightning iterates (a "
        f"{type(data).__name__}) was set up while the trainer was not in its training stage, so the "
        "strategy could not wrap it. This happens when trainer.estimated_stepping_batches is first read in "
        "a validation hook during the sanity check. Fix: read it in configure_optimizers() or a training "
        "hook (setup, on_fit_start, on_train_start), or set Trainer(num_sanity_val_steps=0)."
    )


class WindowInputs:
    def __init__(self, layered: nn.Module, name: str) -> None:
        self.layered = layered
        self.name = name
        """The layered model as messages name it (the user's class and the path: ``MyModule.net``)."""
        self.loader: LookaheadLoader | None = None
        """The train dataloader Lightning iterates, as of the last window opened."""
        self._seen_iterator: object | None = None
        self._iterator_offset = 0
        self._window_start = 0
        """Epoch-local position of the current window's first micro-batch."""

    def open_window(self, engine: WindowEngine, position: int, k: int, limit: float,
                    warn: Callable[[str, str], None], data: Any, step: int) -> int:
        """Begin the window the batch at epoch-local ``position`` belongs to, if it is not begun (after
        forgetting one that Lightning cut short); returns the batch's micro-batch index in it. ``data``:
        the train dataloader Lightning iterates (``trainer.train_dataloader``); ``step``: the optimizer step
        the window ends in (``trainer.global_step``)."""
        self._sync(data, position)
        if engine.window_active and (position % k == 0 or position < self._window_start):
            # the previous window never reached its optimizer step (the epoch was cut short): Lightning
            # discards its gradients too; drop our state for it
            warn("abandoned", "greedysnake: an accumulation window ended without an optimizer step.")
            engine.abort_window()
        if not engine.window_active:
            self._window_start = position
            engine.begin_window(self.window_size(position - position % k, position, k, limit), step)
        return position - self._window_start

    def feed(self, engine: WindowEngine, microbatch: int, module: LightningModule, args: tuple[Any, ...],
             kwargs: dict[str, Any], step_context: Callable[[], Any], convert: Callable[[Any], Any],
             to_device: Callable[[Any], Any]) -> None:
        """Give the engine the model inputs of every micro-batch its ops read up to ``microbatch``'s fused
        op: this micro-batch's from Lightning's own ``args``, the others read ahead and prepared here."""
        for needed in engine.inputs_needed_until_fused(microbatch):
            if engine.has_inputs(needed):
                continue
            if needed == microbatch:
                step_args, step_kwargs = args, kwargs
            else:
                at = self._window_start + needed
                step_args, step_kwargs = self.step_args(module, self.raw_batch(at), at, convert, to_device), {}
            engine.set_inputs(needed, *self.capture(module, step_context, step_args, step_kwargs))

    def _sync(self, data: Any, position: int) -> None:
        """Lightning hands over the batch at epoch-local ``position`` from ``data``: a fresh iterator (a
        new epoch, or a reloaded dataloader) starts counting there."""
        self.loader = loader = lookahead_of(data)
        iterator = loader.iterator
        if iterator is not self._seen_iterator:
            self._seen_iterator = iterator
            self._iterator_offset = position

    def raw_batch(self, position: int) -> Any:
        """The raw batch at epoch-local ``position`` (None past the end of the data)."""
        assert self.loader is not None and self.loader.iterator is not None, "no window opened"
        return self.loader.iterator.get(position - self._iterator_offset)

    def window_size(self, start: int, position: int, k: int, limit: float) -> int:
        """Micro-batches in the window that ``position`` opens (Lightning's own windows: aligned to
        multiples of K within the epoch, the last one cut by the end of the data or ``limit`` batches)."""
        end = start + k
        if limit != float("inf"):
            end = min(end, int(limit))
        size = 1
        for p in range(position + 1, end):
            if self.raw_batch(p) is None:
                break
            size += 1
        return size

    def step_args(self, module: LightningModule, raw: Any, position: int,
                  convert: Callable[[Any], Any], to_device: Callable[[Any], Any]) -> tuple[Any, ...]:
        """A read-ahead batch prepared exactly as Lightning prepares the batch it hands to training_step."""
        batch = to_device(before_batch_transfer(module, convert(raw)))
        if is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2):
            return (batch, position)
        return (batch,)

    def capture(self, module: LightningModule, step_context: Callable[[], Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        """Run training_step up to its model call and return the model's inputs (logging muted)."""

        def capture(*a: Any, **kw: Any) -> Any:
            raise _CapturedInputs(a, kw)

        with forward_replaced(self.layered, capture), logging_muted(module):
            try:
                with step_context():
                    module.training_step(*args, **kwargs)
            except _CapturedInputs as captured:
                return captured.args, captured.kwargs
        raise ValueError(self.no_model_call_message())

    def no_model_call_message(self) -> str:
        return (
            f"training_step did not call the layered model ({self.name}, a {type(self.layered).__name__}). "
            "strategy='greedysnake' runs that model unit by unit and needs training_step to call it exactly "
            "once per micro-batch. Fix: call it in training_step, or point layered_module at the module "
            "training_step calls."
        )
