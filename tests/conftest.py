"""Every test runs in its own temporary working directory, so Trainer outputs and the default offload
directory (under ``default_root_dir``, the working directory by default) never land in the repository;
and no test may leave a greedysnake thread (I/O or optimizer) running behind it.

Without a CUDA device, torch computes with one intra-op thread here (``OMP_NUM_THREADS=1``, which the
child processes some tests start inherit too), unless ``OMP_NUM_THREADS`` is already set. The tests'
models are tiny, so a team of OpenMP threads gains nothing on them, and where other work shares the 2 cores
it spins against it and the strategy's own I/O and optimizer-lane threads (docs/how-to/small-machine.md):
on a loaded 2-core machine the suite took 29.5 min with torch's default and 17.6 with one thread; on an
idle one the wall time is about the same either way, with a quarter to a third less CPU. Every
comparison is between two runs in the same process (or two children with the same environment), so both
sides compute with the same thread count; the lane still sets its own per thread, as in production."""

from __future__ import annotations

import os
import threading

import pytest

if "OMP_NUM_THREADS" not in os.environ:
    import torch

    if not torch.cuda.is_available():  # (a GPU session's tests keep torch's default)
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def _greedysnake_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("greedysnake")]


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = set(_greedysnake_threads())
    yield
    leaked = [name for name in _greedysnake_threads() if name not in before]
    assert not leaked, f"threads left running: {leaked}"
