"""The precision plugin: the dtype policy (autocast, fp16 loss scaling), and gradient clipping routed to
the tensor manager when it owns the gradients. The optimizer step itself is the strategy's
(``GreedySnakeStrategy.optimizer_step``): this plugin runs Lightning's own part of it, unchanged."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator, Iterable
from typing import Any, Protocol

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_greedysnake.loss_scale import LossScaler

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed")

COMPUTE_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def unsupported_precision_error(value: Any) -> ValueError:
    return ValueError(
        f"Trainer(precision={value!r}) is not supported by strategy='greedysnake'. Supported: "
        f"{', '.join(repr(p) for p in SUPPORTED_PRECISION)}. Fix: Trainer(precision='bf16-mixed') or "
        "precision='32-true' (or '16-mixed' on GPUs without bf16)."
    )


def cpu_bf16_slowdown(n: int = 512, repeats: int = 3) -> float:
    """How many times longer an ``n``-cubed bf16 matmul takes than fp32 on this CPU (best of
    ``repeats``): about 0.5 with native bf16 (AVX-512 BF16, AMX), about 100 without (AVX2-only CPUs
    emulate it). A few milliseconds."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        a @ b  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        best[dtype] = min(times)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


SLOW_BF16_FACTOR = 4.0
"""A bf16 matmul this many times slower than fp32 means the CPU has no native bf16."""


def slow_bf16_warning(factor: float) -> str | None:
    """The warning for ``bf16-mixed`` on a CPU whose bf16 matmuls run ``factor`` times slower than fp32."""
    if factor < SLOW_BF16_FACTOR:
        return None
    return (
        f"precision='bf16-mixed' on this CPU: a bf16 matmul runs {factor:.0f}x slower than fp32 here (no native "
        "bf16: AVX-512 BF16 or AMX), so training would run about that much slower. Fix: Trainer(precision="
        "'32-true') on this machine."
    )


class GradientOwner(Protocol):
    """The tensor manager, when gradients live in its buffers instead of ``param.grad``."""

    def clip_by_norm(self, max_norm: float, order: Iterable[nn.Parameter], inv_scale: float | None = None) -> Tensor:
        """Clip by the global norm of the gradients (unscaled by ``inv_scale`` first, under loss scaling)."""

    def clip_by_value(self, value: float) -> None: ...


class GreedySnakePrecision(Precision):
    """The dtype policy.

    - ``"32-true"``: fp32 throughout.
    - ``"bf16-mixed"``: forward and backward under ``torch.autocast(bfloat16)`` (Lightning's own
      policy) with 16-bit compute weights loaded from the tensor manager; fp32 master weights and fp32
      optimizer state on the optimizer side; each micro-batch's gradient accumulated into fp32 per unit.
      With every tensor on the device (no tensor manager) it is exactly Lightning's bf16-mixed: fp32
      parameters under autocast.
    - ``"16-mixed"``: the same with fp16, plus dynamic loss scaling (:class:`LossScaler`, GradScaler's
      semantics; ``scaler``: a ``torch.amp.GradScaler`` whose settings to take). Units are stepped
      speculatively as their gradients complete and undone if the window had an inf or NaN anywhere
      (with norm clipping the steps wait for the whole backward instead), so such a window is skipped
      whole, exactly (see :mod:`~lightning_greedysnake.step_modes`). On a CPU
      Lightning turns ``Trainer(precision="16-mixed")`` into bf16-mixed; pass
      ``plugins=[GreedySnakePrecision("16-mixed")]`` to run fp16 there (to test the path).

    ``device``: the autocast device type. ``None`` (the default): the accelerator's, taken from the
    strategy's root device at setup (:meth:`on_device`), so a plugin passed as
    ``plugins=[GreedySnakePrecision("bf16-mixed")]`` autocasts on the GPU it runs on.
    """

    def __init__(self, precision: str = "32-true", device: str | None = None, scaler: Any = None) -> None:
        if precision not in SUPPORTED_PRECISION:
            raise unsupported_precision_error(precision)
        self.precision = precision  # type: ignore[assignment]
        self.device: str | None = device
        """The autocast device type; None until :meth:`on_device` (the accelerator's)."""
        self.loss_scaler = LossScaler.from_grad_scaler(scaler) if precision == "16-mixed" else None
        """Under ``16-mixed``: the loss scale and its history (saved in checkpoints with this plugin)."""
        self.gradient_owner: GradientOwner | None = None
        """What clipping acts on when ``param.grad`` is not where the gradients are: the tensor manager, set
        by the strategy for the run it builds (None: Lightning's own clipping of ``param.grad``)."""

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of the compute weights the tensor manager hands to forward and backward."""
        return COMPUTE_DTYPES[self.precision]

    def on_device(self, device: torch.device) -> None:
        """The strategy's root device, at setup (before any forward): an autocast device left unset
        becomes its type. One given explicitly is kept."""
        if self.device is None:
            self.device = device.type

    @contextlib.contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision in ("bf16-mixed", "16-mixed"):
            assert self.device is not None, "forward_context before the strategy's setup set the autocast device"
            with torch.autocast(self.device, dtype=self.compute_dtype, cache_enabled=False):
                yield
        else:
            yield

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        """Under loss scaling: the loss times the scale (what backward starts from)."""
        tensor = super().pre_backward(tensor, module)
        return tensor * self.loss_scaler.scale if self.loss_scaler is not None else tensor

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.loss_scaler.state_dict() if self.loss_scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loss_scaler is not None and state_dict:
            self.loss_scaler.load_state_dict(state_dict)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.gradient_owner is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        self.gradient_owner.clip_by_norm(float(clip_val), self.main_params(optimizer),
                                         self.loss_scaler.inv_scale if self.loss_scaler is not None else None)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.gradient_owner is None:
            return super().clip_grad_by_value(optimizer, clip_val)
        self.gradient_owner.clip_by_value(float(clip_val))

    @classmethod
    def from_plugin(cls, plugin: Precision | None) -> GreedySnakePrecision:
        """Lightning builds a plain plugin from ``Trainer(precision=...)``; translate it or refuse it."""
        if plugin is None:
            return cls()
        if isinstance(plugin, GreedySnakePrecision):
            return plugin
        if type(plugin) is Precision:  # Lightning's "32-true"
            return cls("32-true")
        if type(plugin) is MixedPrecision and plugin.precision in ("bf16-mixed", "16-mixed"):
            # (Lightning builds a GradScaler("cuda") that disables itself where CUDA is missing: defaults then)
            scaler = plugin.scaler if plugin.scaler is not None and plugin.scaler.is_enabled() else None
            return cls(plugin.precision, device=plugin.device, scaler=scaler)
        raise unsupported_precision_error(getattr(plugin, "precision", type(plugin).__name__))
