"""A frozen parameter several units use (GPT-2's head tied to its embedding; one frozen module at two positions)
is laid out by each of them, read-only: while any of them holds it, the parameter shows that unit's copy; only
when the last lets go does it fall back to the placeholder (issue 70)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_greedysnake.config import OffloadConfig
from lightning_greedysnake.models import make_units, sequential_chain
from lightning_greedysnake.tensor_manager import TieredTensorStore


def test_a_frozen_parameter_of_two_units_stays_bound_while_either_holds_it(tmp_path):
    torch.manual_seed(0)
    shared = nn.Linear(8, 8).requires_grad_(False)
    model = nn.Sequential(shared, nn.Linear(8, 8), shared)
    value = shared.weight.detach().clone()
    units = make_units(sequential_chain(model), 1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    store = TieredTensorStore(units, names, optimizer, OffloadConfig.everywhere("ssd").placed())
    store.open(tmp_path)
    try:
        store.initialize_from_parameters()  # (every unit's copy from the same values)
        assert [len(store.params[u]) for u in range(3)] == [2, 2, 2]
        assert all(slot.group is None for u in (0, 2) for slot in store.layouts[u].params)
        store.acquire_unit(0)
        store.acquire_unit(2)
        store.release_unit(0)
        assert torch.equal(shared.weight, value)  # unit 2's copy
        store.acquire_unit(0)
        store.release_unit(2)
        assert torch.equal(shared.weight, value)  # unit 0's copy
        store.release_unit(0)
        assert shared.weight.isnan().all()  # no unit holds it: the placeholder
    finally:
        store.close()
