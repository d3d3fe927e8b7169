"""How messages name an optimizer step: one wording, so the same step reads the same everywhere.

Lightning's ``trainer.global_step`` counts the optimizer steps *completed*: while the N-th step runs
it is N - 1, after it N. Every message names the step by its ordinal and says the ``global_step``
that goes with it, so a non-finite loss "in optimizer step 4 (trainer.global_step=3 during it)" and
the weights "of optimizer step 3 (trainer.global_step=3)" that a failure leaves are plainly one step
apart.
"""

from __future__ import annotations


def step_running(global_step: int) -> str:
    """The step in progress while ``trainer.global_step`` is ``global_step``."""
    return f"optimizer step {global_step + 1} (trainer.global_step={global_step} during it)"


def step_done(global_step: int) -> str:
    """The step whose update ``trainer.global_step == global_step`` counts last (0: none yet)."""
    if global_step == 0:
        return "the initial weights (trainer.global_step=0: no optimizer step yet)"
    return f"optimizer step {global_step} (trainer.global_step={global_step})"
