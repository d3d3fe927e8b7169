"""Lightning checkpoints of SSD-resident state: exact resume, streamed saves, refusal of damaged files."""

from __future__ import annotations

import hashlib
import json
import os
import re
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_greedysnake import GPT, GPTConfig, GreedySnakeCheckpointIO, GreedySnakeStrategy, OffloadConfig
from lightning_greedysnake.checkpoint import CheckpointError, CheckpointReader
from tests.helpers import ResumableLoader, TinyGPTModule, make_trainer, max_abs_diff, mounted, token_loader

BATCHES = 10


def _fit(strategy: Any, root: Path, max_epochs: int = 3, k: int = 3, ckpt_path: str | None = None,
         callbacks: list | None = None, precision: str = "32-true", max_steps: int = -1,
         module: L.LightningModule | None = None, resumable: bool = False) -> tuple[dict, L.Trainer]:
    L.seed_everything(0, verbose=False)
    module = module or TinyGPTModule(lr=3e-3)
    if callbacks is None:
        callbacks = [ModelCheckpoint(dirpath=root, save_last=True)]
    trainer = make_trainer(strategy, k, max_epochs=max_epochs, enable_checkpointing=True, default_root_dir=root,
                           callbacks=callbacks, precision=precision, max_steps=max_steps)
    loader = ResumableLoader(token_loader(BATCHES)) if resumable else token_loader(BATCHES)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return {n: p.detach().clone() for n, p in module.named_parameters()}, trainer


SETTINGS = {
    "ssd": {},
    "deferred_alpha_lag": {"alpha": 0.5, "lag": 2},  # updates still pending when the save comes
    "host": {"offload": {"weights": "host", "master_weights": "host", "optimizer_states": "host",
                         "gradients": "host"}},
    "two_blocks_per_unit": {"layers_per_unit": 2},
}


@pytest.mark.parametrize("settings", list(SETTINGS.values()), ids=list(SETTINGS))
def test_resume_at_epoch_boundary_equals_uninterrupted(tmp_path, settings):
    uninterrupted, _ = _fit(GreedySnakeStrategy(auto=False, **settings), tmp_path / "a")
    _fit(GreedySnakeStrategy(auto=False, **settings), tmp_path / "b", max_epochs=1)
    last = tmp_path / "b" / "last.ckpt"
    assert last.is_dir() and CheckpointReader(last).manifest["optimizer"]  # the directory format
    resumed, trainer = _fit(GreedySnakeStrategy(auto=False, **settings), tmp_path / "b", ckpt_path=str(last))
    assert trainer.global_step == 12
    assert max_abs_diff(uninterrupted, resumed) <= 1e-6


def test_bf16_resume_equals_uninterrupted(tmp_path):
    """fp32 master weights and moments, and the unit optimizers' step counters, survive a save."""
    uninterrupted, _ = _fit(GreedySnakeStrategy(auto=False), tmp_path / "a", precision="bf16-mixed")
    _fit(GreedySnakeStrategy(auto=False), tmp_path / "b", max_epochs=1, precision="bf16-mixed")
    resumed, _ = _fit(GreedySnakeStrategy(auto=False), tmp_path / "b", ckpt_path="last", precision="bf16-mixed")
    assert max_abs_diff(uninterrupted, resumed) <= 1e-6


def _mid_epoch(strategy_factory: Any, root: Path, resumable: bool) -> dict:
    """Stop after 2 optimizer steps of a 3-step epoch (a step-interval checkpoint), resume to the end."""
    every = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    _fit(strategy_factory(), root, max_steps=2, callbacks=[every], resumable=resumable)
    resumed, trainer = _fit(strategy_factory(), root, ckpt_path=str(root / "step=2.ckpt"), callbacks=[],
                            resumable=resumable)
    assert trainer.global_step == 12
    return resumed


@pytest.mark.parametrize("resumable", [False, True], ids=["plain-loader", "stateful-loader"])
def test_mid_epoch_resume_lands_where_lightning_lands(tmp_path, resumable):
    """Lightning restores a mid-epoch position from its loop state (and a stateful loader's own state);
    greedysnake, whose look-ahead reads the data ahead of Lightning, must do exactly what Lightning's
    default strategy does from the same checkpoint. With a loader that can resume mid-epoch both land
    on the uninterrupted run; a plain loader restarts the epoch's data (Lightning's limitation)."""
    reference = _mid_epoch(lambda: "auto", tmp_path / "auto", resumable)
    got = _mid_epoch(GreedySnakeStrategy, tmp_path / "gs", resumable)
    assert max_abs_diff(reference, got) <= 1e-5
    uninterrupted, _ = _fit("auto", tmp_path / "u", callbacks=[], resumable=resumable)
    if resumable:
        assert max_abs_diff(reference, uninterrupted) <= 1e-6
        assert max_abs_diff(got, uninterrupted) <= 1e-5
    else:
        assert max_abs_diff(reference, uninterrupted) > 1e-3  # guards the comparison above


