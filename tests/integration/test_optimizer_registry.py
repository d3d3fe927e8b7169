"""What users bring: pytorch-optimizer's registry against the optimizer contract (``tests/optimizer_registry.py``).

Every optimizer of the installed registry is trained here (about a minute in all); a sample of them is held to
the path it must take, covering every path the contract has (whole parameters with a step count in the param
groups, in ``state`` under a key that is no parameter, with state of other shapes in host memory or in lists;
refused for coupling parameters through a param-group estimate or through the weights, for needing the
closure or the loss it returns, for drawing random numbers in its step, for a state kind it cannot stream).
``benchmarks/optimizer_audit.py`` writes the same audit as the docs' table, checked here to cover the registry
with nothing silently different.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

from tests.optimizer_registry import LIBRARIES, audit, library_classes, reason_of  # noqa: E402

AUDIT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "optimizer_audit.json"

SAMPLE: dict[str, str] = {
    "adabelief": "exact",  # element-wise math, probed: whole parameters; group['step']
    "lamb": "exact",  # a trust ratio per parameter; group['step']
    "madgrad": "exact",  # its step count in state['k'], a key that is no parameter
    "came": "exact",  # factored second moment: row and column state in host memory
    "soap": "exact",  # state in lists of tensors (its preconditioner's bases), in host memory
    "scionlight": "exact",  # orthogonalized updates: the vertical order's rounding, amplified (exact to rounding)
    "dadaptadam": "refused (coupled)",  # an estimate over all parameters in the param groups
    "adagc": "refused (coupled)",  # the weights' update reads other parameters' gradients
    "gravity": "refused (random)",  # draws random numbers in its step
    "schedulefreeadamw": "refused (modes)",  # optimizer.train()/eval() swap a second weight sequence in
    "alig": "refused (closure)",  # needs the closure
    "emonavi": "refused (closure)",  # reads the loss the closure returns
    "sara": "refused (state kind)",  # a bool mask per element
}
"""Registry name -> what it must be, on every path (one of each of the contract's paths)."""


def _verdict(outcome: str, detail: str) -> str:
    if outcome in ("exact", "exact to rounding"):
        return "exact"
    return f"refused ({reason_of(detail)})" if outcome == "refused" else outcome


@pytest.mark.parametrize("name", pytorch_optimizer.get_supported_optimizers())
def test_every_registry_optimizer_is_exact_or_refused_clearly(name):
    """Trained under strategy="auto", then with every kind on SSD and with the planned defaults: weights and
    every window's gradients to 1e-5 (an orthogonalizing update within twice what auto itself moves with each
    window summed in reverse order, its first window's gradients to 1e-6), or refused before any step with a
    message naming the class and the fix; never different, never a raw error."""
    row = audit(name)
    if row.auto is not None:
        assert name not in SAMPLE
        pytest.skip(f"does not train under strategy='auto' either: {row.auto}")
    assert set(row.outcomes) == {"ssd", "planned"}
    for path, outcome in row.outcomes.items():
        verdict = _verdict(outcome, row.details[path])
        assert verdict == "exact" or verdict.startswith("refused"), (path, outcome, row.details[path])
        if name in SAMPLE:
            assert verdict == SAMPLE[name], (path, outcome, row.details[path])
        if outcome == "refused":
            assert "Fix:" in row.details[path] and row.cls in row.details[path]
    if name in SAMPLE and SAMPLE[name] == "exact":
        assert row.moved > 1e-3, "the optimizer must move the weights for the comparison to mean anything"


OTHERS = [name for library in LIBRARIES for name in library_classes(library)]


@pytest.mark.parametrize("name", OTHERS)
def test_every_optimizer_of_other_libraries_is_exact_or_refused_clearly(name):
    """The same, for every optimizer class of the other libraries users bring (torch-optimizer, lion-pytorch,
    came-pytorch, schedulefree, transformers' Adafactor)."""
    row = audit(name)
    if row.auto is not None:
        pytest.skip(f"does not train under strategy='auto' either: {row.auto}")
    for path, outcome in row.outcomes.items():
        verdict = _verdict(outcome, row.details[path])
        assert verdict == "exact" or verdict.startswith("refused"), (path, outcome, row.details[path])
        if outcome == "refused":
            assert "Fix:" in row.details[path] and row.cls in row.details[path]


def test_the_whole_registry_was_audited_with_nothing_silently_different():
    """The committed audit (``benchmarks/optimizer_audit.py``, the docs' table) covers every optimizer of the
    installed registry, and none of them trained differently or failed inside a fit."""
    import pytorch_optimizer

    result = json.loads(AUDIT.read_text())
    if result["version"] != version("pytorch-optimizer"):
        pytest.skip(f"the audit ran on pytorch-optimizer {result['version']}; {version('pytorch-optimizer')} is here")
    every = {row["name"]: row for row in result["rows"]}
    rows = {name: row for name, row in every.items() if "." not in name}  # (the other libraries' by qualified name)
    assert set(rows) == set(pytorch_optimizer.get_supported_optimizers())
    bad = {name: row["details"] for name, row in every.items()
           if set(row["outcomes"].values()) - {"exact", "exact to rounding", "refused"}}
    assert not bad, bad
    for name, expected in SAMPLE.items():  # (what the sample shows here, the audit showed there)
        assert {_verdict(o, rows[name]["details"][p]) for p, o in rows[name]["outcomes"].items()} == {expected}, name
