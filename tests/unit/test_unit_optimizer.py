"""The per-unit optimizer's arithmetic that a wrong constant would break silently (issue 53's mutation
audit): where alpha splits a unit, and the step count a part keeps where the optimizer keeps none."""

from __future__ import annotations

import torch

from lightning_greedysnake.layout import SPLIT_ALIGN_NUMEL, build_unit_layout, split_numel
from lightning_greedysnake.optim.unit_optimizer import FlatState, UnitOptimizer


def test_alpha_is_the_deferred_share_at_the_units_end():
    """``[split, hi)`` is the deferred (alpha) share: a quarter of the unit at alpha 0.25, not three
    quarters (an alpha of 0.5 cannot tell the two apart)."""
    lay = build_unit_layout(0, [("w", (SPLIT_ALIGN_NUMEL * 40,), 0)])
    for alpha, want in ((0.25, 30), (0.1, 36), (0.75, 10)):
        assert split_numel(lay, alpha) == SPLIT_ALIGN_NUMEL * want, alpha
    assert split_numel(lay, 0.25, bounds=(SPLIT_ALIGN_NUMEL * 8, SPLIT_ALIGN_NUMEL * 24)) == SPLIT_ALIGN_NUMEL * 20
    assert split_numel(lay, 0.0) == lay.numel and split_numel(lay, 1.0) == 0


def test_each_part_counts_its_own_steps_where_the_optimizer_keeps_none():
    """SGD keeps no ``step`` of its own: each part's count is what seeds the state's stochastic rounding, so
    the deferred part must count its steps as the first does."""
    n = SPLIT_ALIGN_NUMEL * 4
    lay = build_unit_layout(0, [("w", (n,), 0)])
    param = torch.nn.Parameter(torch.zeros(n))
    opt = UnitOptimizer(torch.optim.SGD([param], lr=0.1, momentum=0.9), lay, ("momentum_buffer",),
                        split=split_numel(lay, 0.5))
    master, grad = torch.zeros(lay.numel), torch.ones(lay.numel)
    state = FlatState({"momentum_buffer": torch.zeros(lay.numel)})
    for steps in (1, 2, 3):
        for part in (0, 1):
            opt.step(master, grad, state, [True], part)
            assert opt.step_number(part) == steps, (part, steps)
    # and both halves moved alike: SGD with momentum, three steps of gradient one
    assert torch.equal(master[: n // 2], master[n // 2 :]) and master[0] < 0
