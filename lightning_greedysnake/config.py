"""The typed configuration tree. Pure Python: validated on construction, before any work starts."""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_greedysnake.kinds import REGION_KIND_NAMES
from lightning_greedysnake.schedule import ScheduleKind

MiB = 1 << 20


def _enum_value(enum_cls: type, setting: str, value: Any) -> Any:
    try:
        return enum_cls(value)
    except ValueError:
        choices = ", ".join(repr(e.value) for e in enum_cls)
        raise ValueError(f"{setting}={value!r} is not valid. Fix: use one of {choices}, or leave it unset "
                         "(None; null in Hydra) for the planner to choose.") from None


class Tier(str, enum.Enum):
    """Where a kind of tensor lives between uses."""

    DEVICE = "device"
    """The compute device's memory (the GPU, or host RAM when the CPU computes): resident, no transfers."""
    HOST = "host"
    """Host RAM, in flat per-unit buffers."""
    SSD = "ssd"
    """Files under the offload directory, read and written with O_DIRECT."""


@dataclass(frozen=True)
class Split:
    """A kind split between tiers by whole units in unit order: the first units, up to ``device`` of the
    kind's bytes (never more), on the device (compute weights only), the next up to ``host`` of them in
    RAM, the rest on SSD (the last tier with a share takes whatever rounding leaves). Written in a config
    as ``{host: 0.6, ssd: 0.4}`` or ``{device: 0.5, host: 0.2, ssd: 0.3}``. The math does not depend on
    where a unit lives: results are the same."""

    host: float
    ssd: float
    device: float = 0.0

    def __str__(self) -> str:
        device = f"device: {self.device:g}, " if self.device else ""
        return f"{{{device}host: {self.host:g}, ssd: {self.ssd:g}}}"


SPLIT_KINDS = REGION_KIND_NAMES
"""The kinds that can be split between host and SSD (each unit's region lives on one tier); of them only
``weights`` may have a device share (the optimizer's kinds live with the host optimizer)."""


