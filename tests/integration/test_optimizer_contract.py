"""The optimizer contract (:mod:`lightning_greedysnake.optim.contract`): every ``torch.optim`` class and
torchao's low-bit AdamW either stepped exactly (against Lightning's own strategy with the same optimizer
and ``accumulate_grad_batches``, weights and every window's gradients to 1e-5 in fp32) or refused before
any work, naming the class and the fix; never silently wrong.

Paths per optimizer: the vertical order with every kind on SSD (``auto=False``: alpha 0.25, a background
lane), the planned defaults, the horizontal order, alpha 0.5; partitioned state over two processes is in
``test_distributed.py`` (one launch for every optimizer).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig
from lightning_greedysnake.optim.contract import StepPath, optimizer_contract
from lightning_greedysnake.optim.unit_optimizer import UnsupportedOptimizerError
from tests.helpers import RecordingLogger, make_trainer, max_abs_diff, regression_loader
from tests.integration.test_equivalence import GradRecorder

K = 3
NUM_BATCHES = 8  # windows of 3, 3, 2 per epoch, two epochs: six steps
WIDTH = 48  # a unit of a 48x48 or 48x96 matrix is cut by alpha (splits fall on 2048-element boundaries)


class _GroupStepper(torch.optim.Optimizer):
    """An optimizer written in the test: runs the closure as Lightning's needs, then :meth:`update` per group."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self.update(group)
        return loss

    def update(self, group: dict[str, Any]) -> None:
        raise NotImplementedError


class LAMB(_GroupStepper):
    """A LAMB-style optimizer: Adam's direction scaled by a trust ratio per parameter (its norm over its
    update's norm): not element-wise, separable per parameter."""

    def __init__(self, params: Any, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def update(self, group: dict[str, Any]) -> None:
        b1, b2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
            state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"]) + group["weight_decay"] * p
            w_norm, u_norm = p.norm(), update.norm()
            trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones(()))
            p.add_(update * trust, alpha=-group["lr"])


