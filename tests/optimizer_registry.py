"""pytorch-optimizer's registry (``pytorch_optimizer.get_supported_optimizers()``) against the optimizer
contract, as a user brings it: each optimizer in ``configure_optimizers`` of a small MLP (two param groups,
K=4, 32-true, four steps), trained under ``strategy="auto"`` and under greedysnake, with every kind on SSD
and with the planned defaults. Each must be exact (weights and every window's gradient to 1e-5) or refused
before any step with :class:`~lightning_greedysnake.optim.unit_optimizer.UnsupportedOptimizerError`; an
optimizer that does not train under ``strategy="auto"`` either (it needs a second backward, or arguments
no default gives) is listed as such.

Shared by ``tests/integration/test_optimizer_registry.py`` (a fixed sample covering every path) and
``benchmarks/optimizer_audit.py`` (the whole registry, whose committed result feeds the docs' table).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig
from lightning_greedysnake.optim.unit_optimizer import UnsupportedOptimizerError
from tests.helpers import Grads, make_trainer, max_abs_diff, regression_loader

K = 4
NUM_BATCHES = 8  # two windows an epoch, two epochs: four steps
LR = 1e-2
ATOL = 1e-5
ROUNDING_FACTOR = 2.0
"""A path whose first window's gradients agree to 1e-6 and whose weights land within this many times the
distance ``strategy="auto"`` moves from itself when each window is summed in reverse order is exact up to
this optimizer's own sensitivity to rounding (a sign-based or orthogonalizing update turns a last-bit
gradient difference into an lr-sized step)."""

PATHS: dict[str, Callable[[], Any]] = {
    "ssd": lambda: GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("ssd")),
    "planned": lambda: GreedySnakeStrategy(),
}
"""Every kind on SSD (the vertical order, alpha 0.25, a background lane), and the planned defaults."""


def _muon_groups(cls: type, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """pytorch-optimizer's Muon family takes groups that say which parameters are orthogonalized."""
    return cls([{"params": [p for p in params if p.dim() == 2], "use_muon": True, "lr": LR},
                {"params": [p for p in params if p.dim() != 2], "use_muon": False, "lr": LR}])


RECIPES: dict[str, Callable[[type, Any], torch.optim.Optimizer]] = {
    "muon": _muon_groups,
    "adamuon": _muon_groups,
    "normuon": _muon_groups,
    "muonclip": _muon_groups,
    "distributedmuon": _muon_groups,
    "adago": _muon_groups,
    "bsam": lambda cls, params: cls(params, num_data=NUM_BATCHES * 4, lr=LR),
    "ranger21": lambda cls, params: cls(params, num_iterations=4, lr=LR),
    "lbfgs": lambda cls, params: cls(params, lr=LR),  # (one param group only)
    "transformers.optimization.Adafactor": lambda cls, params: cls(params, lr=LR, relative_step=False,
                                                                    scale_parameter=False),
}
"""Constructions for the registry's classes whose constructor needs more than the parameters and a
learning rate (what their users pass)."""

MODULE_RECIPES: dict[str, Callable[[type, nn.Module], torch.optim.Optimizer]] = {
    "adammini": lambda cls, module: cls(module, lr=LR),
}
"""Classes built over the model itself (Adam-mini partitions it by parameter names)."""


LIBRARIES = ("torch_optimizer", "lion_pytorch", "came_pytorch", "schedulefree", "transformers.optimization")
"""Other libraries users bring their optimizers from: every optimizer class each exports is audited too."""


def library_classes(library: str) -> list[str]:
    """The qualified names of the optimizer classes ``library`` exports (empty where it is not installed)."""
    try:
        module = importlib.import_module(library)
    except ImportError:
        return []
    return sorted(f"{library}.{n}" for n, c in vars(module).items()
                  if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer)
                  and c.__module__.startswith(library.partition(".")[0]))


def optimizer_class(name: str) -> type:
    """A registry name (``lamb``) or a qualified class name (``torch_optimizer.Lamb``)."""
    if "." in name:
        library, _, cls = name.rpartition(".")
        return getattr(importlib.import_module(library), cls)
    import pytorch_optimizer

    return pytorch_optimizer.load_optimizer(name)


def make_optimizer(name: str, module: nn.Module) -> torch.optim.Optimizer:
    cls = optimizer_class(name)
    if name in MODULE_RECIPES:
        return MODULE_RECIPES[name](cls, module)
    params = list(module.parameters())
    recipe = RECIPES.get(name)
    if recipe is not None:
        return recipe(cls, params)
    matrices = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": matrices}, {"params": rest}]  # two groups: both honoured
    try:
        return cls(groups, lr=LR)
    except TypeError:
        return cls(groups)


