"""The meta model's stand-ins at setup (``manager_setup.stand_in_for_meta_parameters``): memory-less, the same
Parameter objects, the tensors outside the units refused, and each unit's parameters listed once (a test
per parameter against every unit made a 400-layer model's setup take minutes before the preflight)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_greedysnake.models.discovery import Unit
from lightning_greedysnake.strategy.manager_setup import stand_in_for_meta_parameters


def _model_and_units(n_blocks: int) -> tuple[nn.Module, list[Unit]]:
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(n_blocks)))
    units = [Unit(i, (i,), (block,)) for i, block in enumerate(model)]
    return model, units


def test_meta_parameters_get_memoryless_stand_ins_in_place() -> None:
    model, units = _model_and_units(3)
    params = list(model.parameters())
    assert stand_in_for_meta_parameters(model, units, uses_tensor_manager=True)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]  # the same objects
    for p in params:
        assert not p.is_meta and p.device.type == "cpu"
        assert p.untyped_storage().nbytes() <= p.element_size()  # one element, expanded


def test_a_meta_tensor_outside_the_units_is_refused() -> None:
    model, units = _model_and_units(2)
    with torch.device("meta"):
        model.register_buffer("scale", torch.ones(4))
    with pytest.raises(ValueError, match=r"meta device outside the layered model's parameters: \['scale'\]"):
        stand_in_for_meta_parameters(model, units, uses_tensor_manager=True)


def test_each_unit_is_listed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model, units = _model_and_units(40)
    calls = []
    listed = Unit.parameters
    monkeypatch.setattr(Unit, "parameters", lambda self: calls.append(self.index) or listed(self))
    assert stand_in_for_meta_parameters(model, units, uses_tensor_manager=True)
    assert sorted(calls) == list(range(40))  # once each, not once per parameter of the model