def _integer(value: Any, low: int) -> bool:
    """``value`` is an integer (not a bool) of at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_flags(config: Any, prefix: str, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{prefix}{name}={getattr(config, name)!r} must be true or false.")


def _check_integer(config: Any, prefix: str, name: str, low: int, must: str, optional: bool = False) -> None:
    """``config.<name>`` is an integer of at least ``low`` (or ``None`` where ``optional``), else the error
    ``<prefix><name>=<value> must be <must>``."""
    value = getattr(config, name)
    if not (optional and value is None) and not _integer(value, low):
        raise ValueError(f"{prefix}{name}={value!r} must be {must}")


def _directory(value: Any, whole: Any) -> str:
    if isinstance(value, str) and value:
        return value
    if hasattr(value, "__fspath__"):
        return os.fspath(value)
    raise ValueError(
        f"offload.path={whole!r} must be a directory path, a list of them (one per SSD), or None for the "
        "default under the Trainer's default_root_dir. Fix: e.g. offload.path='/mnt/nvme/greedysnake'."
    )


def _placement(setting: str, value: Any) -> Tier | Split:
    """A kind's placement from a tier name or a ``{host: f, ssd: g}`` mapping (shares summing to 1; for
    ``weights`` also a ``device`` share)."""
    if not isinstance(value, (Mapping, Split)):
        return _enum_value(Tier, setting, value)
    name = setting.split(".")[-1]
    fix = f"Fix: e.g. {setting}={{host: 0.6, ssd: 0.4}} (shares of the kind's bytes, summing to 1)."
    if name not in SPLIT_KINDS:
        raise ValueError(f"{setting}={value!r}: only {', '.join(SPLIT_KINDS)} can be split. Fix: one tier.")
    tiers = {"device", "host", "ssd"} if name == "weights" else {"host", "ssd"}
    if isinstance(value, Split):
        shares = {"host": value.host, "ssd": value.ssd, **({"device": value.device} if value.device else {})}
    else:
        shares = {str(getattr(k, "value", k)): v for k, v in value.items()}
    if not set(shares) <= tiers or (name != "weights" and shares.get("device")):
        where = ("'device', 'host' and 'ssd'" if name == "weights" else
                 "'host' and 'ssd' (only weights may have a device share)")
        raise ValueError(f"{setting}={dict(shares)!r} may only split between {where}. {fix}")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1 for v in shares.values()):
        raise ValueError(f"{setting}={dict(shares)!r}: every share must be a number in [0, 1]. {fix}")
    device, host, ssd = (float(shares.get(t, 0.0)) for t in ("device", "host", "ssd"))
    if abs(device + host + ssd - 1.0) > 1e-6:
        raise ValueError(f"{setting}={dict(shares)!r}: the shares sum to {device + host + ssd:g}, not 1. {fix}")
    for tier, share in ((Tier.DEVICE, device), (Tier.HOST, host), (Tier.SSD, ssd)):
        if share >= 1.0 - 1e-9:
            return tier
    return Split(host, ssd, device)


STATE_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
"""Accepted spellings of ``offload.optimizer_state_dtype`` -> the canonical name."""


def _state_dtype(value: Any) -> str:
    name = str(value).removeprefix("torch.") if value is not None else ""
    if name not in STATE_DTYPES:
        raise ValueError(
            f"offload.optimizer_state_dtype={value!r} is not supported. Fix: use 'float32' (exact) or 'bfloat16' "
            "(half the optimizer-state bytes, not bit-identical)."
        )
    return STATE_DTYPES[name]


class TensorKind(str, enum.Enum):
    WEIGHTS = "weights"
    """Compute weights (16-bit under bf16-mixed; under 32-true they are also the master copy)."""
    MASTER_WEIGHTS = "master_weights"
    """fp32 master weights under bf16-mixed (under 32-true the compute weights are the master copy)."""
    OPTIMIZER_STATES = "optimizer_states"
    """The optimizer's per-parameter state (Adam's two moments, SGD's momentum): fp32, or bf16 with
    ``offload.optimizer_state_dtype=bfloat16``."""
    GRADIENTS = "gradients"
    """fp32 accumulated gradients that must wait (the horizontal order, or norm clipping)."""
    ACTIVATIONS = "activations"
    """Each unit's input per micro-batch, kept for the recomputing backward."""


REGION_KINDS = tuple(TensorKind(name) for name in REGION_KIND_NAMES)
"""The kinds kept in per-unit regions (:data:`~lightning_greedysnake.kinds.REGION_KIND_NAMES`)."""


FIXED_PLACEMENT = {**dict.fromkeys(REGION_KINDS, Tier.SSD), TensorKind.ACTIVATIONS: Tier.HOST}
"""Where an unset kind goes with ``auto=False``: ZeRO-Infinity's placement."""