def test_resume_with_a_different_accumulation_lands_where_lightning_lands(tmp_path):
    def run(strategy_factory: Any, root: Path) -> dict:
        _fit(strategy_factory(), root, max_epochs=1, k=3)
        resumed, _ = _fit(strategy_factory(), root, k=2, ckpt_path=str(root / "last.ckpt"))
        return resumed

    assert max_abs_diff(run(lambda: "auto", tmp_path / "auto"), run(GreedySnakeStrategy, tmp_path / "gs")) <= 1e-5


def test_a_plain_lightning_checkpoint_resumes_under_greedysnake(tmp_path):
    """Switching a run to greedysnake: a checkpoint file from the default strategy loads into the tiers."""
    _fit("auto", tmp_path / "plain", max_epochs=1)
    plain = tmp_path / "plain" / "last.ckpt"
    assert plain.is_file()
    reference, _ = _fit("auto", tmp_path / "r", ckpt_path=str(plain))
    got, _ = _fit(GreedySnakeStrategy(auto=False), tmp_path / "g", ckpt_path=str(plain))
    assert max_abs_diff(reference, got) <= 1e-5


RESUME_WIDER = {  # (how the checkpoint is saved, how the wider model resumes)
    "streamed": (GreedySnakeStrategy, {}),  # a checkpoint directory streamed into the tensor manager
    "plain_file": (lambda **_: "auto", {}),  # Lightning's own file, into the tensor manager
    "on_device": (GreedySnakeStrategy, {"offload": OffloadConfig.everywhere("device")}),  # Lightning's load
}


@pytest.mark.parametrize("saved_by, settings", list(RESUME_WIDER.values()), ids=list(RESUME_WIDER))
def test_resuming_into_a_wider_model_names_the_parameter_its_shapes_the_file_and_the_fix(tmp_path, saved_by, settings):
    """A deeper model is refused naming what is missing; a wider one ended in "The size of tensor a (32)
    must match the size of tensor b (16)", naming nothing: now the parameter, its shape in the checkpoint
    and in the model, the checkpoint and the fix, before anything is loaded."""
    _fit(saved_by(auto=False, **settings), tmp_path, max_epochs=1)
    last = tmp_path / "last.ckpt"
    wider = TinyGPTModule(lr=3e-3)
    wider.model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=32, block_size=8))
    with pytest.raises(CheckpointError, match=(
            rf"checkpoint {re.escape(str(last))} does not fit the model: parameter model.wte.weight has shape "
            r"\[32, 16\] in the checkpoint but \[32, 32\] in the model \(and \d+ more: .*\): it was saved from a "
            r"model of another size. Fix: build the model with the configuration the checkpoint was saved with")):
        _fit(GreedySnakeStrategy(auto=False, **settings), tmp_path, ckpt_path=str(last), module=wider, callbacks=[])


