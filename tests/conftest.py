"""Every test runs in its own temporary working directory, so Trainer outputs and the default offload
directory (under ``default_root_dir``, the working directory by default) never land in the repository;
and no test may leave a greedysnake thread (I/O or optimizer) running behind it."""

from __future__ import annotations

import threading

import pytest


def _greedysnake_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("greedysnake")]


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = set(_greedysnake_threads())
    yield
    leaked = [name for name in _greedysnake_threads() if name not in before]
    assert not leaked, f"threads left running: {leaked}"