@dataclass(frozen=True)
class OffloadConfig:
    """Where each kind of tensor lives, and the tensor manager's resources (Hydra group
    ``strategy.offload``). The default is ZeRO-Infinity's placement: weights, master weights, optimizer
    states and waiting gradients on SSD, saved activations in host memory."""

    path: str | list[str] | None = None
    """The offload directory (a local NVMe SSD), or a list of them, one per SSD: each kind's SSD units
    are then striped over them (unit by unit, round robin), each directory with its own preflight, lock,
    I/O threads (``io_threads`` each) and cleanup. ``None``: ``<Trainer default_root_dir>/greedysnake_offload``.
    With several processes each rank uses ``<path>/rank_<global rank>``, or, when the path contains
    ``{rank}`` (or ``{local_rank}``), the path with it filled in (``/mnt/nvme{local_rank}/gs``: one SSD
    per process). A path given is checked (and locked) even where the placement puts nothing there, and
    the start-of-run report says why nothing went there."""

    weights: Tier | Split | None = None
    """Where the compute weights live (16-bit under bf16-mixed; under 32-true also the master copy):
    ``device``, ``host`` or ``ssd``, or split by whole units, ``{host: 0.6, ssd: 0.4}`` (the first units up
    to that share of the kind's bytes in RAM, see :class:`Split`); on a GPU also a device share,
    ``{device: 0.5, host: 0.2, ssd: 0.3}`` (resident there beside the host optimizer). ``None`` (unset):
    the planner places it at setup (``auto=True``; on a GPU the compute weights first on the device, see
    :mod:`lightning_greedysnake.planner.placement`), or ``ssd`` with ``auto=False``."""
    master_weights: Tier | Split | None = None
    """Where the fp32 master weights live (bf16-mixed and 16-mixed only): ``host`` or ``ssd``, or split
    between them by whole units. ``None`` (unset): planned at setup (``auto=True``), or ``ssd`` with
    ``auto=False``."""
    optimizer_states: Tier | Split | None = None
    """Where the optimizer's per-parameter state lives (Adam's moments, SGD's momentum): ``host`` or
    ``ssd``, or split between them by whole units. ``None`` (unset): planned at setup (``auto=True``), or
    ``ssd`` with ``auto=False``."""
    gradients: Tier | Split | None = None
    """Where fp32 gradients that must wait live (the horizontal order's partial sums, the deferred
    ``alpha`` range, everything under norm clipping): ``host`` or ``ssd``, or split between them by whole
    units. ``None`` (unset): planned at setup (``auto=True``), or ``ssd`` with ``auto=False``."""
    activations: Tier | None = None
    """Where the saved activations live: each unit's input per micro-batch, kept from its forward for
    the recomputing backward (``host``, ``ssd`` or ``device``; the setting was called ``checkpoints``); with
    ``recompute=False`` and ``ssd``, the kept graphs' saved tensors (written in the forward, read back for the
    unit's backward).
    ``None`` (unset): with ``auto=True`` decided at the first save (``host`` while a window's activations
    fit 1/8 of the host budget, else ``ssd``); with ``auto=False`` ``host``."""

    optimizer_state_dtype: str = "float32"
    """The dtype the optimizer's per-element state is kept in between steps (on its tier and on the way
    there). ``float32``: exactly what your optimizer keeps (bit-identical to Lightning). ``bfloat16``
    (opt-in): half the state bytes on SSD, in RAM and through the I/O engine; each step widens the
    unit's state to fp32, runs your optimizer on it, and narrows it back with stochastic rounding (so
    Adam's second moment keeps decaying where round-to-nearest would freeze it). Not bit-identical to
    fp32 state: a lossy format, like an 8-bit optimizer. Checkpoints hold it as fp32 (loadable by any
    strategy); resuming narrows it again."""

    buffer_budget_bytes: int | None = None
    """Host bytes the tensor manager may hold in staging buffers (weights being used or prefetched, the
    optimizer's working set, saved activations in flight). ``None``: the least that works for ``lag`` (the
    training thread's unit and ``lag`` queued steps hold weights and gradient, the running step its
    master and state), plus room to prefetch the next unit's weights, plus 16 MiB; with ``auto=False`` also a
    second optimizer working set (the largest unit's step), so that the next step's reads overlap the current
    one's compute and writes (:mod:`~lightning_greedysnake.planner.staging`). With ``auto=True`` the warm-step
    plan chooses it."""

    prefetch_units: int = 1
    """How many units ahead the engine asks for weights while the current unit computes (read from SSD
    into staging within the budget's slack and, on a GPU, copied to the device on the H2D stream). More
    than 1 hides a slow unit behind faster ones; each costs one unit's weights of staging (raise
    ``buffer_budget_bytes``) and of device memory."""

    io_threads: int = 4
    """Threads issuing O_DIRECT reads and writes."""

    optimizer_threads: int | None = None
    """Intra-op threads of the host optimizer step (the optimizer lane's kernels). ``None``: planned from
    the machine (:func:`lightning_greedysnake.planner.threads.optimizer_threads`): 1 when the model
    computes on the CPU (its kernels use every core already), and with a GPU the cores of this process's
    share that the training thread and the I/O threads do not need. The planners measure the
    optimizer's rate at the count the lane gets."""

    io_chunk_bytes: int = 16 * MiB
    """Largest single read or write; large requests keep the SSD busy with few Python wake-ups."""

    direct_io: bool = True
    """Bypass the page cache (O_DIRECT), so weights really come from the SSD every step."""

    keep_files: bool = False
    """Leave the offload files in place at the end of the run (or after a crash), for inspection, with the
    lock file (``.greedysnake.lock``) beside them naming them and the run. Another run in the same directory
    refuses to start while they are there (it would overwrite them); the same Trainer's later validate or
    test uses them as its own."""

    return_weights: bool = True
    """At the end of fit/validate/test (or after an error the caller catches), copy the final weights
    back into the module's parameters and the optimizer's state into the user's optimizer, so the
    LightningModule is usable and ``trainer.save_checkpoint`` after ``fit`` is complete, as with any
    strategy. Turn off for models larger than host RAM (use a checkpoint or the export instead): the
    module then refuses to run or be saved, naming the fix, until weights are loaded into it."""

    def __post_init__(self) -> None:
        for kind in TensorKind:
            if getattr(self, kind.value) is not None:
                object.__setattr__(self, kind.value, _placement(f"offload.{kind.value}", getattr(self, kind.value)))
        object.__setattr__(self, "optimizer_state_dtype", _state_dtype(self.optimizer_state_dtype))
        if self.optimizer_state_dtype != "float32" and not self.uses_tensor_manager:
            raise ValueError(
                f"offload.optimizer_state_dtype={self.optimizer_state_dtype!r} needs the tensor manager, but every "
                "kind is on 'device', where Lightning steps your optimizer itself with its own state. Fix: put "
                "optimizer_states on 'host' or 'ssd', or leave optimizer_state_dtype='float32'."
            )
        if self.path is not None:
            several = isinstance(self.path, (list, tuple)) or (
                not isinstance(self.path, str) and not hasattr(self.path, "__fspath__")
                and hasattr(self.path, "__iter__"))
            paths = [_directory(p, self.path) for p in self.path] if several else [_directory(self.path, self.path)]
            if not paths or len(set(paths)) != len(paths):
                raise ValueError(
                    f"offload.path={self.path!r} must name one directory or several different ones. Fix: e.g. "
                    "offload.path=['/mnt/nvme0/gs', '/mnt/nvme1/gs']."
                )
            object.__setattr__(self, "path", paths if several else paths[0])
        if self.optimizer_states is Tier.DEVICE and self.uses_tensor_manager:
            raise ValueError(
                "offload.optimizer_states='device' needs every other kind on 'device' too (then Lightning "
                "steps your optimizer itself). Fix: use 'host' or 'ssd'."
            )
        for name in ("master_weights", "gradients"):
            if getattr(self, name) is Tier.DEVICE and self.uses_tensor_manager:
                raise ValueError(
                    f"offload.{name}='device' is only supported with every kind on 'device'. Fix: use 'host' "
                    "or 'ssd'."
                )
        _check_integer(self, "offload.", "buffer_budget_bytes", 1, "a positive number of bytes or None "
                       "(automatic). Fix: e.g. buffer_budget_bytes=2147483648 (2 GiB).", optional=True)
        _check_integer(self, "offload.", "prefetch_units", 0, "a non-negative integer (units whose weights are "
                       "brought in ahead of use; 0: none). Fix: e.g. prefetch_units=1.")
        _check_integer(self, "offload.", "io_threads", 1, ">= 1. Fix: e.g. io_threads=4.")
        _check_integer(self, "offload.", "optimizer_threads", 1, "a positive integer (intra-op threads of the host "
                       "optimizer step) or None (planned from the machine). Fix: e.g. optimizer_threads=4.",
                       optional=True)
        if not _integer(self.io_chunk_bytes, 4096) or self.io_chunk_bytes % 4096:
            raise ValueError(
                f"offload.io_chunk_bytes={self.io_chunk_bytes!r} must be a positive multiple of 4096. Fix: e.g. "
                "io_chunk_bytes=16777216 (16 MiB)."
            )
        _check_flags(self, "offload.", ("direct_io", "keep_files", "return_weights"))

    @property
    def paths(self) -> list[str] | None:
        """The offload directories as a list (None: the default one)."""
        if self.path is None:
            return None
        return list(self.path) if isinstance(self.path, list) else [self.path]

    def tier(self, kind: TensorKind) -> Tier | Split:
        """``kind``'s placement (an unset one: its fixed default, :data:`FIXED_PLACEMENT`)."""
        value = getattr(self, kind.value)
        return FIXED_PLACEMENT[kind] if value is None else value

    def unset(self) -> frozenset[TensorKind]:
        """The kinds whose placement was not given (the planner's to choose)."""
        return frozenset(kind for kind in TensorKind if getattr(self, kind.value) is None)

    def placed(self, placement: Mapping[TensorKind, Tier | Split] | None = None) -> OffloadConfig:
        """This config with every unset kind placed: as ``placement`` says, else at its fixed default."""
        values = {kind.value: (placement or {}).get(kind, self.tier(kind)) for kind in self.unset()}
        return dataclasses.replace(self, **values) if values else self

    @property
    def uses_tensor_manager(self) -> bool:
        """False when everything stays on the device: then Lightning steps the user's optimizer itself."""
        return any(self.tier(kind) is not Tier.DEVICE for kind in TensorKind)

    @property
    def uses_ssd(self) -> bool:
        return any(self.tier(kind) is Tier.SSD or (isinstance(t := self.tier(kind), Split) and t.ssd > 0)
                   for kind in TensorKind)

    @classmethod
    def everywhere(cls, tier: Tier | str, **overrides: Any) -> OffloadConfig:
        values: dict[str, Any] = {kind.value: tier for kind in TensorKind}
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_value(cls, value: OffloadConfig | Mapping[str, Any] | None) -> OffloadConfig:
        if value is None:
            return cls()
        if isinstance(value, OffloadConfig):
            return value
        if isinstance(value, Mapping):
            if "checkpoints" in value:  # (the old name of the saved activations' placement)
                raise ValueError(
                    f"offload.checkpoints={value['checkpoints']!r}: the setting is now offload.activations (where "
                    "the saved activations live; 'checkpoint' names only training checkpoints). Fix: "
                    f"offload.activations={value['checkpoints']!r}, or strategy.offload.activations=... with Hydra.")
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"unknown offload setting(s) {unknown}. Known settings: {sorted(known)}.")
            return cls(**dict(value))
        raise ValueError(f"offload={value!r} must be an OffloadConfig, a mapping of its fields, or None.")


