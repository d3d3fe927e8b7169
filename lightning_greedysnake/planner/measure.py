"""The measured inputs of the roofline: the tensor manager's byte sizes per unit, and timings."""

from __future__ import annotations

from typing import Any

from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.planner.roofline import UnitCost


def unit_costs(manager: Any, forward_s: list[float] | None = None, backward_s: list[float] | None = None
               ) -> list[UnitCost]:
    """:class:`UnitCost` per unit of a :class:`TieredTensorStore` (sizes as laid out; times if given)."""
    sizes = manager._region_bytes
    out = []
    for u, lay in enumerate(manager.layouts):
        opt = manager.unit_optimizers[u]
        alpha_w = alpha_g = 0
        if opt is not None and lay.trainable_numel:
            lo, hi = opt.part_range(1)
            if lo < hi:
                alpha_w = sum(b - a for a, b in manager._byte_ranges(TensorKind.WEIGHTS, u, lo, hi))
                alpha_g = sum(b - a for a, b in manager._byte_ranges(TensorKind.GRADIENTS, u, lo, hi))
        out.append(UnitCost(
            forward_s=forward_s[u] if forward_s else 0.0,
            backward_s=backward_s[u] if backward_s else 0.0,
            weight_bytes=sizes[TensorKind.WEIGHTS][u],
            grad_bytes=sizes[TensorKind.GRADIENTS][u],
            master_bytes=sizes[TensorKind.MASTER_WEIGHTS][u],
            state_bytes=sizes[TensorKind.OPTIMIZER_STATES][u],
            params=lay.trainable_numel,
            alpha_weight_bytes=alpha_w,
            alpha_grad_bytes=alpha_g,
        ))
    return out