def test_saving_streams_one_unit_at_a_time(tmp_path):
    """The save never gathers the model: each unit's tensors are gone before the next unit is read."""
    alive: list[list[weakref.ref]] = []
    overlaps: list[int] = []

    class Spy(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            manager = trainer.strategy.tensor_manager.values  # (what checkpoints stream from)
            for name in ("unit_master_weights", "unit_optimizer_state"):
                original = getattr(manager, name)

                def spied(u: int, _original: Any = original, _name: str = name) -> Any:
                    if _name == "unit_master_weights":  # a new unit: count what is left of the others
                        overlaps.append(sum(r() is not None for refs in alive for r in refs))
                        alive.append([])
                    out = _original(u)
                    tensors = out if isinstance(out, list) else [
                        v for e in out.values() for v in e.values() if isinstance(v, torch.Tensor)]
                    alive[-1].extend(weakref.ref(t) for t in tensors)
                    return out

                setattr(manager, name, spied)

    _fit(GreedySnakeStrategy(auto=False, offload={"return_weights": False}), tmp_path, max_epochs=1,
         module=TinyGPTModule(n_layer=4, lr=3e-3), callbacks=[Spy(), ModelCheckpoint(dirpath=tmp_path)])
    assert len(overlaps) == 4 and max(overlaps) == 0  # one save of 4 units


def test_save_last_reuses_the_files_of_the_checkpoint_just_saved(tmp_path):
    _, trainer = _fit(GreedySnakeStrategy(auto=False), tmp_path, max_epochs=1)
    top = CheckpointReader(tmp_path / "epoch=0-step=4.ckpt")
    last = CheckpointReader(tmp_path / "last.ckpt")
    for rel in top.files_under("model/"):
        assert os.path.samefile(top.payload / rel, last.payload / rel)  # one copy on disk
    last.verify()
    top.verify()


def test_a_save_replaces_the_previous_payload_and_clears_leftovers(tmp_path):
    _fit(GreedySnakeStrategy(auto=False), tmp_path, max_epochs=1)
    last = tmp_path / "last.ckpt"
    stray = last / "v-from-a-killed-save"
    stray.mkdir()
    (stray / "half.safetensors").write_bytes(b"x" * 10)
    first = CheckpointReader(last).payload.name
    _fit(GreedySnakeStrategy(auto=False), tmp_path, max_epochs=2, ckpt_path=str(last))
    entries = sorted(p.name for p in last.iterdir())
    assert entries == ["CURRENT", CheckpointReader(last).payload.name] and first not in entries


def _damage(how: str, ckpt: Path) -> Path:
    reader = CheckpointReader(ckpt)
    target = reader.payload / "model" / "unit_00001.safetensors"
    if how == "missing":
        target.unlink()
    elif how == "truncated":
        target.write_bytes(target.read_bytes()[:-7])
    elif how == "corrupted":
        data = bytearray(target.read_bytes())
        data[-3] ^= 0xFF  # one bit pattern in a weight: same size, valid safetensors, wrong values
        target.write_bytes(bytes(data))
    elif how == "no_current":
        target = ckpt / "CURRENT"
        target.unlink()
    elif how == "manifest_flipped":
        target = reader.payload / "manifest.json"
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF  # not even valid UTF-8 any more
        target.write_bytes(bytes(data))
    elif how == "manifest_swapped_unit":
        # still valid JSON, sizes and checksums of every other file intact: only the manifest's own
        # checksum (in CURRENT) tells
        target = reader.payload / "manifest.json"
        manifest = json.loads(target.read_text())
        first, second = sorted(manifest["params"])[:2]
        p = manifest["params"]
        p[first]["unit"], p[second]["unit"] = p[second]["unit"] + 1, p[first]["unit"] + 1
        target.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return target


@pytest.mark.parametrize("how", ["missing", "truncated", "corrupted", "no_current", "manifest_flipped",
                                 "manifest_swapped_unit"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, how):
    _fit(GreedySnakeStrategy(auto=False), tmp_path, max_epochs=1)
    target = _damage(how, tmp_path / "last.ckpt")
    with pytest.raises(CheckpointError, match=str(target.name)) as info:
        _fit(GreedySnakeStrategy(auto=False), tmp_path / "resume", ckpt_path=str(tmp_path / "last.ckpt"))
    assert "Fix" in str(info.value)


def test_a_checkpoint_of_a_newer_format_version_is_refused_naming_the_fix(tmp_path):
    """A manifest that says version 2, published as a newer greedysnake would publish it (CURRENT carries its
    checksum, every file intact): refused, naming both versions and the upgrade, not loaded as version 1."""
    _fit(GreedySnakeStrategy(auto=False), tmp_path, max_epochs=1)
    last = tmp_path / "last.ckpt"
    payload = CheckpointReader(last).payload
    manifest = json.loads((payload / "manifest.json").read_text())
    manifest["version"] = 2
    raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (payload / "manifest.json").write_bytes(raw)
    (last / "CURRENT").write_text(f"{payload.name}\nmanifest-sha256 {hashlib.sha256(raw).hexdigest()}\n")
    with pytest.raises(CheckpointError, match=r"manifest\.json has format version 2; this lightning-greedysnake reads "
                                              r"version 1\. .*newer lightning-greedysnake\. Fix: upgrade"):
        _fit(GreedySnakeStrategy(auto=False), tmp_path / "resume", ckpt_path=str(last))


def test_a_save_onto_a_full_disk_names_the_file_and_the_fix_and_leaves_nothing(tmp_path):
    """The checkpoint directory is on a tiny filesystem that fills up during the save: the error names
    the checkpoint, the file and the fix, and no empty checkpoint directory is left behind."""
    with mounted(tmp_path / "tiny", size="64K") as mount:
        every = ModelCheckpoint(dirpath=mount, every_n_train_steps=2, save_top_k=-1, filename="{step}")
        with pytest.raises(OSError, match=r"saving checkpoint .*step=2\.ckpt failed writing .*: No space left"
                                          r".*Fix: free space.*previous checkpoint.*untouched"):
            _fit(GreedySnakeStrategy(auto=False, offload_dir=tmp_path / "off"), tmp_path, max_epochs=1, callbacks=[every])
        assert list(mount.iterdir()) == []


class Opaque:
    """Not a container, number, string or tensor: a checkpoint must not unpickle it."""

    def __init__(self) -> None:
        self.value = 1


class WithOpaqueHparams(TinyGPTModule):
    def __init__(self) -> None:
        super().__init__(lr=3e-3)
        self.save_hyperparameters({"thing": Opaque()})


def test_loading_never_unpickles_arbitrary_objects(tmp_path):
    _fit(GreedySnakeStrategy(auto=False), tmp_path, max_epochs=1, module=WithOpaqueHparams())
    with pytest.raises(CheckpointError, match=r"trainer_state.pt holds an object.*weights_only=True"):
        _fit(GreedySnakeStrategy(auto=False), tmp_path / "r", module=WithOpaqueHparams(), ckpt_path=str(tmp_path / "last.ckpt"))


@pytest.mark.parametrize("call, error", [
    ({"filepath": "x.ckpt", "storage_options": {"a": 1}}, r"storage_options=.*Fix"),
    ({"filepath": "s3://bucket/x.ckpt"}, r"s3://bucket/x.ckpt.*local or mounted filesystem.*Fix"),
])
def test_storage_options_and_remote_paths_are_refused(tmp_path, call, error):
    class SaveMidRun(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            trainer.save_checkpoint(**call)

    with pytest.raises((TypeError, ValueError), match=error):
        _fit(GreedySnakeStrategy(auto=False), tmp_path, max_epochs=1, callbacks=[SaveMidRun()])


def test_export_to_a_plain_lightning_checkpoint_resumes_under_the_default_strategy(tmp_path):
    """Not locked in: a greedysnake checkpoint exported with --lightning resumes under strategy="auto"
    exactly where greedysnake itself resumes from the directory."""
    from lightning_greedysnake.export import export_lightning

    _fit(GreedySnakeStrategy(auto=False), tmp_path / "g", max_epochs=1)
    plain = export_lightning(tmp_path / "g" / "last.ckpt", tmp_path / "plain.ckpt")
    under_auto, _ = _fit("auto", tmp_path / "a", ckpt_path=str(plain))
    under_gs, _ = _fit(GreedySnakeStrategy(auto=False), tmp_path / "b", ckpt_path=str(tmp_path / "g" / "last.ckpt"))
    assert max_abs_diff(under_auto, under_gs) <= 1e-5
    loaded = TinyGPTModule.load_from_checkpoint(plain, weights_only=True)
    assert loaded.model.lm_head.weight.shape == (32, 16)


def test_the_checkpoint_io_plugin_resumes_a_directory_under_the_default_strategy(tmp_path):
    """``Trainer(strategy="auto", plugins=[GreedySnakeCheckpointIO()])`` resumes from the directory itself
    (no export step) where greedysnake resumes; a directory that is no checkpoint is refused with the fix, by
    the plugin and by greedysnake alike."""
    _fit(GreedySnakeStrategy(auto=False), tmp_path / "g", max_epochs=1)
    ckpt = str(tmp_path / "g" / "last.ckpt")
    plugin = {"plugins": [GreedySnakeCheckpointIO()]}
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(lr=3e-3)
    make_trainer("auto", 3, max_epochs=3, default_root_dir=tmp_path / "a", **plugin).fit(
        module, token_loader(BATCHES), ckpt_path=ckpt)
    under_gs, _ = _fit(GreedySnakeStrategy(auto=False), tmp_path / "b", ckpt_path=ckpt)
    assert max_abs_diff({n: p.detach() for n, p in module.named_parameters()}, under_gs) <= 1e-5
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"is a directory but not a greedysnake checkpoint.*Fix"):
        make_trainer("auto", 3, max_epochs=3, default_root_dir=tmp_path / "c", **plugin).fit(
            TinyGPTModule(lr=3e-3), token_loader(BATCHES), ckpt_path=str(tmp_path / "empty"))
    # greedysnake itself loads a path the same one way (strategy/checkpoints.py load_path): the same refusal
    with pytest.raises(CheckpointError, match=r"is a directory but not a greedysnake checkpoint.*Fix"):
        _fit(GreedySnakeStrategy(auto=False), tmp_path / "d", ckpt_path=str(tmp_path / "empty"))
