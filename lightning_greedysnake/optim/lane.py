"""The background lane that runs per-unit optimizer jobs in submission order.

Ordering guarantees (the callers rely on them):

- Jobs run one at a time, in the order submitted: a unit's backward-part job always runs before its
  forward-part (alpha) job, which is submitted later.
- ``submit(..., heavy=True)`` is for jobs that hold a unit's gradient buffer: it blocks while ``lag`` such
  jobs are outstanding, so the optimizer is never more than ``lag`` units behind backward and the
  memory held by queued gradients is bounded. ``lag == 0`` runs every job inline, synchronously,
  except one submitted with ``hold=True``: that waits for :meth:`run_held` (the window's backward is
  done), :meth:`drain`, :meth:`wait_for` or the next job submitted without it, and runs there, on the
  training thread, still in submission order.
- The first exception in a job stops the lane; it is raised in the training thread at the next
  ``submit``, ``drain`` or ``check``. Jobs queued behind it are dropped.
- A job submitted with ``ahead`` (a callable that starts the job's reads if the staging allows, and says
  whether they are under way) has it called on the lane, by the job running before it, once that job's
  own reads are out (:meth:`start_aheads`): the disk reads the next job while the current one computes.
  Only the lane calls them, and never for a job that has started.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch

Job = Callable[[], None]
Ahead = Callable[[], bool]


class OptimizerLaneError(RuntimeError):
    """An optimizer job failed in the background; the original exception is the cause."""


class StepLane:
    def __init__(self, lag: int, on_busy: Callable[[float, float, float], None] | None = None,
                 threads: int = 1) -> None:
        """``on_busy(start, end, cpu_s)``: after every job, its wall interval and the CPU seconds the thread
        that ran it used meanwhile (its own: the kernels' other intra-op threads aside), so that a job's time
        waiting on reads does not read as CPU cost. ``threads``: the intra-op threads of the lane's kernels (planned,
        :func:`lightning_greedysnake.planner.threads.optimizer_threads`); a synchronous lane's jobs run on
        the training thread, with its own."""
        assert threads >= 1, threads
        self.lag = lag
        self.threads = threads
        self._on_busy = on_busy
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Job, bool, Ahead | None]] = deque()
        self._heavy = 0
        self._running = False
        self._error: BaseException | None = None
        self._stop = False
        self.wait_seconds = 0.0
        """Time the training thread spent blocked on this lane (the optimizer work not hidden)."""
        self._waiting = 0
        """The training thread is blocked on this lane (in :meth:`submit` at the lag bound, :meth:`drain` or
        :meth:`wait_for`): it gives nothing back until a job goes on. Written and read under ``_cond``."""
        self._thread: threading.Thread | None = None
        self._closed = False
        self._held: list[Job] = []
        """A synchronous lane's jobs submitted with ``hold``, not run yet (training thread only)."""
        # the thread starts with the first job, so a lane that never runs anything owns no thread

    def _ensure_thread(self) -> bool:
        """Start the worker if this lane runs in the background; False for a synchronous lane."""
        if self.lag == 0 or self._closed:
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="greedysnake-optimizer", daemon=True)
            self._thread.start()
        return True

    def submit(self, job: Job, heavy: bool, hold: bool = False, ahead: Ahead | None = None) -> None:
        """Queue ``job`` (a background lane), or run it now on the calling thread (a synchronous one).
        ``hold``: a synchronous lane keeps it until :meth:`run_held` (see the module's docstring); a
        background lane runs it as any other. ``ahead``: see the module's docstring (a synchronous lane
        has nothing queued to read ahead for)."""
        if not self._ensure_thread():
            if hold:
                self._held.append(job)
            else:
                self.run_held()
                self._run_inline(job)
            return
        with self._cond:
            self._raise_if_failed()
            if heavy and self._heavy >= self.lag:
                t0 = time.perf_counter()
                self._waiting += 1
                while self._heavy >= self.lag and self._error is None:
                    self._cond.wait()
                self._waiting -= 1
                self.wait_seconds += time.perf_counter() - t0
                self._raise_if_failed()
            self._jobs.append((job, heavy, ahead))
            if heavy:
                self._heavy += 1
            self._cond.notify_all()

    def run_held(self) -> None:
        """A synchronous lane: run the held jobs now, in submission order (training thread). The first
        that raises drops the ones behind it, as a background lane drops the jobs queued behind a failure."""
        while self._held:
            job = self._held.pop(0)
            try:
                self._run_inline(job)
            except BaseException:
                self._held.clear()
                raise

    def _run_inline(self, job: Job) -> None:
        # synchronous: the training thread runs the step itself, so all of it is unhidden
        t0 = time.perf_counter()
        try:
            self._run(job)
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def drain(self) -> None:
        """Block until every submitted job has run (raises the lane's error, if any)."""
        self.run_held()
        if self._thread is None:
            return
        with self._cond:
            if self._jobs or self._running:
                t0 = time.perf_counter()
                self._waiting += 1
                while (self._jobs or self._running) and self._error is None:
                    self._cond.wait()
                self._waiting -= 1
                self.wait_seconds += time.perf_counter() - t0
            self._raise_if_failed()

    def wait_for(self, done: threading.Event) -> None:
        """Block until ``done`` is set by a job (counted as unhidden optimizer time)."""
        if done.is_set():
            return
        self.run_held()  # (a held job may be the one that sets it)
        if done.is_set():
            return
        t0 = time.perf_counter()
        with self._cond:
            self._waiting += 1
        try:
            while not done.wait(0.05):
                with self._cond:
                    self._raise_if_failed()
                    if not self._jobs and not self._running and not done.is_set():
                        raise RuntimeError(
                            "greedysnake: waiting for a unit's optimizer step that no job will complete (a step "
                            "was never submitted); this is a bug in greedysnake, please report it."
                        )
        finally:
            with self._cond:
                self._waiting -= 1
        self.wait_seconds += time.perf_counter() - t0

    def start_aheads(self) -> None:
        """Called by a running job once its own reads are under way: start the reads of the jobs queued
        behind it, in order, as far as each one's ``ahead`` succeeds. A job without one, or whose reads
        the staging refused, holds back those behind it, so the staging goes to the job that runs first.
        A no-op off the lane's thread (a synchronous step's)."""
        if self._thread is None or threading.current_thread() is not self._thread:
            return
        with self._cond:
            aheads = [ahead for _, _, ahead in self._jobs]  # (only this thread pops them)
        for ahead in aheads:
            if ahead is None or not ahead():
                return

    def check(self) -> None:
        with self._cond:
            self._raise_if_failed()

    @property
    def failed(self) -> bool:
        with self._cond:
            return self._error is not None

    def others_will_release(self) -> bool:
        """For a staging request that found no room (the pool's ``others_active``): whether the thread on
        the other side of this lane will give buffers back without the caller going on. Asked by the
        training thread: the lane, while it has work. Asked by a job on the lane: the training thread,
        unless it is blocked on this lane, which it leaves only once that job goes on (waiting for its
        buffers waited out the pool's valve, ``FRAGMENTED_WAIT_S``, and then registered a segment anyway)."""
        with self._cond:
            if threading.current_thread() is self._thread:
                return self._waiting == 0
            return bool(self._jobs) or self._running

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise OptimizerLaneError(f"a background optimizer step failed: {self._error}") from self._error

    def _run(self, job: Job) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            job()
        finally:
            if self._on_busy is not None:
                self._on_busy(t0, time.perf_counter(), time.thread_time() - cpu0)

    def _loop(self) -> None:
        # the planned intra-op threads for the optimizer's kernels: one on a CPU run (the training
        # thread's kernels use every core, and two full OpenMP teams spinning against each other slow
        # both down badly), the cores the training and I/O threads leave with a GPU. (The setting is per
        # thread: the training thread keeps its own.)
        torch.set_num_threads(self.threads)
        while True:
            with self._cond:
                while not self._jobs and not self._stop:
                    self._cond.wait()
                if self._stop and not self._jobs:
                    return
                job, heavy, _ = self._jobs.popleft()
                self._running = True
            try:
                self._run(job)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                with self._cond:
                    self._error = e
                    self._jobs.clear()
                    self._heavy = 0
            finally:
                with self._cond:
                    self._running = False
                    if heavy and self._heavy > 0:
                        self._heavy -= 1
                    self._cond.notify_all()

    def set_lag(self, lag: int) -> None:
        """Between steps, with the lane drained (training thread, the only submitter): a new depth. A
        background thread started before stays; a synchronous lane (0) runs every job inline."""
        with self._cond:
            assert not self._jobs and not self._running and not self._heavy and not self._held, "set_lag on a busy lane"
            self.lag = lag

    def close(self) -> None:
        """Finish queued jobs (unless one failed) and stop the thread. Idempotent; never raises."""
        try:
            self.run_held()  # (as a background lane finishes what was queued)
        except BaseException:  # noqa: BLE001 - never raises: the failure surfaced where the run stopped
            pass
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread.join()
