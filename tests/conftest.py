"""Every test runs in its own temporary working directory, so Trainer outputs and the default offload
directory (under ``default_root_dir``, the working directory by default) never land in the repository."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yield
