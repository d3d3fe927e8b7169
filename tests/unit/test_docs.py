"""The documentation site (``mkdocs.yml``, ``docs/``) stays true to the code.

- ``mkdocs build --strict`` passes: no broken link or anchor, every API object found, every generated part
  generated (skipped, saying why, where mkdocs is not installed: ``pip install -e ".[docs]"``).
- The settings reference covers every field of the config dataclasses, each with its own docstring (the
  reference is generated from them: a new field without a docstring fails here and fails the build), and
  the Hydra strategy group lists every field.
- Every Python snippet in the docs runs, in page order, in one namespace per page; a snippet marked with
  ``<!-- snippet: compile (why) -->`` on the line above its fence (it trains, needs a GPU, data or a file)
  is compiled only. The README's Python snippets are compiled.
- The benchmark page's numbers come only from ``benchmarks/report.py`` over ``benchmarks/results/*.json``:
  every results file is on the page or archived, and the page's hand-written text holds no measured number.
- Every ``GREEDYSNAKE_*`` environment switch the package reads is on the environment page.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_greedysnake import GreedySnakeConfig, OffloadConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


reference = _load("greedysnake_docs_reference", DOCS / "hooks" / "reference.py")
report = reference.benchmarks_module()


# --- snippets ------------------------------------------------------------------------------------------

FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
COMPILE_ONLY = re.compile(r"<!--\s*snippet:\s*compile\b[^>]*-->\s*$")


def snippets(path: Path) -> list[tuple[int, str, bool]]:
    """(line, code, run it) of each Python fenced block of a Markdown file."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        out.append((line, m.group(1), not COMPILE_ONLY.search(before)))
    return out


DOC_PAGES = sorted(p for p in DOCS.rglob("*.md"))


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_doc_snippets_run(page: Path):
    """Every snippet compiles; the unmarked ones run, in page order, in one namespace per page."""
    namespace: dict = {"__name__": f"docs_snippet_{page.stem}"}
    for line, code, run in snippets(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        compiled = compile(code, where, "exec")  # a SyntaxError names the page and the line
        if run:
            try:
                exec(compiled, namespace)  # noqa: S102 (the docs' own snippets)
            except Exception as e:
                raise AssertionError(f"the snippet at {where} failed: {type(e).__name__}: {e}. Fix the snippet, "
                                     "or mark it `<!-- snippet: compile (why) -->` if it cannot run here.") from e


def test_readme_snippets_compile():
    for line, code, _ in snippets(ROOT / "README.md"):
        compile(code, f"README.md:{line}", "exec")


def test_a_snippet_marked_compile_only_is_not_run(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- snippet: compile (trains) -->\n```python\ntrainer.fit()\n```\n\n```python\nx = 1\n```\n")
    assert [run for _, _, run in snippets(page)] == [False, True]


# --- the settings reference ------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [GreedySnakeConfig, OffloadConfig], ids=lambda c: c.__name__)
def test_every_setting_has_its_own_docstring_and_a_reference_entry(cls):
    docs = reference.field_docs(cls.__name__)
    names = [f.name for f in dataclasses.fields(cls)]
    assert list(docs) == names, "the AST's fields and the dataclass's fields differ"
    undocumented = [n for n in names if not docs[n]]
    assert not undocumented, f"{cls.__name__} fields without a docstring under them: {undocumented}"
    text = reference.settings_markdown(cls.__name__)
    prefix = "offload." if cls is OffloadConfig else ""
    for name in names:
        assert f"### `{prefix}{name}`" in text, name


def test_a_field_without_a_docstring_fails_the_reference(tmp_path, monkeypatch):
    source = tmp_path / "config.py"
    source.write_text('class C:\n    a: int = 1\n    """documented"""\n    b: int = 2\n    c: int = 3\n    """c"""\n')
    assert reference.field_docs("C", source) == {"a": "documented", "b": None, "c": "c"}
    real = reference.field_docs
    monkeypatch.setattr(reference, "field_docs", lambda name: {**real(name), "alpha": None})
    with pytest.raises(reference.UndocumentedSetting, match="alpha"):
        reference.settings_markdown("GreedySnakeConfig")


def test_the_hydra_strategy_group_lists_every_setting():
    conf = yaml.safe_load((ROOT / "conf" / "strategy" / "greedysnake.yaml").read_text())
    assert set(conf) - {"_target_", "_convert_"} == {f.name for f in dataclasses.fields(GreedySnakeConfig)}
    assert set(conf["offload"]) == {f.name for f in dataclasses.fields(OffloadConfig)}


def test_every_environment_switch_is_documented():
    page = (DOCS / "reference" / "environment.md").read_text()
    switches = reference.environment_switches()
    assert {"GREEDYSNAKE_DEBUG_POOL", "GREEDYSNAKE_DEBUG_IO", "GREEDYSNAKE_SIMULATE_DEVICE"} <= switches
    assert not [s for s in switches if s not in page]


def test_the_glossary_the_report_names_defines_each_of_its_terms_and_is_on_the_site():
    """The start-of-run report names :data:`~lightning_greedysnake.strategy.report.GLOSSARY` once per message
    that uses a term of :data:`~lightning_greedysnake.strategy.report.GLOSSARY_TERMS`: the page exists, has a
    heading for each term, and is in the site's navigation."""
    from lightning_greedysnake.strategy.report import GLOSSARY, GLOSSARY_TERMS

    page = ROOT / GLOSSARY
    assert page.is_file(), f"{GLOSSARY}: the report names it, the repository must have it"
    headings = [line.lstrip("#").strip().lower() for line in page.read_text().splitlines() if line.startswith("## ")]
    missing = [term for term in GLOSSARY_TERMS if not any(h == term or h.startswith(f"{term} ") for h in headings)]
    assert not missing, f"{GLOSSARY} has no heading for {missing} (headings: {headings})"
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))["nav"]
    assert str(page.relative_to(DOCS)) in str(nav), "the glossary is not in mkdocs.yml's nav"


