"""Errors raised on one side of the package's layers and handled on another: the staging pool (``offload``)
raises :class:`BufferBudgetError`, the optimizer's step (``optim``, which does not import ``offload``)
handles it."""


class BufferBudgetError(ValueError):
    """A single staging request is larger than the whole budget, or the budget stayed full: nothing held
    would come back (or not within the pool's timeout)."""
