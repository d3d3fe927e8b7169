"""The optimizer lane's ordering: a synchronous lane (``lag=0``) runs jobs inline, except the ones held
for the end of the window's backward, which still run in submission order, before anything that could
need them."""

from __future__ import annotations

import threading

import pytest

from lightning_greedysnake.optim.lane import StepLane


def _recording(ran: list[str], name: str, fail: bool = False):
    def job() -> None:
        if fail:
            raise RuntimeError(f"{name} failed")
        ran.append(name)

    return job


def test_a_synchronous_lane_runs_a_held_job_only_when_the_backward_is_done():
    lane, ran = StepLane(lag=0), []
    lane.submit(_recording(ran, "a"), heavy=True, hold=True)
    lane.submit(_recording(ran, "b"), heavy=True, hold=True)
    assert ran == []
    lane.run_held()
    assert ran == ["a", "b"]
    lane.run_held()  # (nothing left)
    assert ran == ["a", "b"]


def test_a_job_submitted_without_hold_runs_after_the_held_ones():
    lane, ran = StepLane(lag=0), []
    lane.submit(_recording(ran, "held"), heavy=True, hold=True)
    lane.submit(_recording(ran, "now"), heavy=False)
    assert ran == ["held", "now"]


@pytest.mark.parametrize("how", ["drain", "wait_for", "close"])
def test_drain_wait_for_and_close_run_the_held_jobs(how):
    lane, ran, done = StepLane(lag=0), [], threading.Event()

    def sets_done() -> None:
        ran.append("step")
        done.set()

    lane.submit(sets_done, heavy=True, hold=True)
    {"drain": lane.drain, "wait_for": lambda: lane.wait_for(done), "close": lane.close}[how]()
    assert ran == ["step"] and done.is_set()


def test_waiting_for_a_step_already_done_runs_nothing_held():
    lane, ran, done = StepLane(lag=0), [], threading.Event()
    done.set()
    lane.submit(_recording(ran, "held"), heavy=True, hold=True)
    lane.wait_for(done)
    assert ran == []


def test_a_failed_held_job_drops_the_ones_behind_it():
    lane, ran = StepLane(lag=0), []
    lane.submit(_recording(ran, "a"), heavy=True, hold=True)
    lane.submit(_recording(ran, "b", fail=True), heavy=True, hold=True)
    lane.submit(_recording(ran, "c"), heavy=True, hold=True)
    with pytest.raises(RuntimeError, match="b failed"):
        lane.run_held()
    assert ran == ["a"]
    lane.drain()
    assert ran == ["a"]


def test_a_background_lane_runs_a_held_job_as_any_other():
    lane, ran = StepLane(lag=1), []
    try:
        lane.submit(_recording(ran, "a"), heavy=True, hold=True)
        lane.drain()
        assert ran == ["a"]
    finally:
        lane.close()


def test_a_lane_holding_jobs_cannot_change_its_lag():
    lane = StepLane(lag=0)
    lane.submit(lambda: None, heavy=True, hold=True)
    with pytest.raises(AssertionError, match="busy lane"):
        lane.set_lag(1)
    lane.run_held()
    lane.set_lag(1)
