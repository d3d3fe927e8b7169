"""The SSD tier in real Trainer runs: I/O volume from the counters, O_DIRECT really on, hygiene (files,
threads, descriptors, lock), and errors before any work starts."""

from __future__ import annotations

import os
import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig
from lightning_greedysnake.offload import OffloadDirLock
from lightning_greedysnake.offload.device import SIMULATE_ENV
from lightning_greedysnake.offload.preflight import LockRecord
from lightning_greedysnake.config import REGION_KINDS
from lightning_greedysnake.tensor_manager import TieredTensorStore
from tests.helpers import TinyGPTModule, make_trainer, mounted, token_loader

LR = 3e-3


class Snapshot(L.Callback):
    """The tensor manager's counters at the end of training (before teardown reads weights back)."""

    def on_train_end(self, trainer: Any, module: Any) -> None:
        manager = trainer.strategy.tensor_manager
        assert isinstance(manager, TieredTensorStore)
        manager.drain()  # count the steps and the write-behind still in flight
        self.manager = manager
        self.stats = manager.stats.copy()
        self.region_bytes = {kind.value: [manager.region_bytes(kind, u) for u in range(manager.num_units)]
                             for kind in REGION_KINDS}
        self.loads = dict(manager.weights.weight_loads)
        self.steps = trainer.global_step
        self.files = list(manager.files)
        self.direct = {str(f.path): _has_o_direct(f.fd) for f in [*manager.arena.regions.open_files(), *manager.activations.open_files()]}


def _has_o_direct(fd: int | None) -> bool:
    assert fd is not None
    flags = int(Path(f"/proc/self/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
    return bool(flags & os.O_DIRECT)


def _fit(strategy: Any, k: int, steps: int = 3, n_layer: int = 3, callbacks: list | None = None, **kwargs: Any):
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=n_layer, lr=LR)
    trainer = make_trainer(strategy, k, callbacks=callbacks or [], max_epochs=1, **kwargs)
    trainer.fit(module, token_loader(steps * k))
    return trainer, module


@pytest.mark.parametrize("k", [1, 4])
def test_weights_read_per_step_vertical_once_per_pass_horizontal_2k(k):
    """From the byte counters: the vertical order reads each unit's compute weights twice per step (the
    fused last unit once) whatever K is; the horizontal order 2K times. Gradients never touch the SSD in
    the vertical order; horizontally each unit's partial gradient goes out and back between micro-batches."""
    per_step = {}
    for schedule in ("vertical", "horizontal"):
        snap = Snapshot()
        _fit(GreedySnakeStrategy(auto=False, schedule=schedule, alpha=0.0), k, callbacks=[snap])
        assert snap.steps == 3
        w = snap.region_bytes["weights"]
        g = snap.region_bytes["gradients"]
        read = snap.stats.bytes_read("weights") / snap.steps
        per_step[schedule] = read
        loads = {u: n / snap.steps for u, n in snap.loads.items()}
        # every acquisition is one read from the SSD, but unit 0's first after each step: its step, the
        # window's last, left the new weights in memory for it
        assert read * snap.steps == sum(loads[u] * w[u] for u in loads) * snap.steps - (snap.steps - 1) * w[0]
        if schedule == "vertical":
            assert loads == {0: 2, 1: 2, 2: 1}
            assert snap.stats.bytes_written("gradients") == 0
            assert snap.stats.bytes_read("gradients") == 0
        else:
            # unit 0 stays held from one micro-batch's backward into the next one's forward
            assert loads == {0: k + 1, 1: 2 * k, 2: k}
            # out after every micro-batch but the last and back: the last one's backward completes each
            # gradient, and its step follows right away
            assert snap.stats.bytes_written("gradients") / snap.steps == (k - 1) * sum(g)
            assert snap.stats.bytes_read("gradients") / snap.steps == (k - 1) * sum(g)
        # the optimizer: fp32 master weights are the weights region, read only when not already in
        # memory (in either order each unit's step follows its last backward: it is); state read after step 1
        s = snap.region_bytes["optimizer_states"]
        assert snap.stats.bytes_written("optimizer_states") == snap.steps * sum(s)
        assert snap.stats.bytes_read("optimizer_states") == (snap.steps - 1) * sum(s)
        master_reads = snap.stats.bytes_read("master_weights") / snap.steps
        assert master_reads == 0
        assert snap.stats.bytes_written("weights") == snap.steps * sum(w) + sum(w)  # + the initial write
    if k > 1:
        assert per_step["horizontal"] > (k - 1) * per_step["vertical"]


def test_the_deferred_part_moves_only_its_own_bytes():
    """alpha > 0: each step's forward part re-reads its range of the (fp32 master =) weights and its
    gradient range goes to the gradients tier and back; nothing else changes."""
    snap = Snapshot()
    alpha = 0.5
    _fit(GreedySnakeStrategy(auto=False, alpha=alpha), 2, callbacks=[snap])
    manager = snap.manager
    from lightning_greedysnake.config import TensorKind

    deferring = [u for u in range(3) if manager.stepper.defers(u)]
    assert deferring == [1, 2]  # unit 0's step ends the window: never deferred
    grad_range = sum(manager.deferred_bytes(TensorKind.GRADIENTS, u) for u in deferring)
    weight_range = sum(manager.deferred_bytes(TensorKind.WEIGHTS, u) for u in deferring)
    assert 0 < grad_range < sum(snap.region_bytes["gradients"])
    assert snap.stats.bytes_written("gradients") == snap.steps * grad_range
    assert snap.stats.bytes_read("gradients") == snap.steps * grad_range
    assert snap.stats.bytes_read("master_weights") == snap.steps * weight_range
    assert snap.stats.bytes_written("weights") == snap.steps * sum(snap.region_bytes["weights"]) + sum(
        snap.region_bytes["weights"])


def test_offload_files_use_o_direct_and_owner_only_permissions(tmp_path):
    snap = Snapshot()
    _fit(GreedySnakeStrategy(auto=False, offload_dir=tmp_path / "off", offload={"keep_files": True}), 2, callbacks=[snap])
    assert snap.direct and all(snap.direct.values()), snap.direct
    for path in snap.files:
        assert path.exists()
        assert path.stat().st_mode & 0o777 == 0o600


def test_host_placement_never_touches_the_disk(tmp_path):
    snap = Snapshot()
    _fit("greedysnake_cpu", 2, callbacks=[snap], default_root_dir=tmp_path)
    assert snap.files == []
    assert snap.stats.snapshot() == {}
    assert not (tmp_path / "greedysnake_offload").exists()


@pytest.mark.parametrize("placement", ["host", "ssd"])
def test_the_heap_is_trimmed_after_each_step_only_where_state_streams(placement, tmp_path, monkeypatch):
    """Every kind in RAM: the heap is left to the allocator, as in Lightning (trimming gave back pages the
    next micro-batch faulted in again), but for the optimizer's first step, whose new state is copied into
    the store's buffers and freed (on the lane's thread no other thread reuses that memory); state on SSD,
    or a device tier (CI's simulated one): each unit's step gives the freed pages back."""
    import lightning_greedysnake.optim.part_step as part_step

    seen: list[bool] = []

    class Trims(L.Callback):
        def on_train_end(self, trainer: Any, module: Any) -> None:
            seen.append(trainer.strategy.tensor_manager.trims_heap)

    trims: dict[int, int] = {}
    for steps in (1, 3):
        calls: list[int] = []
        monkeypatch.setattr(part_step, "trim_heap", calls.append)
        _fit(GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere(placement)), 2, steps=steps,
             callbacks=[Trims()], default_root_dir=tmp_path / str(steps))
        trims[steps] = len(calls)
    trimming = placement == "ssd" or os.environ.get(SIMULATE_ENV) == "1"  # (a device tier trims too)
    assert seen == [trimming, trimming]
    assert trims[1] > 0  # (the first step's parts)
    assert trims[3] == (3 if trimming else 1) * trims[1]