class GlobalNormSGD(_GroupStepper):
    """Couples parameters: every step is scaled by the norm of all gradients together."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr))

    def update(self, group: dict[str, Any]) -> None:
        grads = [p.grad for p in group["params"] if p.grad is not None]
        total = torch.sqrt(sum((g * g).sum() for g in grads))
        for p in group["params"]:
            if p.grad is not None:
                p.add_(p.grad / (total + 1e-6), alpha=-group["lr"])


class CountingSGD(_GroupStepper):
    """Keeps its step count in its param group, as pytorch-optimizer's optimizers do (``group['step']``),
    and decays its step size with it: per-call state outside ``state[p]``, kept per part and checkpointed."""

    def __init__(self, params: Any, lr: float = 3e-2) -> None:
        super().__init__(params, dict(lr=lr))

    def update(self, group: dict[str, Any]) -> None:
        group["step"] = group.get("step", 0) + 1
        for p in group["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-group["lr"] / group["step"] ** 0.5)


class GroupEstimateSGD(_GroupStepper):
    """Keeps an estimate over all of a group's gradients in the param group (D-Adaptation's and Prodigy's
    kind of state), which its updates read only after ``late`` steps: a probe that compared weights alone
    would pass it."""

    def __init__(self, params: Any, lr: float = 1e-2, late: int = 5) -> None:
        super().__init__(params, dict(lr=lr, late=late))

    def update(self, group: dict[str, Any]) -> None:
        total = sum(float((p.grad * p.grad).sum()) for p in group["params"] if p.grad is not None)
        group["estimate"] = 0.9 * group.get("estimate", 0.0) + 0.1 * total
        group["calls"] = group.get("calls", 0) + 1
        scale = 1.0 if group["calls"] <= group["late"] else 1.0 / (1.0 + group["estimate"])
        for p in group["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-group["lr"] * scale)


class StateCouplingSGD(_GroupStepper):
    """Couples parameters through its state: each parameter's state sums the norm of all of the group's
    gradients, which its update reads only after ``late`` steps (weights alone agree over a short probe)."""

    def __init__(self, params: Any, lr: float = 1e-2, late: int = 5) -> None:
        super().__init__(params, dict(lr=lr, late=late))

    def update(self, group: dict[str, Any]) -> None:
        grads = [p.grad for p in group["params"] if p.grad is not None]
        total = torch.sqrt(sum((g * g).sum() for g in grads))
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            state["step"] = state.get("step", 0) + 1
            state["total"] = state.get("total", torch.zeros(())) + total
            scale = 1.0 if state["step"] <= group["late"] else float(1.0 / (1.0 + state["total"]))
            p.add_(p.grad, alpha=-group["lr"] * scale)


def _pytorch_optimizer(name: str) -> Callable[..., torch.optim.Optimizer]:
    def make(params: Any, **kw: Any) -> torch.optim.Optimizer:
        import pytorch_optimizer

        return getattr(pytorch_optimizer, name)(params, **kw)

    return make


def _torchao(name: str) -> Callable[..., torch.optim.Optimizer]:
    def make(params: Any, **kw: Any) -> torch.optim.Optimizer:
        optim = pytest.importorskip("torchao.optim")
        return getattr(optim, name)(params, **kw)

    return make


# name -> (factory over param groups, its path under optimizer_path="auto", layer width)
OPTIMIZERS: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], StepPath, int]] = {
    "SGD-momentum": (lambda g: torch.optim.SGD(g, lr=3e-2, momentum=0.9), StepPath.ELEMENT_WISE, WIDTH),
    "SGD-nesterov": (lambda g: torch.optim.SGD(g, lr=3e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
                     StepPath.ELEMENT_WISE, WIDTH),
    "Adam": (lambda g: torch.optim.Adam(g, lr=3e-3), StepPath.ELEMENT_WISE, WIDTH),
    "AdamW-amsgrad": (lambda g: torch.optim.AdamW(g, lr=3e-3, amsgrad=True), StepPath.ELEMENT_WISE, WIDTH),
    "AdamW-foreach": (lambda g: torch.optim.AdamW(g, lr=3e-3, foreach=True), StepPath.ELEMENT_WISE, WIDTH),
    "AdamW-fused": (lambda g: torch.optim.AdamW(g, lr=3e-3, fused=True), StepPath.ELEMENT_WISE, WIDTH),
    "Adamax": (lambda g: torch.optim.Adamax(g, lr=3e-3), StepPath.ELEMENT_WISE, WIDTH),
    "NAdam": (lambda g: torch.optim.NAdam(g, lr=3e-3), StepPath.ELEMENT_WISE, WIDTH),
    "RAdam-decoupled": (lambda g: torch.optim.RAdam(g, lr=3e-3, weight_decay=0.1, decoupled_weight_decay=True),
                        StepPath.ELEMENT_WISE, WIDTH),
    "RMSprop-centered": (lambda g: torch.optim.RMSprop(g, lr=1e-3, momentum=0.5, centered=True),
                         StepPath.ELEMENT_WISE, WIDTH),
    "Adagrad": (lambda g: torch.optim.Adagrad(g, lr=3e-2, initial_accumulator_value=0.1, lr_decay=0.01),
                StepPath.ELEMENT_WISE, WIDTH),
    "Adadelta": (lambda g: torch.optim.Adadelta(g, lr=1.0), StepPath.ELEMENT_WISE, WIDTH),
    "Rprop": (lambda g: torch.optim.Rprop(g, lr=1e-3), StepPath.ELEMENT_WISE, WIDTH),
    "ASGD": (lambda g: torch.optim.ASGD(g, lr=3e-2, t0=2), StepPath.ELEMENT_WISE, WIDTH),
    "AdamW8bit": (lambda g: _torchao("AdamW8bit")(g, lr=3e-3), StepPath.ELEMENT_WISE, 64),
    "AdamW4bit": (lambda g: _torchao("AdamW4bit")(g, lr=3e-3), StepPath.ELEMENT_WISE, 64),
    "Adafactor": (lambda g: torch.optim.Adafactor(g, lr=1e-2), StepPath.WHOLE_PARAMETER, WIDTH),
    "Muon": (lambda g: torch.optim.Muon(g, lr=2e-2), StepPath.WHOLE_PARAMETER, WIDTH),
    "LAMB": (lambda g: LAMB(g, lr=1e-2, weight_decay=0.01), StepPath.WHOLE_PARAMETER, WIDTH),
    # per-call state in the param groups (group['step']): one written here, one of pytorch-optimizer's
    "CountingSGD": (lambda g: CountingSGD(g), StepPath.WHOLE_PARAMETER, WIDTH),
    "po-Lamb": (lambda g: _pytorch_optimizer("Lamb")(g, lr=1e-2, weight_decay=0.01), StepPath.WHOLE_PARAMETER, WIDTH),
    # a step count in state['k'], a key that is no parameter; state in lists of tensors (host memory)
    "po-MADGRAD": (lambda g: _pytorch_optimizer("MADGRAD")(g, lr=1e-2), StepPath.WHOLE_PARAMETER, WIDTH),
    "po-SOAP": (lambda g: _pytorch_optimizer("SOAP")(g, lr=3e-3), StepPath.WHOLE_PARAMETER, WIDTH),
}


class MLP(L.LightningModule):
    """A small MLP as an ``nn.Sequential`` (the strategy's built-in adapter splits it into units):
    matrices of several shapes, biases and a LayerNorm. ``matrices_only``: everything but the 2-D weights
    frozen (Muon takes matrices only)."""

    def __init__(self, optimizer: str, width: int = WIDTH) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.net = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                 nn.Linear(width, 2 * width), nn.LayerNorm(2 * width), nn.Linear(2 * width, 3))
        if optimizer == "Muon":
            for p in self.net.parameters():
                p.requires_grad_(p.dim() == 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]
        matrices = [p for p in trainable if p.dim() >= 2]
        rest = [p for p in trainable if p.dim() < 2]
        groups = [{"params": matrices}] + ([{"params": rest}] if rest else [])  # two groups: both honoured
        opt = OPTIMIZERS[self.optimizer_name][0](groups)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Contract(GradRecorder):
    """Also: the contract the run was built with (None: no tensor manager) and each unit's element range
    this rank steps, with the size of the unit's trained prefix and how many parameters it trains."""

    contract = None
    chunks: list[tuple[int, int, int, int]] = []

    def on_train_start(self, trainer: Any, module: Any) -> None:
        super().on_train_start(trainer, module)
        manager = getattr(trainer.strategy, "tensor_manager", None)
        self.contract = manager.contract if manager is not None else None
        self.chunks = ([(*manager.state.bounds(u), manager.state.units[u].trained_numel,
                         sum(slot.group is not None for slot in manager.state.units[u].params))
                        for u in range(manager.num_units)]
                       if manager is not None else [])


def fit(strategy: Any, optimizer: str, width: int | None = None, **trainer_kwargs: Any) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module = MLP(optimizer, width or OPTIMIZERS[optimizer][2])
    grads, logger = Contract(), RecordingLogger()
    trainer = make_trainer(strategy, K, logger=logger, callbacks=[grads], **trainer_kwargs)
    trainer.fit(module, regression_loader(NUM_BATCHES))
    return {"params": {n: p.detach().clone() for n, p in module.named_parameters()}, "grads": grads,
            "steps": trainer.global_step, "contract": grads.contract, "optimizer": optimizer, "chunks": grads.chunks}


@functools.lru_cache(maxsize=None)
def reference(optimizer: str) -> dict[str, Any]:
    return fit("auto", optimizer)


QUANTIZED_WEIGHT_ATOL = 1e-4
"""torchao's 8-bit state turns the vertical order's last-bit gradient differences (the snake sums some
units' micro-batches in reverse; gradients agree to 1e-7) into a moment one code apart, a weight
difference of about lr/127 = 2.4e-5 a step: weights are compared to this there, gradients to 1e-5 as
everywhere, and the horizontal order (Lightning's summation order) is bit-identical."""


def assert_exact(got: dict[str, Any], ref: dict[str, Any], atol: float = 1e-5, weight_atol: float | None = None) -> None:
    assert got["steps"] == ref["steps"] == 6
    weight_atol = weight_atol or atol
    moved = max_abs_diff(ref["params"], fit_start_params(got))
    assert moved > 100 * weight_atol, "the optimizer must move the weights for the comparison to mean anything"
    assert max_abs_diff(got["params"], ref["params"]) <= weight_atol
    got_grads, ref_grads = got["grads"].grads, ref["grads"].grads
    assert len(got_grads) == len(ref_grads) == got["steps"]
    for step, (g, r) in enumerate(zip(got_grads, ref_grads, strict=True)):
        r = {n: v for n, v in r.items() if n in g}
        assert g.keys() == r.keys(), step
        assert max_abs_diff(g, r) <= (1e-6 if step == 0 else atol), step


@functools.lru_cache(maxsize=None)
def _start(optimizer: str) -> tuple[tuple[str, torch.Tensor], ...]:
    L.seed_everything(0, verbose=False)
    return tuple((n, p.detach().clone()) for n, p in MLP(optimizer, OPTIMIZERS[optimizer][2]).named_parameters())


def fit_start_params(got: dict[str, Any]) -> dict[str, torch.Tensor]:
    return dict(_start(got["optimizer"]))


PATHS: dict[str, Callable[[], Any]] = {
    "vertical-ssd": lambda: GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("ssd")),
    "planned": lambda: GreedySnakeStrategy(),
    "horizontal": lambda: GreedySnakeStrategy(auto=False, schedule="horizontal"),
    "alpha-half": lambda: GreedySnakeStrategy(auto=False, alpha=0.5, lag=1, offload=OffloadConfig.everywhere("ssd")),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_every_optimizer_is_exact_on_its_path(optimizer, path):
    ref = reference(optimizer)
    got = fit(PATHS[path](), optimizer)
    assert got["contract"] is not None and got["contract"].path is OPTIMIZERS[optimizer][1]
    quantized = optimizer in ("AdamW8bit", "AdamW4bit")
    if quantized and path == "horizontal":
        assert max_abs_diff(got["params"], ref["params"]) == 0
    assert_exact(got, ref, weight_atol=QUANTIZED_WEIGHT_ATOL if quantized else None)


@pytest.mark.parametrize("optimizer", ["Adafactor", "LAMB"])
def test_a_cross_element_optimizer_forced_element_wise_is_warned_and_wrong(optimizer):
    """The dispatch matters: the same optimizer forced onto flat slices is told, and is not exact (the
    case the contract exists for: Adafactor stepped unfactored; a trust ratio per slice where alpha cuts
    a 64x64 matrix at its 2048th element)."""
    ref = fit("auto", optimizer, 64)
    with pytest.warns(UserWarning, match=r"optimizer_path='element_wise' with " + optimizer):
        got = fit(GreedySnakeStrategy(auto=False, optimizer_path="element_wise", alpha=0.5,
                                      offload=OffloadConfig.everywhere("ssd")), optimizer, 64)
    assert got["contract"].path is StepPath.ELEMENT_WISE
    assert max_abs_diff(got["params"], ref["params"]) > 1e-4


def test_whole_parameter_forced_on_adamw_is_exact():
    """An element-wise optimizer is separable too: forced onto whole parameters it stays exact (what the
    speed comparison of the two paths relies on)."""
    ref = reference("AdamW-foreach")
    got = fit(GreedySnakeStrategy(auto=False, optimizer_path="whole_parameter", alpha=0.5,
                                  offload=OffloadConfig.everywhere("ssd")), "AdamW-foreach")
    assert got["contract"].path is StepPath.WHOLE_PARAMETER
    assert_exact(got, ref)


class _Refused(MLP):
    def __init__(self, make: Callable[[Any], torch.optim.Optimizer]) -> None:
        super().__init__("Adam")
        self.make = make

    def configure_optimizers(self) -> Any:
        return self.make(self.parameters())


@pytest.mark.parametrize("make, words", [
    (lambda p: torch.optim.LBFGS(p, lr=0.1), "LBFGS re-evaluates the loss"),
    (lambda p: torch.optim.SparseAdam(list(p), lr=0.1), "SparseAdam steps sparse gradients"),
    (lambda p: GlobalNormSGD(p, lr=0.1), "GlobalNormSGD couples parameters"),
])
@pytest.mark.parametrize("placement", ["ssd", "device"])
def test_an_optimizer_no_path_steps_exactly_is_refused_before_any_work(tmp_path, make, words, placement):
    module = _Refused(make)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    offload = OffloadConfig.everywhere(placement)
    if placement == "device" and "couples" in words:
        pytest.skip("everything resident: Lightning steps the user's own optimizer, whole, as it is")
    trainer = make_trainer(GreedySnakeStrategy(auto=False, offload=offload), K, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=words) as info:
        trainer.fit(module, regression_loader(NUM_BATCHES))
    assert "Fix:" in str(info.value)
    assert trainer.global_step == 0
    assert max_abs_diff({n: p.detach() for n, p in module.named_parameters()}, before) == 0


def _params(*shapes: tuple[int, ...]) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(s)) for s in shapes]


