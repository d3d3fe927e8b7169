"""What the start-of-run report's parts say alike: the glossary its terms are defined in, and why a kind of
tensor keeps no bytes where it is placed (the placement table and the offload directories' breakdown say it
in the same words, from :func:`kinds_without_bytes`). A disk's speeds are written by
:attr:`~lightning_greedysnake.planner.roofline.Machine.disk` wherever they are said."""

from __future__ import annotations

from collections import Counter

from lightning_greedysnake.config import REGION_KINDS, TensorKind, Tier
from lightning_greedysnake.layout import StateLayout
from lightning_greedysnake.offload.preflight import human_bytes
from lightning_greedysnake.offload.regions import RegionPlacement

GLOSSARY = "docs/concepts/glossary.md"
"""The glossary page (in the repository and the documentation site) of the terms the report uses."""

GLOSSARY_TERMS = ("roofline", "lane", "binding resource", "host budget", "staging")
"""The terms the report uses that a new user may not know, each an entry of :data:`GLOSSARY`."""

TERMS = f"(terms: {GLOSSARY})"
"""Said once by each report message that uses :data:`GLOSSARY_TERMS`."""

MASTER_COPY = "under 32-true the weights are the master copy"
"""Why there are no master weights (the end-of-fit summary says it too)."""


def why_empty(state: StateLayout, kind: TensorKind) -> str:
    """Why every unit's region of ``kind`` is empty in ``state``."""
    if kind is TensorKind.MASTER_WEIGHTS and not state.separate_master:
        return MASTER_COPY
    if kind is TensorKind.OPTIMIZER_STATES and not state.num_slots:
        return "your optimizer keeps no state per parameter (SGD without momentum, say)"
    return "no trainable parameters"


def kinds_without_bytes(regions: RegionPlacement, on_ssd: bool = False) -> dict[str, str]:
    """Each region kind that keeps no bytes where it is placed, with why: no unit has a region of it
    (``none: ...``: master weights under 32-true), or it is placed on SSD and nothing is ever written there
    (in the vertical order only a gradient's deferred part waits on its tier: with alpha 0, none).
    ``on_ssd``: only the kinds placed on SSD (some unit's), for the offload directories' breakdown."""
    out: dict[str, str] = {}
    written = regions.ssd_bytes()
    for kind in REGION_KINDS:
        if on_ssd and Tier.SSD not in regions.unit_tiers[kind]:
            continue
        if not any(regions.state.all_region_bytes(kind)):
            out[kind.value] = f"none: {why_empty(regions.state, kind)}"
        elif Tier.SSD in regions.unit_tiers[kind] and not written.get(kind.value):
            out[kind.value] = ("ssd, nothing written there: in the vertical order only a gradient's deferred "
                               "(alpha) part waits on its tier, and this run defers none")
    return out


TIER_WORDS = {Tier.SSD: "on SSD", Tier.HOST: "in RAM", Tier.DEVICE: "on the device"}


def frozen_note(regions: RegionPlacement) -> str | None:
    """What the start-of-run report says of the read-only parameters (frozen, or not in the optimizer: a
    LoRA base), where there are any: how many, the bytes of the weights they take (past each unit's trained
    prefix, :meth:`~lightning_greedysnake.layout.StateLayout.read_only_weight_bytes`) and the tiers those
    are on; they get no gradient, optimizer state or master weights, and a step never writes them."""
    state = regions.state
    names: dict[str, int] = {}
    for lay in state.units:  # (a frozen parameter several units lay out, a tied embedding: counted once)
        names.update((slot.name, slot.numel) for slot in lay.params if slot.group is None)
    if not names:
        return None
    where: Counter[Tier] = Counter()
    for u, tier in enumerate(regions.unit_tiers[TensorKind.WEIGHTS]):
        where[tier] += state.read_only_weight_bytes(u)
    total, trained = sum(names.values()), sum(lay.trainable_numel for lay in state.units)
    places = ", ".join(f"{human_bytes(n)} {TIER_WORDS.get(tier, tier.value)}"
                       for tier, n in sorted(where.items(), key=lambda kv: -kv[1]) if n)
    return (f"greedysnake: frozen (read-only) parameters: {total:,} of {total + trained:,} "
            f"({total / (total + trained):.1%}), in the weights: {places or '0 B'}; read with their unit, never "
            f"written back, no gradient, optimizer state or master weights kept for them")
