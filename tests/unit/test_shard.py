"""Partitioned state: the chunks of a unit and the optimizer's parts within a chunk."""

from __future__ import annotations

import pytest

from lightning_greedysnake.layout import SPLIT_ALIGN_NUMEL, shard_bounds
from lightning_greedysnake.layout import build_unit_layout as build_layout
from lightning_greedysnake.optim.unit_optimizer import split_numel


@pytest.mark.parametrize("numel, world", [(10_000, 2), (10_000, 3), (100, 4), (2 * SPLIT_ALIGN_NUMEL, 2)])
def test_chunks_cover_the_unit_once_on_aligned_boundaries(numel, world):
    layout = build_layout(0, [("w", (numel,), 0)])
    chunks = [shard_bounds(layout, r, world) for r in range(world)]
    covered = [i for lo, hi in chunks for i in range(lo, hi)]
    assert covered == list(range(layout.numel))  # in order, no gap, no overlap
    assert all(lo % SPLIT_ALIGN_NUMEL == 0 for lo, hi in chunks if lo < hi)


def test_the_alpha_split_falls_inside_the_chunk():
    layout = build_layout(0, [("w", (50_000,), 0)])
    lo, hi = shard_bounds(layout, 1, 2)
    split = split_numel(layout, 0.25, (lo, hi))
    assert lo <= split <= hi and (split - lo) % SPLIT_ALIGN_NUMEL == 0
    assert split_numel(layout, 0.0, (lo, hi)) == hi and split_numel(layout, 1.0, (lo, hi)) == lo