def test_the_heap_is_trimmed_once_when_the_warm_step_plan_reconfigures(tmp_path, monkeypatch):
    """The planned defaults (every kind in RAM here): the pages freed by the steps before the plan (on the
    lane's thread too) go back to the OS once, when the plan's settings take over; without it a RAM run's
    peak RSS crept from step to step (see ``TieredTensorStore.reconfigure``)."""
    import lightning_greedysnake.tensor_manager as tensor_manager

    trims: list[bool] = []
    strategy = GreedySnakeStrategy(offload_dir=tmp_path / "off")
    monkeypatch.setattr(tensor_manager, "trim_heap", lambda *a: trims.append(strategy.plan_choice is not None))
    _fit(strategy, 2, steps=4, default_root_dir=tmp_path)
    assert trims == [True]  # once, with the plan's choice made


def _io_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("greedysnake-io")]


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_teardown_removes_files_threads_descriptors_and_lock(tmp_path):
    fds_before = _open_fds()
    snap = Snapshot()
    _fit(GreedySnakeStrategy(auto=False), 2, callbacks=[snap], default_root_dir=tmp_path)
    assert snap.files and all(str(p).startswith(str(tmp_path)) for p in snap.files)
    assert not any(p.exists() for p in snap.files)
    assert not (tmp_path / "greedysnake_offload").exists()  # created by us, removed when empty
    assert _io_threads() == []
    assert _open_fds() <= fds_before


class Boom(RuntimeError):
    pass


