"""The start-of-run report on the example's model (``examples/train_gpt.py`` as ``conf/`` configures it: the
0.9M GPT, K=4, 32-true), in a real fit of a few steps: its numbers come from one model and are plausible.

- the peak the host memory line expects is within 2x of the process's measured peak RSS (the RSS at
  setup plus what greedysnake holds, not the whole host budget);
- one disk speed: every GB/s figure of the disk in the report is the one probe's;
- no ``inf`` anywhere (a run with nothing on SSD says so instead);
- the warm-step plan prints its predicted step beside the measured one;
- every kind the placement table puts on SSD is in the offload directory's breakdown, or both say why not
  in the same words (under 32-true the weights are the master copy);
- the terms the report uses (roofline, lane, binding resource, host budget, staging) are named once with
  the glossary's path, and the glossary has them.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

import lightning as L
import pytest

from lightning_greedysnake.strategy.planning.planner import PLAN_STEP
from lightning_greedysnake.strategy.report import GLOSSARY, GLOSSARY_TERMS, TERMS

ROOT = Path(__file__).resolve().parents[2]
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def peak_rss_bytes() -> int:
    """The process's peak RSS since :func:`reset_peak_rss` (``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    """The peak RSS from now on (Linux: ``5`` to ``/proc/self/clear_refs``), so that what earlier tests of
    this process held does not count."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as e:
        pytest.skip(f"the peak RSS cannot be reset here ({e})")


class Captured(logging.Handler):
    """Lightning's log (``rank_zero_info``, the report's channel), as caplog would hold it."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@functools.cache
def fit_the_example(*overrides: str) -> tuple[str, int, int]:
    """The example's model, data, module, strategy and trainer from ``conf/`` (``overrides`` on top), fitted
    for one step past the warm-step plan; the report (the log), the process's peak RSS during the fit and
    how many times the disk was probed. Once per ``overrides`` (the tests read the same report)."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from lightning_greedysnake.recipes import GPTLightningModule
    from lightning_greedysnake.strategy.planning import measurements as measure

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose("config", overrides=["data.max_bytes=200000", *overrides])
    strategy = instantiate(cfg.strategy)
    L.seed_everything(cfg.seed, verbose=False)
    module = GPTLightningModule(instantiate(cfg.model), **cfg.module)
    trainer_args = {**OmegaConf.to_container(cfg.trainer, resolve=True), "max_steps": PLAN_STEP + 1,
                    "limit_val_batches": 0, "enable_progress_bar": False, "enable_model_summary": False,
                    "logger": False}
    trainer = L.Trainer(**trainer_args, strategy=strategy, default_root_dir=Path.cwd())
    log, captured = logging.getLogger("lightning.pytorch"), Captured()
    level = log.level
    log.addHandler(captured)
    log.setLevel(logging.INFO)
    probes, probe = [], measure.request_bandwidth  # (every disk probe of a run goes through the run's Measurements)
    measure.request_bandwidth = lambda *args, **kwargs: probes.append(args) or probe(*args, **kwargs)
    reset_peak_rss()
    try:
        trainer.fit(module, instantiate(cfg.data))
    finally:
        measure.request_bandwidth = probe
        log.removeHandler(captured)
        log.setLevel(level)
    return "\n".join(captured.lines), peak_rss_bytes(), len(probes)


def human(text: str) -> int:
    number, unit = text.split()
    return int(float(number) * UNITS[unit])


def disk_speeds(report: str) -> set[tuple[str, float]]:
    """Every disk speed in ``report``: ``read/write X GB/s`` in a line, and a table's ``read GB/s`` /
    ``write GB/s`` columns."""
    speeds = {(op, float(x)) for op, x in re.findall(r"\b(read|write)\w*[ :]+([0-9.]+) GB/s", report)}
    lines = report.splitlines()
    for i, line in enumerate(lines):
        header = re.split(r"\s{2,}", line.strip())
        columns = {j: name.split()[0] for j, name in enumerate(header) if name in ("read GB/s", "write GB/s")}
        if not columns:
            continue
        for row in lines[i + 1:]:
            cells = row.split()
            if len(cells) < len(header) or not re.fullmatch(r"\d+", cells[0]):
                break
            speeds |= {(op, float(cells[j])) for j, op in columns.items()}
    return speeds


@pytest.mark.parametrize("overrides", [(), ("strategy=greedysnake",)], ids=["ssd", "planned-in-ram"])
def test_the_start_of_run_report_on_the_example_is_one_models_and_plausible(overrides):
    report, peak, probes = fit_the_example(*overrides)

    expected = re.search(r"Expect the process to peak near ([0-9.]+ [KMGT]?i?B)", report)
    assert expected, report[-3000:]
    estimate = human(expected[1])
    assert peak / 2 <= estimate <= 2 * peak, (f"expected peak {expected[1]} against {peak / 2**20:.0f} MiB measured",
                                              report[-3000:])

    speeds = disk_speeds(report)
    assert len({s for s in speeds if s[0] == "read"}) <= 1 and len({s for s in speeds if s[0] == "write"}) <= 1, (
        speeds, report[-3000:])
    if not overrides:  # (the example's default keeps state on SSD: the disk was probed, at setup, and said)
        assert speeds and "setup's probe" in report, report[-3000:]
    assert probes == (0 if overrides else 1), probes  # once a run (one directory), and only where state is on SSD

    assert not re.search(r"\binf\b", report), report[-3000:]

    plan = report[report.index("greedysnake auto plan"):]
    predicted = re.search(r"predicted step \(s\)\s+([0-9.]+)", plan)
    measured = re.search(r"measured step \(s\)\s+([0-9.]+)", plan)
    assert predicted and measured, plan[:3000]

    # the terms: the glossary named (once a message), and it defines them (tests/unit/test_docs.py: a heading each)
    assert TERMS == "(terms: docs/concepts/glossary.md)" and TERMS in report, report[-3000:]
    assert all(line.count(TERMS) <= 1 for line in report.splitlines())
    text = (ROOT / GLOSSARY).read_text().lower()
    assert all(term in text for term in GLOSSARY_TERMS)


def test_every_kind_the_placement_table_puts_on_ssd_is_in_the_directory_breakdown_or_both_say_why_not():
    """The example's default (32-true, weights, master weights and optimizer state on SSD): there are no
    master weights under 32-true (the weights are the master copy); the placement table and the offload
    directory's breakdown say so in the same words, and every other kind on SSD has its line there."""
    report, _, _ = fit_the_example()
    table = report[report.index("greedysnake placement plan"):].split("\n")[1:]
    directory = report[report.index("greedysnake offload_dir="):].split("\n")[1:]
    directory = directory[:next(i for i, line in enumerate(directory) if "total needed" in line)]
    rows = {}
    for line in table:
        name = line.split()[0] if line.strip() else ""
        if name not in ("weights", "master_weights", "optimizer_states", "gradients"):
            break
        rows[name] = line[len(name):].replace("(yours)", "").strip()
    on_ssd = [name for name, value in rows.items() if "ssd" in value or "none" in value]
    assert "master_weights" in on_ssd, rows
    for name in on_ssd:
        said = [line.strip()[len(name):].strip() for line in directory if line.strip().split()[0] == name]
        assert said, (name, rows, directory)
        if "none" in rows[name]:  # why not: the same words in both places
            reason = rows[name][rows[name].index("none"):]
            assert said[0] == reason, (said, rows[name])
    assert "the weights are the master copy" in rows["master_weights"]