def test_the_contract_is_decided_by_the_class_and_the_real_shapes():
    shapes = [(16, 6), (16,), (32, 16)]
    assert optimizer_contract(torch.optim.AdamW(_params(*shapes))).path is StepPath.ELEMENT_WISE
    adafactor = optimizer_contract(torch.optim.Adafactor(_params(*shapes)))
    # row/column variances of the matrices stay in host memory; the vectors' variance streams
    assert (adafactor.path, adafactor.slots) == (StepPath.WHOLE_PARAMETER, ("variance",))
    assert optimizer_contract(torch.optim.Adafactor(_params((16, 6), (32, 16)))).slots == ()
    muon = optimizer_contract(torch.optim.Muon(_params((16, 6), (32, 16))))
    assert (muon.path, muon.slots, muon.probe_shape) == (StepPath.WHOLE_PARAMETER, ("momentum_buffer",), (32, 16))
    lamb = optimizer_contract(LAMB(_params(*shapes)))
    assert (lamb.path, lamb.slots) == (StepPath.WHOLE_PARAMETER, ("exp_avg", "exp_avg_sq"))
    assert optimizer_contract(torch.optim.Adagrad(_params(*shapes))).eager_state
    with pytest.raises(UnsupportedOptimizerError, match="couples parameters"):
        optimizer_contract(GlobalNormSGD(_params(*shapes)))

    class MyAdamW(torch.optim.AdamW):
        """A subclass may change the math: probed, not listed."""

    assert optimizer_contract(MyAdamW(_params(*shapes))).path is StepPath.WHOLE_PARAMETER
    seen: list[str] = []
    assert optimizer_contract(MyAdamW(_params(*shapes)), "element_wise",
                              lambda key, message: seen.append(message)).path is StepPath.ELEMENT_WISE
    assert seen and "MyAdamW" in seen[0]