# --- the benchmark page --------------------------------------------------------------------------------

def test_every_result_file_is_on_the_benchmark_page_or_archived():
    assert not report.unlisted(), (
        f"{report.unlisted()}: add each to SECTIONS in benchmarks/report.py, or `git mv` it to results/archive/")
    for name in report.current_files():
        assert (report.RESULTS / f"{name}.json").exists(), name


def test_the_benchmark_page_shows_the_json_and_nothing_typed_by_hand():
    page = report.render()
    for name in report.current_files():
        data = report.load(name)
        shown, _ = report._shown_rows(data["rows"])
        for row in shown:
            assert "| " + report.cell(next(iter(row.values()))) + " |" in page, (name, row)
            for key in ("step_s", "tokens_per_s", "vs_deepspeed", "vs_baseline", "peak_rss_mb"):
                if key in row:
                    assert f" {report.cell(row[key])} |" in page, (name, key)
    hand = (DOCS / "benchmarks.md").read_text()
    typed = re.findall(r"\d+\.\d+|\d+(?:\.\d+)?x\b", hand) + re.findall(
        r"\d+\.\d+", " ".join(s.text + " ".join(r.caption for r in s.results) for s in report.SECTIONS))
    assert not typed, f"measured numbers typed by hand on the benchmark page: {typed}"


def test_the_readme_headline_is_its_json_and_short():
    """The README's one figure is generated (``benchmarks/report.py --readme``), and the README stays short:
    its reference lives in the docs."""
    readme = (ROOT / "README.md").read_text()
    assert report.readme_generated(readme) == readme, "stale block: run python benchmarks/report.py --readme"
    data = report.load(report.HEADLINE.file)
    median = {r["system"]: r["tokens_per_s"] for r in data["rows"] if r.get("round", "median") == "median"}
    for system, (label, peer) in report.HEADLINE_SYSTEMS.items():  # each against its own peer, from the file
        tps = median[system]
        assert (f"| {label} | {report.cell(tps)} | {tps / median[peer]:.2f}x {report.PEERS[peer]} |") in readme
    for result in report.SCALE:  # the size table: each system's largest trained size, from the files
        for label, best, _ in report.scale_rows(result):
            assert (f"| {label} | {best['size']} | {best['params'] / 1e9:.2f}B | {report.cell(best['peak_rss_gb'])} GiB"
                    if best is not None else f"| {label} | none |") in readme
    for result in report.RAM[:2]:  # the RAM table's peak RSS rows: each round's ratio as memory.py wrote it
        rows = report.load(result.file)["rows"]
        said = [f"{r['rss_vs_lightning']:.3f}x" for r in sorted(rows, key=lambda r: str(r["round"]))
                if r["round"] != "median" and "greedysnake" in r["config"]]
        assert f"| {result.caption} | " in readme and f"| {', '.join(said)} |" in readme
    assert len(readme.splitlines()) <= 150


# --- the site builds -------------------------------------------------------------------------------------

def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip('mkdocs is not installed: pip install -e ".[docs]" (the test extra has it)')
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "NO_MKDOCS_2_WARNING": "1"}
    child = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                           check=False)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-6000:]
    settings = (site / "reference" / "settings" / "index.html").read_text()
    for cls, prefix in ((GreedySnakeConfig, ""), (OffloadConfig, "offload-")):
        for f in dataclasses.fields(cls):
            anchor = (prefix + f.name).replace("_", "-")
            assert f'id="{anchor}"' in settings, f"{f.name} is not on the built settings page"
    assert "usage: python -m lightning_greedysnake.plan" in (site / "reference" / "cli" / "index.html").read_text()
    for png in report.plots():
        assert (site / "img" / "benchmarks" / png.name).exists()
