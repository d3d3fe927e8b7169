import warnings

import pytest

from lightning_greedysnake.config import Split, Tier
from lightning_greedysnake.layout import (PARAM_ALIGN_NUMEL, build_file_layout, build_unit_layout, empty_shares,
                                        unit_tiers)


def test_parameters_start_on_aligned_offsets_and_regions_are_page_multiples():
    lay = build_unit_layout(0, [("w", (3, 5), 0), ("b", (5,), 1), ("c", (7,), 1)])
    assert [p.offset_numel for p in lay.params] == [0, PARAM_ALIGN_NUMEL, 2 * PARAM_ALIGN_NUMEL]
    assert lay.numel == lay.trained_numel == 3 * PARAM_ALIGN_NUMEL
    assert lay.trainable_numel == 15 + 5 + 7
    assert lay.nbytes(4) == 4096 and lay.nbytes(2) == 4096
    big = build_unit_layout(1, [("w", (1000, 3), 0)])
    assert big.nbytes(4) % 4096 == 0 and big.nbytes(4) >= 3000 * 4


def test_regions_do_not_overlap():
    layout = build_file_layout([4096, 8192, 4096])
    assert layout.offsets == (0, 4096, 12288)
    assert layout.total_bytes == 16384


def test_a_split_places_a_prefix_of_units_in_ram_within_the_host_share():
    from lightning_greedysnake.config import Split, Tier
    from lightning_greedysnake.layout import unit_tiers

    assert unit_tiers([4096] * 5, Split(0.6, 0.4)) == [Tier.HOST] * 3 + [Tier.SSD] * 2
    assert unit_tiers([4096] * 5, Split(0.5, 0.5)) == [Tier.HOST] * 2 + [Tier.SSD] * 3  # never more than the share
    assert unit_tiers([8192, 4096, 4096], Split(0.5, 0.5)) == [Tier.HOST, Tier.SSD, Tier.SSD]
    assert unit_tiers([4096, 4096], Tier.SSD) == [Tier.SSD, Tier.SSD]


def test_a_three_way_split_places_a_device_prefix_then_a_host_prefix_then_the_rest_on_ssd():
    from lightning_greedysnake.config import OffloadConfig, Split, Tier
    from lightning_greedysnake.layout import unit_tiers

    d, h, s = Tier.DEVICE, Tier.HOST, Tier.SSD
    assert unit_tiers([4096] * 5, Split(0.2, 0.4, device=0.4)) == [d, d, h, s, s]
    assert unit_tiers([4096] * 4, Split(0.5, 0.0, device=0.5)) == [d, d, h, h]  # no SSD share: no SSD unit
    assert unit_tiers([8192, 4096, 4096], Split(0.5, 0.0, device=0.4)) == [h, h, h]  # too big for the device share
    assert unit_tiers([4096] * 4, Split(0.0, 0.5, device=0.5)) == [d, d, s, s]
    config = OffloadConfig.everywhere("host", weights={"device": 0.5, "host": 0.5})
    assert config.weights == Split(0.5, 0.0, device=0.5) and not config.uses_ssd
    assert str(config.weights) == "{device: 0.5, host: 0.5, ssd: 0}"
    assert OffloadConfig(weights={"device": 1.0}).weights is Tier.DEVICE
    assert OffloadConfig(weights=config.weights).weights == config.weights  # (validated again as given)


