"""pytest under a watchdog, so that a hung test costs that test and not the stage (``gpu_session.sh``'s
CUDA tests):

    python benchmarks/pytest_stage.py --out DIR --budget-s 150 --test-timeout-s 60 -- -m gpu tests/gpu

Every test's outcome is appended to ``DIR/tests.jsonl`` as it finishes (this module is also the pytest
plugin that writes it: ``-p pytest_stage``). Two timeouts, each test:

- pytest-timeout's ``--timeout`` (where it is installed), signal method: a test hung in Python code
  (a lock, an ``Event.wait``) fails with its stack and pytest goes on in the same process;
- this watchdog, ``--grace-s`` later (at once without pytest-timeout): a test hung where no signal reaches
  (a CUDA synchronize, a C++ join) has its pytest killed, is recorded ``hung``, and pytest starts again
  on the tests not yet run (``--deselect`` of every test with an outcome); likewise a test during which
  pytest died (``crashed``: a segfault, an abort).

A restart repeats collection and CUDA's start (~10-20 s on a GPU machine). The stage ends when pytest
exits by itself or ``--budget-s`` is spent (the test running then is recorded ``out_of_time``). Exit
status: 0 when every test passed or was skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROGRESS_ENV = "GREEDYSNAKE_TEST_PROGRESS"
"""The JSON-lines file the plugin appends to (set by the watchdog for its pytest)."""


# ---- the plugin (loaded by pytest in the watched process) ----

_outcomes: dict[str, str] = {}


def _append(path: str | Path, event: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _write(event: dict[str, Any]) -> None:
    if os.environ.get(PROGRESS_ENV):
        _append(os.environ[PROGRESS_ENV], event)


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _write({"event": "start", "nodeid": nodeid, "t": time.time()})


def pytest_runtest_logreport(report: Any) -> None:
    worse = report.when == "call" or report.outcome != "passed"  # (a failed or skipped setup or teardown too)
    if worse and _outcomes.get(report.nodeid) in (None, "passed"):
        _outcomes[report.nodeid] = report.outcome
    if report.when == "teardown":
        _write({"event": "end", "nodeid": report.nodeid, "outcome": _outcomes.pop(report.nodeid, "passed"),
                "t": time.time()})


# ---- the watchdog ----

def _read(path: Path) -> list[dict[str, Any]]:
    events = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # (a line cut by a kill)
                continue
    return events


def _running(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The test started and not yet ended, if any."""
    ended = {e["nodeid"] for e in events if e["event"] == "end"}
    started = [e for e in events if e["event"] == "start" and e["nodeid"] not in ended]
    return started[-1] if started else None


def run(pytest_args: list[str], out: Path, budget_s: float, test_timeout_s: float, grace_s: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    progress = out / "tests.jsonl"
    log = out / "tests.log"
    deadline = time.monotonic() + budget_s
    has_timeout = importlib.util.find_spec("pytest_timeout") is not None
    kill_after = test_timeout_s + (grace_s if has_timeout else 0.0)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                    os.environ.get("PYTHONPATH")])))
    env[PROGRESS_ENV] = str(progress)
    env["PYTHONUNBUFFERED"] = "1"
    base = [sys.executable, "-m", "pytest", "-p", "pytest_stage", "-p", "no:cacheprovider", "-q", "-rfE",
            *([f"--timeout={test_timeout_s:.0f}", "--timeout-method=signal"] if has_timeout else [])]
    print(f"  pytest-timeout {'installed: each test fails after' if has_timeout else 'missing: each test is killed after'} "
          f"{test_timeout_s:.0f} s; the watchdog kills after {kill_after:.0f} s", file=sys.stderr)
    status = None
    while True:
        done = [e["nodeid"] for e in _read(progress) if e["event"] == "end"]
        cmd = [*base, *pytest_args, *(a for nodeid in done for a in ("--deselect", nodeid))]
        with open(log, "a") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            stopped = None
            try:
                while (status := proc.poll()) is None:
                    time.sleep(0.5)
                    running = _running(_read(progress))
                    if time.monotonic() > deadline:
                        stopped = "out_of_time"
                    elif running is not None and time.time() - running["t"] > kill_after:
                        stopped = "hung"
                    if stopped:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                        break
            except BaseException:  # (this watchdog stopped: SIGTERM from the stage's timeout, Ctrl-C) pytest too
                os.killpg(proc.pid, signal.SIGKILL)
                raise
        running = _running(_read(progress))
        if stopped is None and running is not None:  # pytest died inside a test (a crash, a signal)
            stopped = "crashed"
        if running is not None:
            _append(progress, {"event": "end", "nodeid": running["nodeid"], "outcome": stopped, "t": time.time()})
        if stopped:
            print(f"  {stopped}: {running['nodeid'] if running else '(between tests)'}"
                  f"{': pytest killed' if stopped != 'crashed' else f': pytest exit status {status}'}", file=sys.stderr)
        if stopped not in ("hung", "crashed"):
            break
    events = _read(progress)
    outcomes = [e["outcome"] for e in events if e["event"] == "end"]
    counts = {o: outcomes.count(o) for o in sorted(set(outcomes))}
    print(f"  tests: {counts or 'none ran'} (pytest exit status {status}; {log}, {progress})", file=sys.stderr)
    clean = status in (0, 5) if status is not None else False  # (5: nothing collected, e.g. all deselected)
    return 0 if clean and set(outcomes) <= {"passed", "skipped"} else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the folder of tests.jsonl and tests.log")
    parser.add_argument("--budget-s", type=float, required=True, help="the stage's seconds, restarts included")
    parser.add_argument("--test-timeout-s", type=float, default=60.0, help="one test's seconds")
    parser.add_argument("--grace-s", type=float, default=20.0,
                        help="after pytest-timeout's own timeout, before the watchdog kills pytest")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- then pytest's arguments")
    args = parser.parse_args()
    # (SIGTERM, the stage's timeout, raises: run() kills its pytest on the way out)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    sys.exit(run(pytest_args, Path(args.out), args.budget_s, args.test_timeout_s, args.grace_s))


if __name__ == "__main__":
    main()
