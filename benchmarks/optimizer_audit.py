"""Every optimizer in pytorch-optimizer's registry, and every optimizer class of the other libraries users bring
(``LIBRARIES``: torch-optimizer, lion-pytorch, came-pytorch, schedulefree, transformers), against greedysnake's
optimizer contract (``tests/optimizer_registry.py``): trained under ``strategy="auto"`` and under greedysnake with every kind on
SSD and with the planned defaults, each exact (weights and every window's gradient to 1e-5) or refused
before any step; never silently different. Writes ``benchmarks/results/optimizer_audit.json``, which the
docs' supported-optimizers table is rendered from (``docs/reference/status.md``), and prints the counts.

    python benchmarks/optimizer_audit.py [--names lamb adabelief ...] [--out PATH]

A CPU run of a few minutes (three small fits per optimizer); the main test suite runs a fixed sample of it
(``tests/integration/test_optimizer_registry.py``) and checks this file covers the registry.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import sys
import time
import warnings
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.optimizer_registry import LIBRARIES, audit, library_classes, reason_of  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "optimizer_audit.json"


def main() -> int:
    import pytorch_optimizer
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", nargs="*", help="registry names (default: the whole registry)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)  # (this process's output: one line an optimizer)
    for logger in ("lightning", "lightning.pytorch", "lightning_greedysnake", "lightning.fabric"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    names = args.names or [*pytorch_optimizer.get_supported_optimizers(),
                           *(name for library in LIBRARIES for name in library_classes(library))]
    torch.set_num_threads(1)
    rows, start = [], time.time()
    for name in names:
        row = audit(name)
        rows.append(row.as_dict())
        print(f"{name:22s} {'does not train under auto: ' + row.auto if row.auto else row.outcomes}", flush=True)
    counts: collections.Counter[str] = collections.Counter()
    others: collections.Counter[str] = collections.Counter()
    for row in rows:
        tally = others if "." in row["name"] else counts  # (the other libraries' classes, by qualified name)
        if row["auto"]:
            tally["does not train under strategy='auto'"] += 1
            continue
        outcomes = set(row["outcomes"].values())
        if outcomes <= {"exact"}:
            tally["exact"] += 1
        elif outcomes <= {"exact", "exact to rounding"}:
            tally["exact (to rounding on some path)"] += 1
        elif outcomes <= {"refused"}:
            tally[f"refused ({reason_of(next(iter(row['details'].values())))})"] += 1
        else:
            tally["NOT ALLOWED: " + "/".join(sorted(outcomes))] += 1
    result = {"registry": "pytorch-optimizer", "version": version("pytorch-optimizer"), "torch": torch.__version__,
              "command": "python benchmarks/optimizer_audit.py", "seconds": round(time.time() - start),
              "counts": dict(sorted(counts.items())), "libraries": list(LIBRARIES),
              "other_counts": dict(sorted(others.items())), "rows": rows}
    if not args.names:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"registry": result["counts"], "other libraries": result["other_counts"]}, indent=1))
    return 1 if any(k.startswith("NOT ALLOWED") for k in (*counts, *others)) else 0


if __name__ == "__main__":
    raise SystemExit(main())
