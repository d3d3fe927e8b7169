"""Errors and warnings raised on one side of the package's layers and handled on another, or by you: the
staging pool (``offload``) raises :class:`BufferBudgetError`, the optimizer's step (``optim``, which does
not import ``offload``) handles it, and warns :class:`ReadAheadGivenBackWarning` when it does."""


class BufferBudgetError(ValueError):
    """A single staging request is larger than the whole budget, or the budget stayed full: nothing held
    would come back (or not within the pool's timeout)."""


class ReadAheadGivenBackWarning(UserWarning):
    """A step found the staging budget full while read-aheads of later steps held part of it, and gave
    them back to go on (their steps read again what they had read): the result is unchanged, the reads
    are done twice. The budget's rule (:meth:`~lightning_greedysnake.offload.staging.PoolBudget.read_ahead_fits`)
    should never let a read-ahead take what a step must have; the tests make this warning an error."""
