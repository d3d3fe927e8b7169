"""A dataloader wrapper that lets the strategy see a whole accumulation window at its first micro-batch.

The vertical schedule runs unit 0 on every micro-batch of the window before unit 1, so when Lightning
hands over the window's first micro-batch the strategy already needs the others. Lightning keeps
delivering the batches one by one as usual (each ``training_step`` still sees its own batch); this
wrapper only reads ahead of Lightning and remembers what it has handed out recently.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from typing import Any

_MISSING = object()


class LookaheadIterator(Iterator[Any]):
    def __init__(self, inner: Iterator[Any], keep: int) -> None:
        self._inner = inner
        self._ahead: deque[Any] = deque()
        self._recent: OrderedDict[int, Any] = OrderedDict()
        self._keep = keep
        self._exhausted = False
        self.num_delivered = 0
        """Batches handed out through ``__next__`` (to Lightning's fetcher) so far."""

    def __next__(self) -> Any:
        if self._ahead:
            batch = self._ahead.popleft()
        else:
            if self._exhausted:
                raise StopIteration
            try:
                batch = next(self._inner)
            except StopIteration:
                self._exhausted = True
                raise
        self._recent[self.num_delivered] = batch
        while len(self._recent) > self._keep:
            self._recent.popitem(last=False)
        self.num_delivered += 1
        return batch

    def get(self, index: int) -> Any:
        """Batch number ``index`` of this iteration (0-based), reading ahead as needed; ``None`` when the
        data ends before it."""
        if index < self.num_delivered:
            if index not in self._recent:
                raise IndexError(f"batch {index} is no longer remembered (keeping {self._keep})")
            return self._recent[index]
        while self.num_delivered + len(self._ahead) <= index:
            if self._exhausted:
                return None
            try:
                self._ahead.append(next(self._inner))
            except StopIteration:
                self._exhausted = True
                return None
        return self._ahead[index - self.num_delivered]


class LookaheadLoader:
    """Wraps a training dataloader; everything but iteration is forwarded to it (``len``, ``sampler``,
    ``dataset``, ...), so Lightning treats it as the original loader."""

    def __init__(self, loader: Iterable[Any], keep: int) -> None:
        self.loader = loader
        self.keep = keep
        self.iterator: LookaheadIterator | None = None

    def __iter__(self) -> LookaheadIterator:
        self.iterator = LookaheadIterator(iter(self.loader), keep=self.keep)
        return self.iterator

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    _OWN_ATTRIBUTES = frozenset({"loader", "keep", "iterator"})

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets e.g. worker_init_fn after process_dataloader: it belongs on the real loader
        if name in self._OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __getattr__(self, name: str) -> Any:
        # only called for attributes not found on the wrapper itself
        loader = self.__dict__.get("loader", _MISSING)
        if loader is _MISSING:
            raise AttributeError(name)
        return getattr(loader, name)
