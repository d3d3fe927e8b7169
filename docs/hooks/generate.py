"""MkDocs hook: the generated parts of the site, made at build time from their one source.

- ``<!-- gen:settings GreedySnakeConfig -->`` (and ``OffloadConfig``): the settings reference, from the
  config dataclasses and the docstring under each field (``docs/hooks/reference.py``);
- ``<!-- gen:cli plan -->`` / ``<!-- gen:cli export -->``: the command-line tools' ``--help``;
- ``<!-- gen:benchmarks -->``: every table of the benchmark page, from ``benchmarks/results/*.json``
  (``benchmarks/report.py``, the only writer of those numbers), and the plots beside the JSON.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("greedysnake_docs_reference", _HERE / "reference.py")
assert _spec is not None and _spec.loader is not None
reference = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = reference
_spec.loader.exec_module(reference)


def on_files(files: Files, config: Any) -> Files:
    """The benchmark plots the page shows, served from beside their JSON."""
    report = reference.benchmarks_module()
    for png in report.plots():
        files.append(File.generated(config, f"img/benchmarks/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    return reference.expand(markdown)
