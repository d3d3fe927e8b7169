"""One RNG policy for the model's training forwards, whatever the order they run in.

Lightning runs micro-batch ``m + 1``'s forward after micro-batch ``m``'s, so with one global generator
micro-batch ``m + 1`` draws its dropout masks from where ``m`` left it. The vertical order runs unit by unit
across the micro-batches (and half its units in descending micro-batch order), so where ``m`` leaves the
generator is known only after its last unit: no order but Lightning's own could reproduce those masks, and
the result would depend on which order the planner picks for this machine.

The policy instead gives every micro-batch its own stream:

- when training starts, one *base* seed is drawn from the global CPU generator (:func:`draw_base_seed`:
  the one draw the policy takes from it, so ``seed_everything`` still decides everything);
- the model's forward on micro-batch ``m`` of the window that ends in optimizer step ``s``
  (``trainer.global_step``) draws from a stream seeded with :func:`stream_seed` ``(base, s, m)`` (the CPU
  generator, and on CUDA the device's), continued from forward to forward of that micro-batch (unit by
  unit, in whatever order they run);
- the global generators are left as they were around each of those forwards: code outside the model's
  forward (a ``training_step``'s own draws, data loading) draws from them as under Lightning.

Every schedule and placement of greedysnake follows it (:class:`MicrobatchStreams`, entered by the engine
around every forward it runs for a micro-batch), and so does :class:`MicrobatchRNG`, a callback that applies
it under any other strategy (``lightning_greedysnake/strategy/rng_callback.py``): the reference the exactness
tests compare with. Recomputation replays the
state a unit's forward started from (:class:`GeneratorState`), so the masks of a recomputed forward are its
forward's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

_MASK = (1 << 63) - 1


def draw_base_seed() -> int:
    """The policy's one draw from the global CPU generator, when training starts."""
    return int(torch.randint(0, _MASK, (1,), dtype=torch.int64).item())


def _mix(x: int) -> int:
    """SplitMix64's finaliser: neighbouring inputs give unrelated outputs."""
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def stream_seed(base: int, step: int, microbatch: int) -> int:
    """The seed of micro-batch ``microbatch``'s stream in the window of optimizer step ``step``."""
    return _mix(_mix(_mix(base) ^ step) ^ microbatch) & _MASK


@dataclass
class GeneratorState:
    """The global generators' state: the CPU generator's, and ``device``'s when it is a CUDA device."""

    cpu: Tensor
    cuda: Tensor | None
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> GeneratorState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)

    @classmethod
    def seeded(cls, seed: int, device: torch.device) -> GeneratorState:
        """The state of generators freshly seeded with ``seed`` (the global ones are not touched)."""
        cpu = torch.Generator().manual_seed(seed).get_state()
        cuda = None
        if device.type == "cuda":
            generator = torch.cuda.default_generators[device.index if device.index is not None else
                                                      torch.cuda.current_device()]
            before = generator.get_state()
            generator.manual_seed(seed)
            cuda = generator.get_state()
            generator.set_state(before)
        return cls(cpu, cuda, device)

    def restore(self) -> None:
        """Make this the global generators' state."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)

    def equals(self, other: GeneratorState) -> bool:
        return torch.equal(self.cpu, other.cpu) and (
            self.cuda is None or other.cuda is None or torch.equal(self.cuda, other.cuda))

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body from this state, then put the global state back as it was: a recomputation must
        not change what later code draws."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            self.restore()
            yield


class MicrobatchStreams:
    """The streams of one window (optimizer step ``step``): each micro-batch's generator state between
    its forwards. Training thread only.

    ``on_first_draw``: called once, the first time a forward is seen to draw from its stream."""

    def __init__(self, base: int, step: int, device: torch.device,
                 on_first_draw: Callable[[], None] | None = None) -> None:
        self.base = base
        self.step = step
        self.device = device
        self._on_first_draw = on_first_draw
        self._states: dict[int, GeneratorState] = {}
        """Per micro-batch, where its last forward left its stream (absent: not drawn from yet)."""
        self._active: int | None = None

    @contextlib.contextmanager
    def forward_of(self, microbatch: int) -> Iterator[None]:
        """Run the body (a forward on ``microbatch``) on that micro-batch's stream, continued from where its
        previous forward left it; the global generators are as before afterwards. Nests: inside another
        micro-batch's body, that one's position is kept; inside its own, nothing changes."""
        if self._active == microbatch:
            yield
            return
        outer = GeneratorState.capture(self.device)
        start = self._states.get(microbatch)
        if start is None:
            start = GeneratorState.seeded(stream_seed(self.base, self.step, microbatch), self.device)
        start.restore()
        previous, self._active = self._active, microbatch
        try:
            yield
        finally:
            self._active = previous
            end = GeneratorState.capture(self.device)
            self._states[microbatch] = end
            outer.restore()
            if self._on_first_draw is not None and not end.equals(start):
                announce, self._on_first_draw = self._on_first_draw, None
                announce()


class TrainingRng:
    """A run's policy: the base seed (drawn at :meth:`start`, when training starts) and each window's
    streams. ``announce(message)`` is called once per run, when a forward first draws."""

    MESSAGE = (
        "greedysnake: the model draws random numbers in its training forward (dropout, say). Each micro-batch "
        "of a window draws from its own stream, seeded from one draw of the global generator when training "
        "starts, the step and the micro-batch, in every schedule and placement alike; so the masks are not "
        "those of Lightning's single stream, where a micro-batch continues from the one before. "
        "The callback lightning_greedysnake.MicrobatchRNG() applies the same policy under any other strategy "
        "(docs/concepts/exactness.md)."
    )

    def __init__(self, device: torch.device, announce: Callable[[str], None] | None = None) -> None:
        self.device = device
        self._announce = announce
        self.base: int | None = None

    def start(self) -> None:
        """Training starts: draw the base seed (every fit, as :class:`MicrobatchRNG` does)."""
        self.base = draw_base_seed()

    def window(self, step: int) -> MicrobatchStreams:
        if self.base is None:  # (a window driven without a Trainer: the engine's own tests)
            self.start()
        assert self.base is not None
        return MicrobatchStreams(self.base, step, self.device, self._say_once)

    def _say_once(self) -> None:
        announce, self._announce = self._announce, None
        if announce is not None:
            announce(self.MESSAGE)