def test_whole_parameter_cuts_fall_on_parameter_starts():
    """The alpha split, the ranks' chunks and the gradients file's deferred ranges of a whole-parameter
    layout are parameter starts (each a 4 KiB boundary in every dtype)."""
    from lightning_greedysnake.layout import SPLIT_ALIGN_NUMEL
    from lightning_greedysnake.models import make_units
    from lightning_greedysnake.models.adapters import sequential_chain
    from lightning_greedysnake.tensor_manager import gradients_from, state_layout

    net = nn.Sequential(nn.Linear(6, 100), nn.Linear(100, 300), nn.Linear(300, 7))
    opt = torch.optim.Adafactor(net.parameters())
    contract = optimizer_contract(opt)
    units = make_units(sequential_chain(net), 3)
    for shard in (None, (0, 2), (1, 2), (2, 3)):
        state = state_layout(units, {}, opt, OffloadConfig.everywhere("ssd").placed(), torch.float32, shard, contract)
        starts = {s.offset_numel for s in state.units[0].params} | {state.units[0].numel}
        assert all(s % SPLIT_ALIGN_NUMEL == 0 for s in starts)
        lo, hi = state.bounds(0)
        assert lo in starts and hi in starts
        for alpha in (0.1, 0.25, 0.5, 0.9):
            assert state.split(0, alpha) in starts
        if shard is None:
            assert gradients_from(state, 0.5) == [state.units[0].numel]  # (unit 0 is never deferred)
    flat = state_layout(units, {}, torch.optim.AdamW(net.parameters()), OffloadConfig.everywhere("ssd").placed(),
                        torch.float32)
    assert flat.split(0, 0.5) not in {s.offset_numel for s in flat.units[0].params}  # element-wise: anywhere
    assert math.isclose(flat.split(0, 0.5), flat.units[0].numel / 2, rel_tol=0.1)