class MLP(L.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.net = nn.Sequential(nn.Linear(6, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 96),
                                 nn.LayerNorm(96), nn.Linear(96, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return make_optimizer(self.name, self)

    def on_train_start(self) -> None:
        optimizer = self.optimizers().optimizer
        if callable(getattr(optimizer, "train", None)):
            optimizer.train()  # (Schedule-Free's train mode, as its users set it)


@dataclass
class Fit:
    params: dict[str, torch.Tensor]
    grads: list[dict[str, torch.Tensor]]
    steps: int
    start: dict[str, torch.Tensor]
    path: str | None = None
    """The contract's path (greedysnake's runs)."""


def fit(strategy: Any, name: str, reversed_windows: bool = False) -> Fit:
    """``reversed_windows``: each window's micro-batches in reverse order (the same gradients, summed in
    another order: what the vertical order's snake does in every other unit)."""
    L.seed_everything(0, verbose=False)
    module = MLP(name)
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    grads = Grads()
    trainer = make_trainer(strategy, K, callbacks=[grads, _path := _ContractPath()])
    batches = list(regression_loader(NUM_BATCHES))
    if reversed_windows:
        batches = [b for w in range(0, len(batches), K) for b in reversed(batches[w : w + K])]
    trainer.fit(module, DataLoader(batches, batch_size=None))
    return Fit({n: p.detach().clone() for n, p in module.named_parameters()}, grads.grads, trainer.global_step,
               start, _path.path)


class _ContractPath(L.Callback):
    """The contract's path of a greedysnake run, read while it trains (its tensor manager closes with fit)."""

    path: str | None = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        manager = getattr(trainer.strategy, "tensor_manager", None)
        self.path = manager.contract.path.value if manager is not None else None


@dataclass
class Row:
    """One optimizer's outcome: ``auto`` is None where it trains under ``strategy="auto"`` (else why not);
    per greedysnake path, ``exact``, ``exact to rounding`` (:data:`ROUNDING_FACTOR`), ``refused``, or what is
    never allowed: ``different`` (silently) or ``error`` (a raw error inside the fit)."""

    name: str
    cls: str = ""
    auto: str | None = None
    moved: float = 0.0
    """How far ``strategy="auto"`` moved the weights (a comparison to 1e-5 means something only if far)."""
    rounding: float | None = None
    """Where a path is not within 1e-5: how far ``strategy="auto"`` itself lands with each window's
    micro-batches summed in reverse order (the vertical order's snake sums every other unit so)."""
    outcomes: dict[str, str] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    """Per path: the contract's path where exact, the refusal's message, or the differences."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def reason_of(message: str) -> str:
    """A refusal's reason, in one word, for the table."""
    for words, reason in (("couples parameters", "coupled"), ("closure", "closure"), ("random numbers", "random"),
                          ("train/eval modes", "modes"),
                          ("keeps state", "state kind"),
                          ("changes its attribute", "state kind"), ("sparse", "sparse")):
        if words in message:
            return reason
    return "cannot step"


def audit(name: str, paths: tuple[str, ...] = tuple(PATHS)) -> Row:
    """``name`` trained under ``strategy="auto"``, then under greedysnake on each of ``paths``."""
    row = Row(name, optimizer_class(name).__name__)
    try:
        ref = fit("auto", name)
        if ref.steps != 4:
            raise RuntimeError(f"{ref.steps} optimizer steps, not 4")
    except Exception as e:  # noqa: BLE001 - the optimizer does not train here at all: listed with why
        row.auto = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        return row
    row.moved = max_abs_diff(ref.params, ref.start)
    for path in paths:
        try:
            got = fit(PATHS[path](), name)
        except UnsupportedOptimizerError as e:
            if "Fix:" not in str(e):
                row.outcomes[path], row.details[path] = "different", f"refused without a fix: {e}"
            else:
                row.outcomes[path], row.details[path] = "refused", str(e)
            continue
        except Exception as e:  # noqa: BLE001 - a raw error from inside the run: never allowed
            row.outcomes[path], row.details[path] = "error", f"{type(e).__name__}: {e}".splitlines()[0][:300]
            continue
        weights = max_abs_diff(got.params, ref.params)
        windows = [max_abs_diff(g, {n: v for n, v in r.items() if n in g}) for g, r in zip(got.grads, ref.grads)]
        exact = got.steps == ref.steps and len(windows) == len(ref.grads) and weights <= ATOL and max(windows) <= ATOL
        if not exact and got.steps == ref.steps and windows and windows[0] <= 1e-6:
            # the first window's gradients agree: is the rest what summing in another order does to this optimizer?
            if row.rounding is None:
                row.rounding = max_abs_diff(fit("auto", name, reversed_windows=True).params, ref.params)
            if weights <= max(ATOL, ROUNDING_FACTOR * row.rounding):
                row.outcomes[path] = "exact to rounding"
                row.details[path] = (f"{got.path}: weights {weights:.2e} from auto, which lands {row.rounding:.2e} "
                                     "from itself with each window summed in reverse order")
                continue
        row.outcomes[path] = "exact" if exact else "different"
        row.details[path] = (got.path or "") if exact else (
            f"steps {got.steps}/{ref.steps}, weights {weights:.2e}, gradients {max(windows, default=float('nan')):.2e}")
    return row