def test_the_trained_parameters_are_a_prefix_and_only_it_has_master_gradient_and_state_room():
    """Issue 70: a read-only parameter (frozen, or not in the optimizer) lies after every trained one; the
    master weights, gradients and each state slot cover the trained prefix only, a step's bounds and the
    weight bytes it writes end there, and the weights region holds the whole unit."""
    from lightning_greedysnake.config import TensorKind
    from lightning_greedysnake.layout import StateLayout, build_unit_layout

    lay = build_unit_layout(0, [("a", (100,), 0), ("b", (10,), 0), ("c", (64,), 0), ("frozen", (5000,), None)])
    state = StateLayout((lay,), compute_itemsize=2, num_slots=2, separate_master=True)
    # the prefix ends on 2048 elements (4 KiB in every dtype), so a step's reads and writes stop there
    assert [s.offset_numel for s in lay.params] == [0, 128, 192, 2048]
    assert (lay.trained_numel, lay.numel) == (2048, 2048 + 5056)
    assert state.region_bytes(TensorKind.WEIGHTS, 0) == 16384  # 7104 x 2 bytes, 4 KiB aligned
    for kind in (TensorKind.MASTER_WEIGHTS, TensorKind.GRADIENTS):
        assert state.region_bytes(kind, 0) == 8192  # 2048 x 4 bytes, not 7104 x 4
    assert state.region_bytes(TensorKind.OPTIMIZER_STATES, 0) == 2 * 8192
    assert state.bounds(0) == (0, 2048)
    assert state.trained_weight_ranges(0, *state.bounds(0)) == [(0, 512)]
    assert state.byte_ranges(TensorKind.WEIGHTS, 0, *state.bounds(0)) == [(0, 4096)]  # the frozen bytes unwritten
    assert state.byte_ranges(TensorKind.GRADIENTS, 0, *state.bounds(0)) == [(0, 8192)]
    assert state.trained_weight_ranges(0, 130, 300) == [(260, 512)]  # clipped to the part
    # the one split of the weights region the planner, the reports and the I/O counters take
    assert (state.written_weight_bytes(0), state.read_only_weight_bytes(0)) == (4096, 16384 - 4096)
    frozen = build_unit_layout(1, [("w", (64,), None)])
    assert frozen.trained_numel == 0 and StateLayout((frozen,), 4, 2, False).region_bytes(TensorKind.GRADIENTS, 0) == 0
    assert StateLayout((frozen,), 4, 2, False).written_weight_bytes(0) == 0
    whole = StateLayout((build_unit_layout(0, [("a", (100,), 0)]),), 4, 2, False)
    assert whole.written_weight_bytes(0) == whole.region_bytes(TensorKind.WEIGHTS, 0) == 4096
    assert whole.read_only_weight_bytes(0) == 0
    with pytest.raises(ValueError, match=r"trained parameter 'c' laid out after a read-only one"):
        build_unit_layout(0, [("a", (100,), 0), ("frozen", (64,), None), ("c", (64,), 0)])


def test_a_read_only_parameter_in_its_own_dtype_takes_the_compute_elements_its_bytes_need():
    import torch

    from lightning_greedysnake.layout import build_unit_layout
    from lightning_greedysnake.offload.residency import slot_view

    lay = build_unit_layout(0, [("lora", (8,), 0), ("base", (10, 30), None, ("bfloat16", 2)),
                                ("codes", (100,), None, ("int8", 1))], compute_itemsize=4)
    base, codes = lay.params[1], lay.params[2]
    assert (base.offset_numel, base.span_numel) == (2048, 150)
    assert (codes.offset_numel, codes.span_numel) == (2240, 25)
    assert lay.trained_numel == 2048 and lay.numel == 2304
    flat = torch.zeros(lay.numel)
    value = torch.randn(10, 30).to(torch.bfloat16)
    slot_view(flat, base).copy_(value)
    slot_view(flat, codes).copy_(torch.arange(100, dtype=torch.int8))
    assert slot_view(flat, base).dtype == torch.bfloat16 and torch.equal(slot_view(flat, base), value)
    assert torch.equal(slot_view(flat, codes), torch.arange(100, dtype=torch.int8))
    assert flat[:2048].abs().sum() == 0  # the trained prefix untouched


def test_a_split_share_that_no_whole_unit_fits_is_found_with_the_share_it_needs():
    assert unit_tiers([60, 20, 20], Split(0.5, 0.5)) == [Tier.SSD] * 3
    assert empty_shares([60, 20, 20], Split(0.5, 0.5)) == [(Tier.HOST, 0.5, 0.6)]
    assert empty_shares([20, 20, 60], Split(0.5, 0.5)) == []  # (two units in RAM)
    assert empty_shares([30, 50, 20], Split(0.3, 0.5, device=0.2)) == [(Tier.DEVICE, 0.2, 0.3)]
    assert empty_shares([30, 50, 20], Tier.HOST) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_a_split_share_no_unit_fits_is_said_once_by_rank_zero(rank, monkeypatch):
    """Every rank lays the state out alike: the warning comes from rank 0 alone, as Lightning's own do."""
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_greedysnake.config import GreedySnakeConfig
    from lightning_greedysnake.layout import StateLayout
    from lightning_greedysnake.strategy.manager_setup import warn_empty_shares

    units = tuple(build_unit_layout(u, [("w", (n,), 0)]) for u, n in enumerate((6000, 2000, 2000)))
    state = StateLayout(units, compute_itemsize=4, num_slots=2, separate_master=False)
    config = GreedySnakeConfig(layers_per_unit=1, offload={"weights": {"host": 0.5, "ssd": 0.5}})
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warn_empty_shares(state, config)
    said = [str(w.message) for w in seen if "puts no unit on host" in str(w.message)]
    assert len(said) == (1 if rank == 0 else 0)