def test_a_crash_mid_training_cleans_up_too(tmp_path):
    fds_before = _open_fds()
    offload_dir = tmp_path / "off"

    class Crashing(TinyGPTModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == 2:
                raise Boom("simulated failure")
            return super().training_step(batch, batch_idx)

    L.seed_everything(0, verbose=False)
    trainer = make_trainer(GreedySnakeStrategy(auto=False, offload_dir=offload_dir), 2, max_epochs=1)
    with pytest.raises(Boom):
        trainer.fit(Crashing(lr=LR), token_loader(8))
    assert not offload_dir.exists()  # its files removed, and the directory greedysnake created
    assert _io_threads() == []
    assert _open_fds() <= fds_before


def test_a_crash_keeps_a_user_directory_and_releases_its_lock(tmp_path):
    class Crashing(TinyGPTModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise Boom("simulated failure")

    (tmp_path / "mine.txt").write_text("user data")
    with pytest.raises(Boom):
        make_trainer(GreedySnakeStrategy(auto=False, offload_dir=tmp_path), 2, max_epochs=1).fit(Crashing(), token_loader(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
    lock = OffloadDirLock(tmp_path)
    lock.acquire()  # the crashed run's lock was released
    lock.release()


def test_trained_weights_are_back_in_the_module_after_fit():
    trainer, module = _fit(GreedySnakeStrategy(auto=False), 2)
    for p in module.parameters():
        assert p.is_contiguous() and torch.isfinite(p).all()
    ref_trainer, ref = _fit(GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("device")), 2)
    for (n, a), (_, b) in zip(module.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_return_weights_false_leaves_placeholders():
    _, module = _fit(GreedySnakeStrategy(auto=False, offload={"return_weights": False}), 2)
    p = next(module.parameters())
    assert p.stride() == (0,) * p.dim() and torch.isnan(p).all()


# -- errors before any work --------------------------------------------------------------------------
class NeverTrained(TinyGPTModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise AssertionError("training started despite a bad offload setting")


def _fit_never(strategy: Any) -> None:
    make_trainer(strategy, 2, max_epochs=1).fit(NeverTrained(), token_loader(4))


def test_offload_dir_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ValueError, match=r"offload_dir=.*is a file.*Fix"):
        _fit_never(GreedySnakeStrategy(auto=False, offload_dir=target))


def test_offload_dir_in_use_by_another_run_is_refused(tmp_path):
    other = OffloadDirLock(tmp_path)
    other.acquire()
    try:
        with pytest.raises(ValueError, match=r"in use by another greedysnake run.*Fix"):
            _fit_never(GreedySnakeStrategy(auto=False, offload_dir=tmp_path))
    finally:
        other.release()


def test_files_a_run_kept_are_never_overwritten_by_the_next_run(tmp_path):
    """keep_files=True leaves the files for inspection: the next run in that directory refuses to start,
    naming them and the fix, before any work, and leaves them byte for byte (it used to overwrite and
    then delete them, silently)."""
    offload_dir = tmp_path / "off"
    _fit(GreedySnakeStrategy(auto=False, offload_dir=offload_dir, offload={"keep_files": True}), 2, steps=1)
    kept = {p.name: p.read_bytes() for p in offload_dir.iterdir()}
    assert {"weights.bin", "optimizer_states.bin", ".greedysnake.lock"} <= kept.keys(), kept.keys()
    record = LockRecord.parse(kept[".greedysnake.lock"])  # greedysnake's mark on the files it kept
    assert record is not None and record.keep_files and record.files is not None
    assert set(record.files) == kept.keys() - {".greedysnake.lock"}
    for keep in (False, True):  # (whatever this run would do with its own files at its end)
        with pytest.raises(ValueError, match=(
                rf"offload_dir='{re.escape(str(offload_dir))}'.*another greedysnake run \(pid {os.getpid()}\) kept "
                r"there \(offload.keep_files=True\): weights.bin \(.*optimizer_states.bin.*would overwrite them. Fix: "
                r"give this run another offload directory.*or delete those files")):
            _fit_never(GreedySnakeStrategy(auto=False, offload_dir=offload_dir, offload={"keep_files": keep}))
        assert {p.name: p.read_bytes() for p in offload_dir.iterdir()} == kept  # (the record as it was, too)
    _fit(GreedySnakeStrategy(auto=False, offload_dir=tmp_path / "other"), 2, steps=1)  # another directory works


def test_files_kept_in_the_default_directory_are_never_overwritten_by_the_next_run(tmp_path):
    """The same protection where the offload directory is the default one, under the Trainer's
    default_root_dir (Hydra's runs share it when they share an output folder)."""
    _fit(GreedySnakeStrategy(auto=False, offload={"keep_files": True}), 2, steps=1, default_root_dir=tmp_path)
    offload_dir = tmp_path / "greedysnake_offload"
    kept = {p.name: p.read_bytes() for p in offload_dir.iterdir()}
    assert {"weights.bin", "optimizer_states.bin"} <= kept.keys(), kept.keys()
    with pytest.raises(ValueError, match=(
            r"the default offload directory \(under the Trainer's default_root_dir\): "
            rf"{re.escape(str(offload_dir))} holds offload files that another greedysnake run \(pid \d+\) kept there "
            r"\(offload.keep_files=True\): weights.bin.*Fix: give this run another offload directory")):
        make_trainer(GreedySnakeStrategy(auto=False), 2, max_epochs=1, default_root_dir=tmp_path).fit(
            NeverTrained(), token_loader(4))
    assert {p.name: p.read_bytes() for p in offload_dir.iterdir()} == kept


def test_keep_files_then_validate_on_the_same_trainer_uses_its_own_files(tmp_path):
    """fit with keep_files=True, then validate (twice) on the same Trainer: one run, whose kept files
    are its own (it used to be refused as files "another greedysnake run kept"). The validation loss is
    the trained module's, and the files stay kept, named in the record, for another Trainer to be
    refused."""
    offload_dir = tmp_path / "off"
    trainer, module = _fit(GreedySnakeStrategy(auto=False, offload_dir=offload_dir, offload={"keep_files": True}), 2,
                           steps=2)
    kept = sorted(p.name for p in offload_dir.iterdir())
    assert {"weights.bin", "optimizer_states.bin"} <= set(kept), kept
    val = trainer.validate(module, token_loader(2), verbose=False)[0]["val_loss"]
    # again: what the first validate did not open (the optimizer state) is still this Trainer's own
    assert trainer.validate(module, token_loader(2), verbose=False)[0]["val_loss"] == val
    reference = make_trainer("auto", 2, max_epochs=1).validate(module, token_loader(2), verbose=False)[0]["val_loss"]
    assert abs(val - reference) <= 1e-5, (val, reference)
    assert sorted(p.name for p in offload_dir.iterdir()) == kept
    record = LockRecord.parse((offload_dir / ".greedysnake.lock").read_bytes())
    assert record is not None and record.keep_files and set(record.files or ()) == set(kept) - {".greedysnake.lock"}
    with pytest.raises(ValueError, match=r"another greedysnake run \(pid \d+\) kept there"):
        _fit_never(GreedySnakeStrategy(auto=False, offload_dir=offload_dir, offload={"keep_files": True}))


def test_a_users_own_file_named_like_an_offload_file_is_not_called_kept_files(tmp_path):
    """A user's weights.bin in the offload directory was called files "another greedysnake run kept":
    greedysnake knows its own files by its lock record, never by name alone. The run is refused (it would
    overwrite the file and delete it at its end), saying what the file is, before any work; the file stays."""
    offload_dir = tmp_path / "off"
    offload_dir.mkdir()
    (offload_dir / "weights.bin").write_bytes(b"my own weights")
    with pytest.raises(ValueError, match=(
            rf"offload_dir='{re.escape(str(offload_dir))}': .* holds weights.bin \(14 B\), under the names of "
            r"greedysnake's offload files, but no greedysnake run recorded it as its own.*would overwrite it.*"
            r"Fix: move those files out of that directory, or give this run another offload directory")) as info:
        _fit_never(GreedySnakeStrategy(auto=False, offload_dir=offload_dir))
    assert "kept" not in str(info.value)
    assert [(p.name, p.read_bytes()) for p in offload_dir.iterdir()] == [("weights.bin", b"my own weights")]


UNUSED = {  # settings under which a tiny model puts nothing on SSD, and what the report says for each path
    "planned in RAM": ({}, r"weights, master_weights, optimizer_states, gradients fit in the [\d.]+ GiB host budget "
                           r"\(half the available memory\), so the planner \(auto=True\) keeps them in RAM \(on SSD "
                           r"they would take about [\d.]+ KiB here\); saved "
                           r"activations come here only if.*To put state here: offload.<kind>=ssd \(e.g. "
                           r"offload.optimizer_states=ssd\), or a smaller auto_host_budget_bytes\."),
    "yours in RAM": ({"auto": False, "offload": OffloadConfig.everywhere("host")},
                     r"your settings keep every kind off SSD \(offload.weights=host, .*offload.activations=host\)\. "
                     r"To put state here: offload.<kind>=ssd"),
    "yours on the device": ({"auto": False, "offload": OffloadConfig.everywhere("device")},  # (no tensor manager)
                            r"your settings keep every kind off SSD \(offload.weights=device, .*\)\. To put state here"),
}


def _with_path(settings: dict[str, Any], path: Any) -> GreedySnakeStrategy:
    offload = settings.get("offload", OffloadConfig())
    offload = {**(offload if isinstance(offload, dict) else vars(offload)), "path": path}
    return GreedySnakeStrategy(**{**settings, "offload": offload})


@pytest.mark.parametrize("case", ["planned in RAM", "yours on the device"])
def test_an_offload_dir_that_is_a_file_is_refused_even_where_nothing_would_go(tmp_path, case):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ValueError, match=r"offload_dir=.*file' is a file, not a directory.*Fix"):
        _fit_never(_with_path(UNUSED[case][0], [str(tmp_path / "ok"), str(target)]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # (the first one, prepared, removed again)


@pytest.mark.parametrize("case", ["planned in RAM", "yours in RAM"])
def test_a_read_only_offload_dir_is_refused_even_where_nothing_would_go(tmp_path, case):
    target = tmp_path / "ro"
    target.mkdir()
    root = os.getuid() == 0  # (root ignores permission bits: the directory is made immutable instead)
    if root and subprocess.run(["chattr", "+i", str(target)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    if not root:
        target.chmod(0o500)
    try:
        with pytest.raises(ValueError, match=r"offload_dir=.*ro' is not writable.*Fix: make it writable"):
            _fit_never(_with_path(UNUSED[case][0], str(target)))
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(target)], check=False)
        target.chmod(0o700)
    assert list(target.iterdir()) == []


class Locked(L.Callback):
    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.held = [(p / ".greedysnake.lock").is_file() for p in self.paths]


@pytest.mark.parametrize("case", list(UNUSED))
def test_offload_paths_given_but_unused_are_checked_held_and_reported_with_why(tmp_path, case, caplog):
    """With nothing to put on SSD, each path given is still checked and locked for the run, and the report
    says, per path, that nothing went there, why, and how to put state there."""
    paths = [tmp_path / "a", tmp_path / "b"]
    settings, why = UNUSED[case]
    locked = Locked(paths)
    with caplog.at_level("INFO"):
        _fit(_with_path(settings, [str(p) for p in paths]), 2, steps=1, callbacks=[locked])
    assert locked.held == [True, True]
    for path in paths:
        assert re.search(rf"greedysnake offload_dir={re.escape(str(path))} \(O_DIRECT: \w+\)\n  total needed +0 B\n"
                         rf"  free .*\n  nothing placed here: {why}", caplog.text), caplog.text
    assert list(tmp_path.iterdir()) == []  # (made for the run, removed at its end)


def test_buffer_budget_below_one_unit_is_refused():
    with pytest.raises(ValueError, match=r"offload.buffer_budget_bytes=4096 is below the \d+ bytes.*Fix"):
        _fit_never(GreedySnakeStrategy(auto=False, offload={"buffer_budget_bytes": 4096}))


def test_not_enough_space_on_a_tiny_filesystem_is_refused_up_front(tmp_path):
    class Big(NeverTrained):
        def __init__(self) -> None:
            super().__init__()
            from lightning_greedysnake import GPT, GPTConfig

            self.model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=32, block_size=8))

    with mounted(tmp_path / "tiny", size="2M") as mount:
        with pytest.raises(ValueError, match=r"has .* free but this model and placement need") as info:
            make_trainer(GreedySnakeStrategy(auto=False, offload_dir=mount), 2, max_epochs=1).fit(Big(), token_loader(4))
        assert list(mount.iterdir()) == []
        # the run's own way to need less disk is said beside the general ones; with bf16 state already, not
        assert re.search(r"keep more state in host memory, or offload\.optimizer_state_dtype=bfloat16 \(the optimizer "
                         r"state's [\d.]+ [KM]iB on SSD in half the bytes", str(info.value)), str(info.value)
        with pytest.raises(ValueError, match=r"has .* free but this model and placement need") as info:
            make_trainer(GreedySnakeStrategy(auto=False, offload_dir=mount, offload={"optimizer_state_dtype": "bf16"}),
                         2, max_epochs=1).fit(Big(), token_loader(4))
        assert "or keep more state in host memory." in str(info.value) and "bfloat16" not in str(info.value)
        # a directory preflight created for the run is gone again after the refusal
        with pytest.raises(ValueError, match=r"has .* free but this model and placement need"):
            make_trainer(GreedySnakeStrategy(auto=False, offload_dir=mount / "run"), 2, max_epochs=1).fit(Big(), token_loader(4))
        assert list(mount.iterdir()) == []


def _killed_run(directory: Path, pid: int = 999_999_999) -> None:
    """What a run killed with SIGKILL leaves: its offload files and its lock file, held by nobody."""
    directory.mkdir(parents=True)
    (directory / ".greedysnake.lock").write_text(f"{pid}\n")
    for name in ("weights.bin", "optimizer_states.bin", "gradients.bin"):
        (directory / name).write_bytes(b"\0" * 8192)


def test_leftovers_of_killed_runs_beside_the_offload_directory_are_removed_and_reported(tmp_path, caplog):
    """Under Hydra each run has its own output folder: a killed run's files would stay forever. The next
    run removes (and says so) what runs that no longer exist left under the same parent; a live run's
    directory, files a run kept on purpose (keep_files: its lock record says so) and files no greedysnake run
    recorded (no lock file) stay."""
    import logging

    root = tmp_path / "outputs"
    _killed_run(root / "run-killed" / "greedysnake_offload")
    _killed_run(root / "run-now" / "greedysnake_offload")  # even in this run's own directory
    live = root / "run-live" / "greedysnake_offload"
    live.mkdir(parents=True)
    (live / "weights.bin").write_bytes(b"\0" * 8192)
    held = OffloadDirLock(live)
    held.acquire()
    kept = root / "run-kept" / "greedysnake_offload"
    kept.mkdir(parents=True)
    (kept / "weights.bin").write_bytes(b"\0" * 8192)
    (kept / ".greedysnake.lock").write_text(LockRecord("999999998", True, "x", ("weights.bin",)).text())
    unrecorded = root / "run-mine" / "greedysnake_offload"
    unrecorded.mkdir(parents=True)
    (unrecorded / "weights.bin").write_bytes(b"\0" * 8192)
    try:
        with caplog.at_level(logging.INFO):
            _fit(GreedySnakeStrategy(auto=False), 2, steps=1, default_root_dir=root / "run-now")
    finally:
        held.release()
    assert not (root / "run-killed" / "greedysnake_offload").exists()
    assert not (root / "run-now" / "greedysnake_offload").exists()  # (and this run cleaned up its own)
    assert (live / "weights.bin").exists() and (kept / "weights.bin").exists() and (unrecorded / "weights.bin").exists()
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert log.count("did not clean up (pid 999999999") == 2, log


def test_the_smallest_budget_still_trains_exactly():
    """With the budget at the minimum, prefetch finds no room and staging waits for write-behind to
    return buffers: slower, never different."""
    probe = {}

    class Budget(L.Callback):
        def setup(self, trainer: Any, module: Any, stage: str) -> None:
            pass

        def on_train_start(self, trainer: Any, module: Any) -> None:
            probe["min"] = trainer.strategy.tensor_manager.arena.budget.minimum_bytes

    _fit(GreedySnakeStrategy(auto=False), 2, callbacks=[Budget()])
    ref_trainer, ref = _fit(GreedySnakeStrategy(auto=False), 2)
    tight_trainer, tight = _fit(GreedySnakeStrategy(auto=False, offload={"buffer_budget_bytes": probe["min"]}), 2)
    for (n, a), (_, b) in zip(ref.named_parameters(), tight.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_disk_full_during_training_names_the_file_and_cleans_up(tmp_path):
    """Saved activations on a 4 MiB filesystem: the start-of-run preflight cannot know their size, so their
    room is checked at the window's first save, before any is written; the error names the directory, the
    bytes and the fix, and nothing is left."""
    from lightning_greedysnake import GPT, GPTConfig

    class Wide(TinyGPTModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=64, vocab_size=32, block_size=64))

    with mounted(tmp_path / "tiny", size="4M") as mount:
        offload = dict(OffloadConfig.everywhere("host").__dict__, activations="ssd", path=str(mount))
        L.seed_everything(0, verbose=False)
        trainer = make_trainer(GreedySnakeStrategy(auto=False, offload=offload), 4, max_epochs=1)
        # at the window's first saved activation, room for all of them: K=4 x 2 units x 1 MiB
        with pytest.raises(ValueError, match=rf"offload_dir='{mount}' has .* free but this run's saved activations "
                                             r"\(8 of 1\.0 MiB a window in this directory, 8\.0 MiB: .*Fix.*"
                                             r"offload\.activations=host"):
            trainer.fit(Wide(), token_loader(8, batch_size=64, seq=64))
        assert trainer.global_step == 0
        assert list(mount.iterdir()) == []
        assert _io_threads() == []


def test_a_truncated_offload_file_is_a_named_error_not_garbage(tmp_path):
    """Someone truncates the weights file mid-run: the next read fails naming the file and offset."""
    from lightning_greedysnake.io import ShortReadError

    class Truncate(L.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            if trainer.global_step == 1:
                os.truncate(trainer.strategy.tensor_manager.offload_dirs[0] / "weights.bin", 0)

    L.seed_everything(0, verbose=False)
    trainer = make_trainer(GreedySnakeStrategy(auto=False, offload_dir=tmp_path), 2, max_epochs=1, callbacks=[Truncate()])
    with pytest.raises(Exception) as info:  # noqa: PT011 - the type depends on which thread reads first
        trainer.fit(TinyGPTModule(lr=LR), token_loader(8))
    chain = [info.value, info.value.__cause__]
    short = [e for e in chain if isinstance(e, ShortReadError)]
    assert short, chain  # directly, or as the cause of the background optimizer's error
    assert re.search(r"read of \d+ bytes at offset \d+ in .*weights\.bin", str(short[0]))
    assert not (tmp_path / "weights.bin").exists()



def test_ssd_checkpoints_are_read_ahead_and_stay_exact():
    """With saved activations on SSD the engine hints the next op's, so backward does not wait for
    each read; the result is the resident one bit for bit."""
    prefetches = {}

    class Count(L.Callback):
        def on_train_end(self, trainer: Any, module: Any) -> None:
            prefetches["n"] = trainer.strategy.tensor_manager.activations.prefetches

    _, got = _fit(GreedySnakeStrategy(auto=False, offload={"activations": "ssd"}), 4, callbacks=[Count()])
    _, ref = _fit(GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("device")), 4)
    assert prefetches["n"] > 0
    for (n, a), (_, b) in zip(got.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_spare_budget_reads_every_coming_step_ahead_in_order():
    """Issue 54: a step's reads start as far ahead as the staging slack allows, not one step ahead: with room
    in the budget, when the lane runs the window's first step (the last unit's, after the fused ops) every
    other unit's master weights and state are already being read, so no job waits on a read the budget could
    have started. With the budget at its minimum none is (the slack is zero). Both equal Lightning's."""
    seen: dict[str, list[list[int]]] = {"roomy": [], "tight": []}

    class Probe(L.Callback):
        def __init__(self, label: str) -> None:
            self.label = label

        def on_train_start(self, trainer: Any, module: Any) -> None:
            strategy = trainer.strategy
            manager = strategy.tensor_manager
            last = manager.layouts[manager.num_units - 1].params[0].name
            seen["min"] = [manager.arena.budget.minimum_bytes]

            def hook(name: str, grad: torch.Tensor) -> None:  # on the lane, as each unit's step runs
                if name == last:  # the window's first step: which other units' reads are under way
                    seen[self.label].append([u for u in range(manager.num_units - 1)
                                             if manager.stepper.parts.has_read_ahead(u)])

            strategy.register_gradient_hook(hook)

    _, roomy = _fit(GreedySnakeStrategy(auto=False, offload={"buffer_budget_bytes": 64 << 20}), 2,
                    n_layer=4, callbacks=[Probe("roomy")], precision="bf16-mixed")
    _, tight = _fit(GreedySnakeStrategy(auto=False, offload={"buffer_budget_bytes": seen["min"][0]}), 2,
                    n_layer=4, callbacks=[Probe("tight")], precision="bf16-mixed")
    # bf16-mixed: a separate master copy, read ahead from the first step on; units 0..2 before unit 3's step
    assert seen["roomy"] == [[0, 1, 2]] * 3
    assert all(len(ahead) < 3 for ahead in seen["tight"])
    for (n, a), (_, b) in zip(roomy.named_parameters(), tight.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_the_windows_last_read_ahead_at_the_minimum_budget_leaves_room_for_its_units_gradient(
        monkeypatch, accounting_hole: bool = False):
    """On a device tier a unit's gradient accumulates in device memory and the step's host copy is staged
    only when the step takes it: the window's last read-ahead, which may use what the minimum reserves
    for work still to come, must count that copy as still to come. Here the lane is slow on the step
    before it (a gradient hook sleeps), so the read-ahead is asked while unit 0's gradient accumulates
    on the device and that step has not staged yet: counted as held, the read-ahead took the room the
    step needed and the run failed (seen flaky in CI under contention; every time this way)."""
    monkeypatch.setenv(SIMULATE_ENV, "1")
    seen: dict[str, int] = {}

    class Probe(L.Callback):
        def __init__(self, slow: bool) -> None:
            self.slow = slow

        def on_train_start(self, trainer: Any, module: Any) -> None:
            strategy = trainer.strategy
            manager = self.manager = strategy.tensor_manager
            seen["min"] = manager.arena.budget.minimum_bytes
            first = manager.layouts[1].params[0].name

            def hook(name: str, grad: torch.Tensor) -> None:  # on the lane, before the step stages
                if self.slow and name == first:
                    threading.Event().wait(0.5)

            strategy.register_gradient_hook(hook)

        def on_train_end(self, trainer: Any, module: Any) -> None:
            self.manager.drain()
            seen["given_back"] = self.manager.stepper.parts.read_aheads_given_back

    _, roomy = _fit(GreedySnakeStrategy(auto=False), 2, n_layer=4, callbacks=[Probe(slow=False)],
                    precision="bf16-mixed")
    _, tight = _fit(GreedySnakeStrategy(auto=False, offload={"buffer_budget_bytes": seen["min"]}), 2,
                    n_layer=4, callbacks=[Probe(slow=True)], precision="bf16-mixed")
    for (n, a), (_, b) in zip(roomy.named_parameters(), tight.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    if accounting_hole:  # (the read-aheads that took the room went back, and the step went on)
        assert seen["given_back"] > 0


def test_a_read_ahead_that_took_a_steps_room_goes_back_and_the_step_goes_on(monkeypatch):
    """A gap in the staging budget's accounting (the one the test above guards, put back) must not stop a
    run: the step that finds no room while read-aheads of later steps hold it gives them back, with a
    warning (an error in the other tests: ``tests/conftest.py``), and the result is the same."""
    from lightning_greedysnake.offload.gradients import GradientAccumulator
    from lightning_greedysnake.errors import ReadAheadGivenBackWarning

    monkeypatch.setattr(GradientAccumulator, "on_host", GradientAccumulator.in_memory)
    with pytest.warns(ReadAheadGivenBackWarning, match="gave back .* read-ahead"):
        test_the_windows_last_read_ahead_at_the_minimum_budget_leaves_room_for_its_units_gradient(
            monkeypatch, accounting_hole=True)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_spare_budget_reads_the_windows_last_step_ahead_and_keeps_its_weights_exactly(precision):
    """The window's last step (unit 0's) is what the next forward waits for. With room in the budget its
    master weights and state are read during unit 0's backward (as every step's are during the backward
    before it), and its new weights stay in memory for the next forward; at the minimum budget neither
    happens. Both equal Lightning's own result."""
    probe = {}

    class Budget(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            probe["min"] = trainer.strategy.tensor_manager.arena.budget.minimum_bytes

    _fit(GreedySnakeStrategy(auto=False), 2, callbacks=[Budget()], precision=precision)
    tight_snap, roomy_snap = Snapshot(), Snapshot()
    _, tight = _fit(GreedySnakeStrategy(auto=False, offload={"buffer_budget_bytes": probe["min"]}), 2,
                    callbacks=[tight_snap], precision=precision)
    _, roomy = _fit(GreedySnakeStrategy(auto=False, offload={"buffer_budget_bytes": 64 << 20}), 2, callbacks=[roomy_snap],
                    precision=precision)
    _, plain = _fit("auto", 2, precision=precision)
    steps = roomy_snap.steps
    # (at the minimum budget a read-ahead may still fit in what the minimum reserves for steps that
    # have already run: whether it does depends on timing, so only the roomy run is counted)
    # the first step has no state to read yet (and under 32-true no separate master): nothing ahead;
    # after it every unit's step finds its reads done (the next step's reads overlap the backward before it)
    per_unit = steps if precision == "bf16-mixed" else steps - 1
    assert roomy_snap.manager.stepper.parts.steps_read_ahead == per_unit * roomy_snap.manager.num_units
    w0 = roomy_snap.region_bytes["weights"][0]
    assert tight_snap.stats.bytes_read("weights") - roomy_snap.stats.bytes_read("weights") == (steps - 1) * w0
    for (n, a), (_, b), (_, c) in zip(tight.named_parameters(), roomy.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(a, b), n
        assert (a.float() - c.float()).abs().max() <= (1e-5 if precision == "32-true" else 2e-2), n


def test_each_deferred_part_is_read_while_the_one_before_it_steps_and_nothing_changes():
    """The deferred (alpha) parts run one after another on the lane at the next forward: with the
    automatic budget (a second optimizer working set) each one's master weights and state are read
    while the part before it computes and writes back (the lane starts them: ``StepLane.start_aheads``),
    after the first step every deferred part but the window's first (a timing race with the last
    backward step). At the minimum budget none is. Both end bit for bit equal, and equal Lightning's.
    (Reading part 0's ranges for part 1 instead changes the weights: seen failing.)"""
    probe = {}

    class Budget(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            probe["min"] = trainer.strategy.tensor_manager.arena.budget.minimum_bytes

    _fit(GreedySnakeStrategy(auto=False), 2, callbacks=[Budget()], precision="bf16-mixed", steps=1)
    tight_snap, roomy_snap = Snapshot(), Snapshot()
    steps = 4
    _, tight = _fit(GreedySnakeStrategy(auto=False, offload={"buffer_budget_bytes": probe["min"]}), 2, steps=steps,
                    n_layer=4, callbacks=[tight_snap], precision="bf16-mixed")
    _, roomy = _fit(GreedySnakeStrategy(auto=False), 2, steps=steps, n_layer=4, callbacks=[roomy_snap],
                    precision="bf16-mixed")
    _, plain = _fit("auto", 2, steps=steps, n_layer=4, precision="bf16-mixed")
    deferring = sum(roomy_snap.manager.stepper.defers(u) for u in range(roomy_snap.manager.num_units))
    assert deferring >= 3
    assert tight_snap.manager.stepper.parts.deferred_parts_read_ahead == 0
    # (each window's deferred parts: every one but its first, which races the last backward step's job)
    assert roomy_snap.manager.stepper.parts.deferred_parts_read_ahead >= steps * (deferring - 1)
    for (n, a), (_, b), (_, c) in zip(tight.named_parameters(), roomy.named_parameters(), plain.named_parameters(),
                                      strict=True):
        assert torch.equal(a, b), n
        assert (a.float() - c.float()).abs().max() <= 2e-2, n


def test_ssd_checkpoints_are_read_back_just_in_time_within_the_documented_budget():
    """With saved activations on SSD the forward reads each unit input back, uses it and lets its buffer go
    (the copy on SSD stays for backward): memory holds one checkpoint being read and one being written,
    not every unit's inputs from forward to backward. The documented minimum (one unit's working set
    plus two checkpoints) trains K=8 through 6 units, bit for bit as with a roomy budget."""
    probe: dict[str, Any] = {}

    class Budget(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            probe.setdefault("min", trainer.strategy.tensor_manager.arena.budget.minimum_bytes)

        def on_train_end(self, trainer: Any, module: Any) -> None:
            probe["peak_loaded"] = trainer.strategy.tensor_manager.activations.peak_loaded

    ssd = {"activations": "ssd"}
    _, roomy = _fit(GreedySnakeStrategy(auto=False, offload=ssd), 8, steps=2, n_layer=6, callbacks=[Budget()])
    unit_input_bytes = 4096  # one unit input of one micro-batch: 2 x 8 x 16 fp32, page-aligned
    tight = {**ssd, "buffer_budget_bytes": probe["min"] + 2 * unit_input_bytes}
    _, got = _fit(GreedySnakeStrategy(auto=False, offload=tight), 8, steps=2, n_layer=6, callbacks=[Budget()])
    assert probe["peak_loaded"] <= 2, probe  # the one in use and at most one read ahead
    for (n, a), (_, b) in zip(roomy.named_parameters(), got.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_a_killed_run_that_keeps_its_files_keeps_them(tmp_path):
    """offload.keep_files=True keeps the files "after a crash" too: a run killed with SIGKILL cannot say so
    at its end, so its lock file does; the next run beside it leaves them, and a run in that directory
    refuses to start (as after a normal end) instead of removing them."""
    import subprocess
    import sys

    root = tmp_path / "outputs"
    kept = root / "run-killed" / "greedysnake_offload"
    kept.mkdir(parents=True)
    child = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from lightning_greedysnake.offload.preflight import OffloadDirLock\n"
        "d = Path(sys.argv[1])\n"
        "OffloadDirLock(d, keep_files=True).acquire()\n"
        "(d / 'weights.bin').write_bytes(b'w' * 8192)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    assert subprocess.run([sys.executable, "-c", child, str(kept)], check=False).returncode == -9
    _fit(GreedySnakeStrategy(auto=False), 2, steps=1, default_root_dir=root / "run-now")
    assert (kept / "weights.bin").read_bytes() == b"w" * 8192
    with pytest.raises(ValueError, match=r"kept there \(offload.keep_files=True\): weights.bin"):
        _fit_never(GreedySnakeStrategy(auto=False, offload_dir=kept))
    assert (kept / "weights.bin").read_bytes() == b"w" * 8192


@pytest.mark.parametrize("alpha, clip, whole", [(0.25, None, False), (0.0, None, False), (0.25, 1.0, True),
                                                (0.25, "horizontal", True)])
def test_the_gradients_file_keeps_only_what_can_wait_there(alpha, clip, whole, tmp_path):
    """In the vertical order without clipping by the global norm a gradient waits on its tier only for its
    deferred (alpha) part: preflight counts those bytes, the file is sparse, and no block of it beyond them
    is ever written. Clipping by the norm or the horizontal order keep whole gradients there."""
    from lightning_greedysnake.config import TensorKind
    from lightning_greedysnake.optim import split_numel

    snap = Snapshot()
    schedule = "horizontal" if clip == "horizontal" else "vertical"
    strategy = GreedySnakeStrategy(auto=False, alpha=alpha, lag=1, schedule=schedule, offload_dir=tmp_path / "off")
    seen: dict[str, Any] = {}

    class Disk(L.Callback):
        def on_train_end(self, trainer: Any, module: Any) -> None:
            manager = trainer.strategy.tensor_manager
            manager.drain()
            seen["counted"] = manager.placement.ssd_bytes().get("gradients", 0)
            st = os.stat(tmp_path / "off" / "gradients.bin")
            seen["allocated"] = st.st_blocks * 512
            seen["written"] = sum(c.bytes_written for (kind, _), c in manager.stats.copy()._counters.items()
                                  if kind == "gradients")
            # (a unit's deferred part: from the alpha split to its region's end; none of unit 0's)
            splits = [0 if whole else lay.numel if u == 0 else split_numel(lay, alpha, None, manager.state.split_align_numel)
                      for u, lay in enumerate(manager.state.units)]
            seen["expected"] = sum(manager.region_bytes(TensorKind.GRADIENTS, u) - 4 * split
                                   for u, (lay, split) in enumerate(zip(manager.state.units, splits)) if split < lay.numel)

    _fit(strategy, 4, callbacks=[snap, Disk()], gradient_clip_val=clip if isinstance(clip, float) else None)
    assert seen["counted"] == seen["expected"]
    full = sum(snap.region_bytes["gradients"])
    if whole:
        assert seen["counted"] == full and seen["allocated"] >= full
        return
    assert seen["allocated"] <= seen["counted"]  # (sparse: only the deferred ranges written have blocks)
    if alpha:
        assert 0 < seen["counted"] < full and seen["written"] > 0
    else:
        assert seen["counted"] == 0 and seen["written"] == 0