FIXED_DEFAULTS: dict[str, Any] = {"alpha": 0.25, "lag": 2, "recompute": True, "layers_per_unit": 1,
                                  "schedule": ScheduleKind.VERTICAL}
"""What unset ``alpha``, ``lag`` and ``recompute`` are until (with ``auto=True``) the warm-step plan, and
unset ``layers_per_unit`` and ``schedule`` until (with ``auto=True``) setup plans them; with ``auto=False``,
for the run."""


OPTIMIZER_PATHS = ("auto", "element_wise", "whole_parameter")
"""``GreedySnakeConfig.optimizer_path``'s values."""


@dataclass(frozen=True)
class GreedySnakeConfig:
    """Settings of the greedysnake strategy (Hydra group ``strategy``)."""

    schedule: ScheduleKind | None = None
    """``vertical``: all micro-batches of a window through unit j before unit j+1, in snake order (the
    GreedySnake order: each unit's weights are brought in once a window, not once a micro-batch, and its
    gradient leaves once); ``horizontal``: each micro-batch through all units (Lightning's and
    ZeRO-Infinity's order). ``None`` (unset): vertical, and with ``auto=True`` setup chooses horizontal
    where the model computes on the host and the placement keeps every kind wholly in host memory: then
    nothing moves per micro-batch for the vertical order to save, and it would hold all K micro-batches'
    activations (or recompute them) where the horizontal order holds one's, as Lightning does."""

    layers_per_unit: int | None = None
    """Blocks per unit. A unit is what is loaded, checkpointed and recomputed as one piece: only each
    unit's input is kept per micro-batch, so larger units keep fewer saved activations, make larger SSD
    requests and stage more host memory. ``None`` (unset): 1, and with ``auto=True`` chosen at setup
    among 1, 2, 4 and 8 from the offload disks' bandwidth at each size's requests, each size's
    placement within the host budget and the optimizer's rate (printed as a table)."""

    recompute: bool | None = None
    """Backward recomputes each unit from its checkpointed input (RNG restored so dropout masks match).
    ``False`` keeps every unit's autograd graph (its activations, for all K micro-batches) from the
    forward until the unit's backward instead: no recompute, about a quarter less compute, and K times
    one model's activations in memory. The weights still leave memory between uses (views of them that
    autograd saves are kept as references). With ``offload.activations=ssd`` the graphs' saved tensors
    go to SSD between the forward and the backward (a blob per unit and micro-batch, read back one op ahead,
    in their own layout: exact), and only each unit's input stays in memory. ``None`` (unset): ``True``, and
    with ``auto=True`` the warm-step plan keeps the graphs where that is faster and fits the host budget (in
    memory, or on SSD where the saved activations went there)."""

    layered_module: str | None = None
    """Dotted name of the submodule that is the layered model (``""`` for the LightningModule itself).
    ``None``: find it (the one outermost GPT, LayeredModel or nn.Sequential)."""

    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Placement of each kind of tensor and the tensor manager's resources."""

    alpha: float | None = None
    """Fraction of each unit's optimizer update (by elements) deferred into the next iteration's
    forward, where the SSD and CPU have slack; a unit's forward waits for its own update, so no weight
    is ever stale. 0: everything is stepped during backward. (With a tensor manager only.) ``None``
    (unset): 0.25 for the first two steps, then planned with ``auto=True``."""

    lag: int | None = None
    """How many units the background optimizer may trail the backward by (it steps unit j+lag while
    unit j computes); bounds the gradients held for it. 0: each unit is stepped synchronously.
    ``None`` (unset): 2 for the first two steps, then planned with ``auto=True``."""

    shard_state: bool = True
    """With several processes: each rank keeps current and steps only its 1/N chunk of every unit's
    master weights and optimizer state, and the updated compute weights are all-gathered per unit
    (ZeRO's partitioning). ``False``: every rank steps the whole model, as DDP does."""

    auto: bool = True
    """Plan every setting left unset (``None``) from this machine and this run; what you set is kept.
    At setup: ``layers_per_unit`` and each unset kind's placement (weights, master weights, optimizer state, gradients,
    fractionally by units) within the host budget, in order of the SSD bytes a step saves per byte of
    RAM, printed with the SSD traffic it leaves. After the second optimizer step (the first warm one): measure the offload
    disks (each path) and the optimizer, take each unit's compute time from that step, and apply the
    planner's alpha, lag, staging budget and recompute (printed as a table with the predicted step time
    and the binding resource). ``False``: every unset setting takes its fixed default (ZeRO-Infinity's
    placement, alpha 0.25, lag 2, recompute, the minimum staging budget). Unset ``offload.activations``
    is decided at the first save (RAM while a window's saved activations fit their share of the host budget,
    else SSD). Unset ``layers_per_unit`` is chosen at setup (see its field)."""

    auto_host_budget_bytes: int | None = None
    """Host memory the planner may use, per process, for the tensor manager: the kinds it keeps in RAM,
    its staging buffers and the saved activations in host memory. ``None``: half of the memory
    available (``MemAvailable``) at setup, shared by the processes on the node."""

    auto_device_budget_bytes: int | None = None
    """On a GPU, device memory the planner may count on, per process: where the model's whole training
    state (weights, gradients, optimizer state) fits in half of it and no kind's placement is given,
    every kind stays on the device and nothing is offloaded (:mod:`~lightning_greedysnake.strategy.
    planning.device`). ``None``: the GPU's free memory at setup. ``0``: always plan the offload."""

    on_nonfinite: str = "warn"
    """A micro-batch's loss or a unit's gradient that is not finite (NaN or inf): ``"warn"`` names the
    first one (step, micro-batch or unit) in a warning and trains on, as Lightning would; ``"raise"``
    stops the run with that error; ``"skip"`` drops a window whose loss is not finite (no unit is
    stepped; Lightning still counts the step and steps its LR schedulers) and warns."""

    optimizer_path: str = "auto"
    """How the optimizer steps each unit (:mod:`~lightning_greedysnake.optim.contract`). ``"auto"``: by what
    the optimizer is: the element-wise ones ``torch.optim`` and torchao ship (Adam, AdamW, SGD, ...) on
    flat slices cut at any element, the rest (Adafactor, Muon, your own) on whole parameters in their
    own shapes where a probe on this run's parameter shapes shows no coupling between parameters, else
    refused before training. ``"element_wise"`` / ``"whole_parameter"``: force one path (to compare
    them, say); forcing element-wise on an optimizer outside the list warns, since it is exact only for
    math that treats every element alone."""

    trace_steps: int = 0
    """Write a Chrome trace (open it in Perfetto) of the compute, SSD and optimizer lanes of the first
    ``trace_steps`` optimizer steps. 0: no trace."""

    trace_path: str | None = None
    """Where the trace goes; ``None``: ``<Trainer default_root_dir>/greedysnake_trace.json``."""

    def unset(self) -> frozenset[str]:
        """The settings left to the planner (``None``): names as in a config, ``offload.weights``."""
        mine = {name for name in FIXED_DEFAULTS if getattr(self, name) is None}
        mine |= {f"offload.{kind.value}" for kind in self.offload.unset()}
        if self.offload.buffer_budget_bytes is None:
            mine.add("offload.buffer_budget_bytes")
        return frozenset(mine)

    def resolved(self, placement: Mapping[TensorKind, Tier | Split] | None = None) -> RunConfig:
        """The run's configuration from these settings: unset kinds placed by ``placement`` (else their
        fixed default), unset alpha, lag and recompute at their fixed defaults (the first steps'; the plan
        may change them). A run's configuration resolves to itself."""
        if isinstance(self, RunConfig):
            return self
        values: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update({name: v for name, v in FIXED_DEFAULTS.items() if getattr(self, name) is None})
        return RunConfig(**{**values, "offload": self.offload.placed(placement)})

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload", OffloadConfig.from_value(self.offload))
        _check_integer(self, "", "trace_steps", 0, "a non-negative integer (optimizer steps to trace). "
                       "Fix: e.g. trace_steps=3, or 0 for no trace.")
        if self.schedule is not None:
            object.__setattr__(self, "schedule", _enum_value(ScheduleKind, "schedule", self.schedule))
        if self.layers_per_unit is not None and not _integer(self.layers_per_unit, 1):
            integer = isinstance(self.layers_per_unit, int) and not isinstance(self.layers_per_unit, bool)
            raise ValueError(f"layers_per_unit={self.layers_per_unit!r} must be "
                             f"{'>= 1' if integer else 'a positive integer'} (blocks per unit). Fix: e.g. layers_per_unit=1.")
        if self.alpha is not None and (
                isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 <= self.alpha <= 1.0):
            raise ValueError(
                f"alpha={self.alpha!r} must be a fraction in [0, 1] (the share of each unit's update deferred "
                "into the next forward). Fix: e.g. alpha=0.25, or alpha=0 to step everything during backward."
            )
        object.__setattr__(self, "alpha", None if self.alpha is None else float(self.alpha))
        _check_integer(self, "", "lag", 0, "a non-negative integer (units the background optimizer may trail "
                       "backward by). Fix: e.g. lag=2, or lag=0 for synchronous steps.", optional=True)
        if self.optimizer_path not in OPTIMIZER_PATHS:
            raise ValueError(
                f"optimizer_path={self.optimizer_path!r} is not valid. Fix: use one of "
                f"{', '.join(repr(p) for p in OPTIMIZER_PATHS)} ('auto' decides by the optimizer)."
            )
        if self.on_nonfinite not in ("warn", "raise", "skip"):
            raise ValueError(
                f"on_nonfinite={self.on_nonfinite!r} is not valid. Fix: use one of 'warn', 'raise', 'skip'."
            )
        _check_flags(self, "", ("auto", "shard_state"))
        _check_integer(self, "", "auto_host_budget_bytes", 1, "a positive number of bytes or None (half of the "
                       "available memory). Fix: e.g. auto_host_budget_bytes=8589934592 (8 GiB).", optional=True)
        _check_integer(self, "", "auto_device_budget_bytes", 0, "a number of bytes (0: always offload) or None "
                       "(the GPU's free memory). Fix: e.g. auto_device_budget_bytes=68719476736 (64 GiB).",
                       optional=True)
        if self.recompute is not None and not isinstance(self.recompute, bool):
            raise ValueError(f"recompute={self.recompute!r} must be true or false.")
        if self.layered_module is not None and not isinstance(self.layered_module, str):
            raise ValueError(
                f"layered_module={self.layered_module!r} must be a dotted submodule name such as 'model', "
                "or None to let greedysnake find it."
            )

    @classmethod
    def from_kwargs(cls, base: GreedySnakeConfig | None = None, **overrides: Any) -> GreedySnakeConfig:
        """``base`` with ``overrides`` applied; unknown names are an error that lists the known ones.

        ``offload_dir=...`` is shorthand for ``offload={"path": ...}``; ``offload`` given as a mapping
        updates the base's offload settings field by field."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known - {"offload_dir"})
        if unknown:
            raise ValueError(
                f"unknown greedysnake setting(s) {unknown}. Known settings: {sorted(known | {'offload_dir'})}."
            )
        values: dict[str, Any] = {f.name: getattr(base, f.name) for f in dataclasses.fields(cls)} if base else {}
        offload: dict[str, Any] = dict(vars(values["offload"])) if "offload" in values else {}
        new_offload = overrides.pop("offload", None)
        if isinstance(new_offload, OffloadConfig):
            offload = dict(vars(new_offload))
        elif new_offload is not None:
            offload.update(dict(new_offload))
        if "offload_dir" in overrides:
            offload_dir = overrides.pop("offload_dir")
            if isinstance(new_offload, OffloadConfig) and new_offload.path is not None or (
                    isinstance(new_offload, Mapping) and new_offload.get("path") is not None):
                given = new_offload.path if isinstance(new_offload, OffloadConfig) else new_offload["path"]
                raise ValueError(
                    f"offload_dir={offload_dir!r} and offload.path={given!r} both set the offload directory. "
                    "Fix: give one of them (offload_dir is shorthand for offload.path)."
                )
            # one per SSD: any sequence but a string (a list, a tuple, Hydra's ListConfig), as offload.path
            several = isinstance(offload_dir, Sequence) and not isinstance(offload_dir, str)
            dirs = list(offload_dir) if several else [offload_dir]
            if offload_dir is not None and not all(isinstance(d, (str, os.PathLike)) for d in dirs):
                raise ValueError(
                    f"offload_dir={offload_dir!r} is not a directory path or a list of them. Fix: pass a string "
                    "or pathlib.Path, e.g. offload_dir='/mnt/nvme/greedysnake', or one per SSD, e.g. "
                    "offload_dir=['/mnt/nvme0/gs', '/mnt/nvme1/gs']."
                )
            offload["path"] = None if offload_dir is None else [os.fspath(d) for d in dirs] if several else os.fspath(
                offload_dir)  # (OffloadConfig checks them: several must differ)
        values.update(overrides)
        values["offload"] = OffloadConfig.from_value(offload)
        return cls(**values)


@dataclass(frozen=True)
class RunConfig(GreedySnakeConfig):
    """The configuration one run uses: the settings with every value in effect, none left to the planner
    (the staging budget aside: its ``None`` is the automatic budget). Built by
    :meth:`GreedySnakeConfig.resolved` (the planner's, and the strategy's before setup) and by the plans'
    ``dataclasses.replace`` of one, each checked here; what runs (the engine, the tensor manager) takes
    this type, never the user's settings."""

    def __post_init__(self) -> None:
        super().__post_init__()
        unset = self.unset() - {"offload.buffer_budget_bytes"}
        if unset:
            raise ValueError(f"a run's configuration has every value in effect, not {sorted(unset)} unset: build it "
                             "with GreedySnakeConfig.resolved")