PARTITIONED_CHILD = """
import json, os, sys
import torch
torch.set_num_threads(1)
from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig
from tests.integration.test_optimizer_contract import fit

out, names = sys.argv[1], sys.argv[2].split(",")
results = {}
for name in names:  # every optimizer in these two processes: DDP's run, then greedysnake's partitioned one
    ddp = fit("ddp", name, devices=2)
    gs = fit(GreedySnakeStrategy(auto=False, shard_state=True, offload=OffloadConfig.everywhere("ssd")), name,
             devices=2)
    results[name] = {"ddp": ddp, "gs": gs}
if int(os.environ["RANK"]) == 0:
    torch.save({n: {k: {"params": r["params"], "grads": r["grads"].grads, "steps": r["steps"],
                        "path": r["contract"].path.value if r["contract"] else None,
                        "chunks": r["chunks"]} for k, r in v.items()} for n, v in results.items()}, out)
sys.stdout.flush()
os._exit(0)  # (gloo's finalization aborts now and then after everything is written: test_distributed.py)
"""


def test_partitioned_state_over_two_processes_is_exact_for_every_optimizer(tmp_path):
    """Each rank keeps and steps its chunk of every unit (whole parameters on the whole-parameter path):
    every optimizer equals Lightning's DDP with the same optimizer, weights and every window's averaged
    gradient. Two processes launched here (the environment torchrun would set), every optimizer's two
    runs in them one after the other."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    names = [n for n in OPTIMIZERS if n not in ("AdamW8bit", "AdamW4bit")]  # (quantized state is not partitioned)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script, out = tmp_path / "child.py", tmp_path / "out.pt"
    script.write_text(PARTITIONED_CHILD)
    repo = Path(__file__).resolve().parents[2]
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(repo), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0"}
        procs.append(subprocess.Popen([sys.executable, str(script), str(out), ",".join(names)], env=env,
                                      cwd=tmp_path / ".." if rank else tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    results = torch.load(out, weights_only=False)
    cut = []
    for name in names:
        ddp, gs = results[name]["ddp"], results[name]["gs"]
        assert gs["path"] == OPTIMIZERS[name][1].value, name
        assert gs["steps"] == ddp["steps"] == 4, name  # (each rank gets half the batches: windows of 3 and 1)
        assert max_abs_diff(gs["params"], ddp["params"]) <= 1e-5, name
        assert len(gs["grads"]) == len(ddp["grads"]) == 4, name
        for step, (g, r) in enumerate(zip(gs["grads"], ddp["grads"], strict=True)):
            assert max_abs_diff(g, {n: v for n, v in r.items() if n in g}) <= 1e-5, (name, step)
        cut.append(gs["chunks"])
    for name, chunks in zip(names, cut, strict=True):  # (rank 0's chunk of each unit; rank 1 steps the rest)
        if name == "Muon":  # (each unit trains one matrix, the frozen rest after it: no cut inside its prefix)
            assert all(trained <= 1 and hi in (0, n) for lo, hi, n, trained in chunks), chunks
            continue
        assert any(0 < hi < n for lo, hi, n, _ in chunks), f"{name}: some unit must be split between the ranks"


@pytest.mark.parametrize("optimizer", ["Adafactor", "Muon", "CountingSGD", "po-Lamb", "po-MADGRAD", "po-SOAP"])
def test_a_whole_parameter_optimizer_resumes_bit_for_bit(tmp_path, optimizer):
    """Its state in its own shapes round-trips a checkpoint: Adafactor's row and column variances (host
    state) and a vector's variance (streamed), Muon's momentum, a step count kept in the param groups
    (pytorch-optimizer's ``group['step']``), one kept in ``state['k']`` (MADGRAD), state in lists of tensors
    (SOAP's bases: saved as bytes in torch's own format): the resumed run lands where the uninterrupted one
    does, and that is Lightning's."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(root: Any, epochs: int, ckpt: str | None = None) -> dict[str, torch.Tensor]:
        L.seed_everything(0, verbose=False)
        module = MLP(optimizer)
        trainer = make_trainer(GreedySnakeStrategy(auto=False, alpha=0.5, offload=OffloadConfig.everywhere("ssd")), K,
                               max_epochs=epochs, enable_checkpointing=True, default_root_dir=root,
                               callbacks=[ModelCheckpoint(dirpath=root, save_last=True)])
        trainer.fit(module, regression_loader(NUM_BATCHES), ckpt_path=ckpt)
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    uninterrupted = run(tmp_path / "a", 2)
    run(tmp_path / "b", 1)
    if optimizer == "po-MADGRAD":  # its step count, state['k'], where torch.optim keeps it in a plain checkpoint
        from lightning_greedysnake.checkpoint.plain import plain_checkpoint

        (saved,) = plain_checkpoint(tmp_path / "b" / "last.ckpt")["optimizer_states"]
        assert int(saved["state"]["k"]) == 3  # (three windows an epoch)
    resumed = run(tmp_path / "b", 2, ckpt=str(tmp_path / "b" / "last.ckpt"))
    assert max_abs_diff(resumed, uninterrupted) == 0
    assert max_abs_diff(uninterrupted, reference(optimizer)["params"]) <= 1e-5


def test_a_quantized_parameter_is_never_cut_into_a_slice_it_would_not_quantize():
    """torchao keeps fp32 state for fewer than 4096 elements: the alpha split moves to the nearest aligned
    cut that leaves a quantized parameter at least that many elements on either side."""
    from lightning_greedysnake.layout import build_unit_layout, split_numel

    lay = build_unit_layout(0, [("w", (2048 * 5 + 1024,), 0), ("b", (64,), 0)], 256)
    assert split_numel(lay, 0.5, None, 2048) == 4096  # (plain: anywhere aligned)
    assert split_numel(lay, 0.5, None, 2048, min_piece_numel=4096) == 4096  # 4096 | 7168: both whole enough
    assert split_numel(lay, 0.1, None, 2048) == 10240  # a 1024-element tail of w
    assert split_numel(lay, 0.1, None, 2048, min_piece_numel=4096) == 6144  # moved: 6144 | 5120
    tiny = build_unit_layout(0, [("w", (6144,), 0)], 256)
    assert split_numel(tiny, 0.5, None, 2048, min_piece_numel=4096) == tiny.numel  # no cut fits: nothing deferred


def test_optimizer_path_with_everything_on_the_device_is_said_to_be_ignored():
    """No tensor manager, no per-unit step: Lightning steps the optimizer as it is, and a forced path is
    said to have no effect rather than dropped silently."""
    with pytest.warns(UserWarning, match=r"optimizer_path='element_wise' is ignored.*Fix:"):
        got = fit(GreedySnakeStrategy(auto=False, optimizer_path="element_wise",
                                      offload=OffloadConfig.everywhere("device")), "Adafactor")
    assert max_abs_diff(got["params"], reference("Adafactor")["params"]) <= 1e-5


def test_a_whole_parameter_optimizer_keeps_its_state_across_a_replan():
    """A re-split mid-run (the warm-step plan's, forced here after step 1) keeps each parameter's state as
    it was kept: Adafactor's matrices keep their row and column variances only, its vectors their streamed
    variance, so the state that comes back at the end of fit is the state Lightning's optimizer holds."""
    import dataclasses

    class Replan(L.Callback):
        fired = False

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            manager = trainer.strategy.tensor_manager
            if trainer.global_step == 1 and manager.stepper.alpha == 0.5:
                manager.reconfigure(alpha=0.25, lag=1, offload=dataclasses.replace(
                    manager.config, buffer_budget_bytes=manager.pool.budget_bytes))
                Replan.fired = True

    def run(strategy: Any, callbacks: list[L.Callback]) -> tuple[dict[str, torch.Tensor], dict[int, Any]]:
        L.seed_everything(0, verbose=False)
        module = MLP("Adafactor")
        trainer = make_trainer(strategy, K, callbacks=callbacks)
        trainer.fit(module, regression_loader(NUM_BATCHES))
        return ({n: p.detach().clone() for n, p in module.named_parameters()},
                trainer.optimizers[0].state_dict()["state"])

    ref_params, ref_state = run("auto", [])
    params, state = run(GreedySnakeStrategy(auto=False, alpha=0.5, offload=OffloadConfig.everywhere("ssd")), [Replan()])
    assert Replan.fired
    assert max_abs_diff(params, ref_params) <= 1e-5
    assert state.keys() == ref_state.keys()
    for i, entry in state.items():
        assert entry.keys() == ref_state[i].keys(), i
        for key, value in entry.items():
            assert torch.allclose(torch.as_tensor(value).float(), torch.as_tensor(ref_state[i][key]).float(),
                                  atol=1e-5), (i, key)


def test_per_call_state_in_the_param_groups_is_kept_per_part_and_a_global_estimate_refused():
    """The probe compares every param-group entry ``step()`` changes, after every probe step: a counter that
    each step changes alike whatever parameters it steps is per-call state (kept per part); an estimate over
    all the group's parameters couples them, and is refused naming the entry, even where the weights agree
    over the probe's steps."""
    shapes = [(16, 6), (16,), (32, 16)]
    counting = optimizer_contract(CountingSGD(_params(*shapes)))
    assert counting.path is StepPath.WHOLE_PARAMETER
    assert counting.calls.group_keys == ("step",) and counting.calls.attributes == ()
    with pytest.raises(UnsupportedOptimizerError, match=r"couples parameters.*param_groups\[0\]\['estimate'\]") as info:
        optimizer_contract(GroupEstimateSGD(_params(*shapes)))
    assert "the parameter" not in str(info.value)  # (the weights agree over the probe: the entry alone tells)
    assert optimizer_contract(torch.optim.AdamW(_params(*shapes))).calls.group_keys == ()


def test_a_coupling_seen_only_in_the_state_is_refused():
    """An optimizer coupling parameters through its state, whose weights agree with each-alone stepping over
    the probe's steps, is refused naming the state (a probe comparing weights only would let it train wrong)."""
    with pytest.raises(UnsupportedOptimizerError, match=r"couples parameters.*its state 'total'") as info:
        optimizer_contract(StateCouplingSGD(_params((16, 6), (16,), (32, 16))))
    assert "the parameter of shape" not in str(info.value)


def test_torchao_low_bit_state_is_never_cut_below_its_minimum_piece():
    """The contract of torchao's low-bit AdamW carries its minimum piece (4096 elements, below which it keeps
    fp32 state), and a unit holding a quantized parameter just above it is split by that contract where
    neither side of that parameter falls under it, at every alpha."""
    optim = pytest.importorskip("torchao.optim")
    from lightning_greedysnake.layout import SPLIT_ALIGN_NUMEL, build_unit_layout, split_numel
    from lightning_greedysnake.optim.contract import QUANTIZED_MIN_NUMEL

    net = nn.Sequential(nn.Linear(96, 64), nn.Linear(64, 3))  # a 6144-element weight
    contract = optimizer_contract(optim.AdamW8bit(net.parameters()))
    assert contract.min_piece_numel == QUANTIZED_MIN_NUMEL
    lay = build_unit_layout(0, [(n, tuple(p.shape), 0) for n, p in net.named_parameters()], 256)
    (big,) = [s for s in lay.params if s.numel >= QUANTIZED_MIN_NUMEL]
    cuts = set()
    for alpha in (0.05, 0.1, 0.25, 0.5, 0.75, 0.9):
        cut = split_numel(lay, alpha, None, SPLIT_ALIGN_NUMEL, min_piece_numel=contract.min_piece_numel)
        inside = cut - big.offset_numel
        cuts.add(cut)
        assert not 0 < inside < big.numel or min(inside, big.numel - inside) >= QUANTIZED_MIN_NUMEL, (alpha, cut)
    assert split_numel(lay, 0.5, None, SPLIT_ALIGN_NUMEL) - big.offset_numel == 2048  # (what a plain cut would do)


class _Raising(torch.optim.Optimizer):
    """Trains under Lightning (one group of every parameter), but cannot be built over a parameter alone."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr))
        if len(self.param_groups[0]["params"]) < 2:
            raise TypeError("needs at least two parameters")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.param_groups[0]["lr"])


@pytest.mark.parametrize("make, words", [
    (lambda p: _Raising(p), r"_Raising.*TypeError: needs at least two parameters.*Fix:"),
    (lambda p: _pytorch_optimizer("AliG")(p), r"AliG.*closure.*Fix:"),
])
def test_an_error_inside_the_probe_is_refused_clearly_before_any_step(tmp_path, make, words):
    """Whatever the optimizer raises while the contract probes it becomes an UnsupportedOptimizerError naming
    the class, the shapes, the original exception and the fix, before the first step, the weights untouched."""
    module = _Refused(make)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = make_trainer(GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("ssd")), K,
                           default_root_dir=tmp_path)
    with pytest.raises(UnsupportedOptimizerError, match=words) as info:
        trainer.fit(module, regression_loader(NUM_BATCHES))
    assert "shape" in str(info.value)
    assert trainer.global_step == 0
    assert max_abs_diff({n: p.detach() for n, p in module.named_parameters()}, before) == 0


@pytest.mark.parametrize("name, make", [
    ("AdaBelief", lambda g: _pytorch_optimizer("AdaBelief")(g, lr=3e-3, weight_decouple=False)),
    ("CAME", lambda g: __import__("came_pytorch").CAME(g, lr=3e-3)),
])
def test_optimizers_users_brought_are_exact(name, make):
    """Found silently wrong or failing by a user's trial: pytorch-optimizer's AdaBelief (its step count in the
    param groups) and came-pytorch's CAME (a constructor that requires its ``lr``), each exact on the
    whole-parameter path with every kind on SSD and alpha 0.5 (pytorch-optimizer's SOAP and Lamb are in
    OPTIMIZERS, on every path)."""
    pytest.importorskip("came_pytorch" if name == "CAME" else "pytorch_optimizer")
    OPTIMIZERS[name] = (make, StepPath.WHOLE_PARAMETER, WIDTH)
    try:
        ref = fit("auto", name)
        got = fit(PATHS["alpha-half"](), name)
        assert got["contract"].path is StepPath.WHOLE_PARAMETER
        assert_exact(got, ref)
    finally:
        del OPTIMIZERS[name]


def test_shadow_optimizers_are_configured_as_the_users_instance():
    """Configuration an optimizer keeps as attributes rather than in its param groups (pytorch-optimizer's
    ``maximize``, ``n_sma_threshold``) reaches the per-unit shadow optimizers, as does a constructor keyword
    the class requires (came-pytorch's ``lr``)."""
    po = pytest.importorskip("pytorch_optimizer")
    from lightning_greedysnake.optim.unit_optimizer import construct_like

    user = po.AdaBelief(_params((4, 3)), lr=3e-3, maximize=True, n_sma_threshold=7, degenerated_to_sgd=False)
    shadow = construct_like(user, [{**{k: v for k, v in user.param_groups[0].items() if k != "params"},
                                    "params": _params((2,))}])
    assert (shadow.maximize, shadow.n_sma_threshold, shadow.degenerated_to_sgd) == (True, 7, False)
    came = pytest.importorskip("came_pytorch").CAME(_params((4, 3)), lr=3e-3)
    assert construct_like(came, [{"params": _params((2,)), **{k: v for k, v in came.param_groups[0].items()
                                                              if k != "params"}}]).param_groups[0]["lr"] == 3e-3
