"""The settings reference, generated from the config dataclasses: one source of truth.

Every field of :class:`GreedySnakeConfig` and :class:`OffloadConfig` is rendered from the dataclass itself
(name, type, default) and the docstring written under the field in ``lightning_greedysnake/config.py``.
A field without a docstring is an error, so a new setting cannot reach the docs undocumented (checked
by ``tests/unit/test_docs.py`` and by ``mkdocs build``).

Also renders the command-line tools' ``--help`` and checks the environment switches the package reads
against the environment page.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIG_SOURCE = ROOT / "lightning_greedysnake" / "config.py"
CLASSES = ("GreedySnakeConfig", "OffloadConfig")
CLIS = {"plan": "lightning_greedysnake.plan", "export": "lightning_greedysnake.export"}


class UndocumentedSetting(ValueError):
    """A config field without a docstring under it."""


def field_docs(class_name: str, source: Path = CONFIG_SOURCE) -> dict[str, str | None]:
    """Each field of ``class_name`` (in order) -> the docstring written under it, or None.

    A docstring under a run of fields with none of their own (``weights: ...`` ``gradients: ...`` then one
    string) belongs to the last field only: each field needs its own."""
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    docs: dict[str, str | None] = {}
    body = cls.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            after = body[i + 1] if i + 1 < len(body) else None
            doc = None
            if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                doc = " ".join(after.value.value.split())
            docs[node.target.id] = doc or None
    return docs


def rst_to_md(text: str) -> str:
    """The docstrings' reST (``code``, :class:`X`, :mod:`~a.b`) as Markdown."""
    text = re.sub(r":(?:class|mod|func|data|meth|attr):`~?([^`]+)`", lambda m: f"`{m.group(1).replace(' ', '')}`",
                  text)
    return text.replace("``", "`")


def _config_module() -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("lightning_greedysnake.config")


def _default_text(config: Any, cls: type, f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # (offload: a nested config)
        return "see [`offload`](#offload-settings)"
    value = f.default
    if value is None:
        fixed = None
        if cls.__name__ == "GreedySnakeConfig" and f.name in config.FIXED_DEFAULTS:
            fixed = config.FIXED_DEFAULTS[f.name]
        elif cls.__name__ == "OffloadConfig" and f.name in {k.value for k in config.TensorKind}:
            fixed = config.FIXED_PLACEMENT[config.TensorKind(f.name)]
        if fixed is not None:
            shown = getattr(fixed, "value", fixed)
            return f"unset (`None`): planned with `auto=True`; `{shown}` with `auto=False`"
        return "`None`"
    value = getattr(value, "value", value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"`{value}` ({value >> 20} MiB)"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def settings_markdown(class_name: str) -> str:
    """The reference section of one config class: a heading per field, its type, default and docs."""
    config = _config_module()
    cls = getattr(config, class_name)
    docs = field_docs(class_name)
    prefix = "offload." if class_name == "OffloadConfig" else ""
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
    if missing:
        raise UndocumentedSetting(
            f"{class_name} field(s) {missing} have no docstring in {CONFIG_SOURCE.relative_to(ROOT)}. Fix: write "
            "a docstring under each field (it is the settings reference).")
    out = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        anchor = name.replace(".", "-").replace("_", "-")
        type_text = str(f.type)
        out.append(f"### `{name}` {{#{anchor}}}\n\n"
                   f"*type* `{type_text}` · *default* {_default_text(config, cls, f)}\n\n"
                   f"{rst_to_md(docs[f.name] or '')}\n")
    return "\n".join(out)


def cli_help(name: str) -> str:
    """``python -m lightning_greedysnake.<name> --help``, as the tool prints it."""
    module = importlib.import_module(CLIS[name])
    argv0, sys.argv[0] = sys.argv[0], f"python -m {CLIS[name]}"
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            module.main(["--help"])
    finally:
        sys.argv[0] = argv0
    return out.getvalue().rstrip()


def environment_switches() -> set[str]:
    """Every ``GREEDYSNAKE_*`` variable name the package's source mentions."""
    names: set[str] = set()
    for path in (ROOT / "lightning_greedysnake").rglob("*.py"):
        names |= set(re.findall(r"\bGREEDYSNAKE_[A-Z_]+\b", path.read_text()))
    return names


MARKER = re.compile(r"<!--\s*gen:(\w+)(?:\s+(\S+))?\s*-->")


def expand(markdown: str) -> str:
    """Replace each ``<!-- gen:KIND ARG -->`` marker with what it names."""
    def one(m: re.Match[str]) -> str:
        kind, arg = m.group(1), m.group(2)
        if kind == "settings":
            return settings_markdown(arg)
        if kind == "cli":
            return f"```text\n{cli_help(arg)}\n```"
        if kind == "benchmarks":
            return benchmarks_module().render()
        if kind == "optimizers":
            return optimizers_markdown()
        raise ValueError(f"unknown docs marker {m.group(0)}")
    return MARKER.sub(one, markdown)


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell: no column bar, no bracket read as a link."""
    return text.replace("|", "/").replace("[", "&#91;").replace("]", "&#93;").replace("`", "'")


def optimizers_markdown() -> str:
    """The optimizer audit's table (``benchmarks/optimizer_audit.py``, its one writer): the counts, then
    every optimizer of pytorch-optimizer's registry with what greedysnake does with it."""
    import json

    result = json.loads((ROOT / "benchmarks" / "results" / "optimizer_audit.json").read_text())
    lines = [f"pytorch-optimizer {result['version']}, torch {result['torch']}: `{result['command']}` "
             f"({result['seconds']} s on this project's 2-core CPU machine).", "",
             "| outcome | optimizers |", "|---|---|"]
    lines += [f"| {outcome} | {count} |" for outcome, count in result["counts"].items()]
    if result.get("other_counts"):
        lines += ["", f"Every optimizer class of {', '.join(result['libraries'])} (the rows named by module):", "",
                  "| outcome | optimizers |", "|---|---|"]
        lines += [f"| {outcome} | {count} |" for outcome, count in result["other_counts"].items()]
    lines += ["", "| optimizer | every kind on SSD | planned defaults | path, or why not |", "|---|---|---|---|"]
    for row in result["rows"]:
        if row["auto"]:
            lines.append(f"| `{row['name']}` ({row['cls']}) | - | - | does not train under `strategy=\"auto\"` "
                         f"either: {_cell(row['auto'])} |")
            continue
        outcomes = row["outcomes"]
        detail = next((d for d in row["details"].values() if d), "").split(" Fix:")[0]
        lines.append(f"| `{row['name']}` ({row['cls']}) | {outcomes.get('ssd', '')} | {outcomes.get('planned', '')} "
                     f"| {_cell(detail[:220])} |")
    return "\n".join(lines)


def benchmarks_module() -> Any:
    """``benchmarks/report.py`` (a script, not a package module), loaded by path."""
    name = "greedysnake_benchmarks_report"
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module
