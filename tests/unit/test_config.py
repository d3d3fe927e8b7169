import pytest

from lightning_greedysnake import GPTConfig, GreedySnakeConfig, GreedySnakeStrategy, ScheduleKind, Tier


def test_defaults():
    config = GreedySnakeConfig()
    assert config.schedule is None and config.layers_per_unit is None and config.auto
    # what the planner chooses is unset until setup; in effect before that: the fixed defaults
    assert config.alpha is None and config.lag is None and config.recompute is None
    assert config.offload.weights is None and config.offload.optimizer_states is None
    fixed = config.resolved()
    assert (fixed.alpha, fixed.lag, fixed.recompute, fixed.layers_per_unit) == (0.25, 2, True, 1)
    assert fixed.schedule is ScheduleKind.VERTICAL
    assert fixed.offload.weights is Tier.SSD and fixed.offload.activations is Tier.HOST
    assert config.unset() >= {"alpha", "lag", "recompute", "layers_per_unit", "schedule", "offload.weights",
                              "offload.buffer_budget_bytes"}
    assert not GreedySnakeConfig(alpha=0.0, lag=0, recompute=True, layers_per_unit=1, schedule="vertical",
                                 offload={**{k: "host" for k in ("weights", "master_weights", "optimizer_states",
                                                                 "gradients", "activations")},
                                          "buffer_budget_bytes": 1 << 20}).unset()


def test_the_run_configuration_is_its_own_type_with_every_value_in_effect():
    """The user's settings may leave values to the planner; what a run uses is a :class:`RunConfig`, which
    only ``resolved()`` (and a replace of one) builds, checked complete; the engine takes no other."""
    import dataclasses

    import torch

    from lightning_greedysnake.config import RunConfig
    from lightning_greedysnake.engine import WindowEngine
    from lightning_greedysnake.models import GPT, make_units
    from lightning_greedysnake.offload import InMemoryTensorStore

    settings = GreedySnakeConfig(alpha=0.5)
    run = settings.resolved()
    assert type(settings) is GreedySnakeConfig and type(run) is RunConfig and run.resolved() is run
    assert type(dataclasses.replace(run, lag=0)) is RunConfig and run.alpha == 0.5
    for unset in ({"alpha": None}, {"offload": dataclasses.replace(run.offload, weights=None)}):
        with pytest.raises(ValueError, match="every value in effect"):
            dataclasses.replace(run, **unset)
    with pytest.raises(ValueError, match=r"'alpha'.*GreedySnakeConfig\.resolved"):
        RunConfig()
    chain = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=1, n_embd=8)).layer_chain()
    with pytest.raises(TypeError, match="run's configuration"):
        WindowEngine(chain, make_units(chain, 1), settings, InMemoryTensorStore(), torch.device("cpu"))


def test_strings_become_enums():
    assert GreedySnakeConfig(schedule="horizontal").schedule is ScheduleKind.HORIZONTAL


@pytest.mark.parametrize(
    "settings,words",
    [
        ({"schedule": "diagonal"}, ["schedule='diagonal'", "'vertical'", "'horizontal'", "unset", "null"]),
        ({"layers_per_unit": 0}, ["layers_per_unit=0", "Fix"]),
        ({"layers_per_unit": 1.5}, ["layers_per_unit=1.5"]),
        ({"layers_per_unit": True}, ["layers_per_unit=True"]),
        ({"recompute": "yes"}, ["recompute='yes'"]),
        ({"layered_module": 3}, ["layered_module=3"]),
    ],
)
def test_bad_values_name_setting_value_and_fix(settings, words):
    with pytest.raises(ValueError) as info:
        GreedySnakeStrategy(**settings)
    for word in words:
        assert word in str(info.value)


def test_unknown_setting_lists_known_ones():
    with pytest.raises(ValueError, match="layers_per_unit"):
        GreedySnakeStrategy(layers_per_units=2)


def test_mapping_config_and_overrides():
    strategy = GreedySnakeStrategy({"schedule": "horizontal", "layers_per_unit": 3}, layers_per_unit=2)
    assert strategy.config.schedule is ScheduleKind.HORIZONTAL and strategy.config.layers_per_unit == 2


@pytest.mark.parametrize(
    "kwargs,word",
    [({"n_embd": 10, "n_head": 3}, "divisible"), ({"n_layer": 0}, "n_layer"), ({"dropout": 1.0}, "dropout")],
)
def test_gpt_config_errors(kwargs, word):
    with pytest.raises(ValueError, match=word):
        GPTConfig(**kwargs)


@pytest.mark.parametrize("bias", [True, False])
def test_gpt_num_params_matches_the_model(bias):
    from lightning_greedysnake import GPT

    config = GPTConfig(n_layer=3, n_head=2, n_embd=16, vocab_size=40, block_size=12, bias=bias)
    assert config.num_params == sum(p.numel() for p in GPT(config).parameters())


# -- offload settings ---------------------------------------------------------------------------------
from lightning_greedysnake import OffloadConfig, TensorKind  # noqa: E402


def test_default_placement_is_zero_infinity_s():
    o = GreedySnakeConfig().offload
    assert [o.tier(k) for k in TensorKind] == [Tier.SSD, Tier.SSD, Tier.SSD, Tier.SSD, Tier.HOST]
    assert o.path is None and o.uses_ssd and o.uses_tensor_manager


def test_offload_dir_shorthand_and_partial_mapping(tmp_path):
    strategy = GreedySnakeStrategy(offload_dir=tmp_path, offload={"activations": "ssd"})
    assert strategy.config.offload.path == str(tmp_path)
    assert strategy.config.offload.activations is Tier.SSD and strategy.config.offload.weights is Tier.SSD


def test_offload_dir_takes_one_directory_per_ssd_as_offload_path_does(tmp_path):
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    assert GreedySnakeStrategy(offload_dir=dirs).config.offload.path == [str(d) for d in dirs]
    assert GreedySnakeStrategy(offload_dir=dirs).config == GreedySnakeStrategy(offload={"path": dirs}).config


def test_everything_on_the_device_needs_no_tensor_manager():
    assert not OffloadConfig.everywhere("device").uses_tensor_manager
    assert not OffloadConfig.everywhere("host").uses_ssd


@pytest.mark.parametrize(
    "settings,words",
    [
        ({"weights": "nvme"}, ["offload.weights='nvme'", "'ssd'"]),
        ({"optimizer_states": "device"}, ["offload.optimizer_states='device'", "Fix"]),
        ({"buffer_budget_bytes": -1}, ["offload.buffer_budget_bytes=-1", "Fix"]),
        ({"io_threads": 0}, ["offload.io_threads=0", "Fix"]),
        ({"optimizer_threads": 0}, ["offload.optimizer_threads=0", "Fix"]),
        ({"optimizer_threads": 2.5}, ["offload.optimizer_threads=2.5", "Fix"]),
        ({"prefetch_units": -1}, ["offload.prefetch_units=-1", "Fix"]),
        ({"optimizer_states": {"host": 0.5}}, ["offload.optimizer_states", "sum to 0.5", "Fix"]),
        ({"optimizer_states": {"device": 0.5, "ssd": 0.5}}, ["offload.optimizer_states", "only weights", "Fix"]),
        ({"weights": {"gpu": 0.5, "ssd": 0.5}}, ["offload.weights", "'device', 'host' and 'ssd'", "Fix"]),
        ({"activations": {"host": 0.5, "ssd": 0.5}}, ["offload.activations", "can be split", "Fix"]),
        ({"gradients": {"host": -0.5, "ssd": 1.5}}, ["offload.gradients", "[0, 1]", "Fix"]),
        ({"io_chunk_bytes": 1000}, ["offload.io_chunk_bytes=1000", "4096"]),
        ({"keep_files": "no"}, ["offload.keep_files='no'"]),
        ({"path": ""}, ["offload.path=''"]),
        ({"size": 3}, ["unknown offload setting", "buffer_budget_bytes"]),
    ],
)
def test_bad_offload_values_name_setting_value_and_fix(settings, words):
    with pytest.raises(ValueError) as info:
        GreedySnakeStrategy(offload=settings)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("preset", ["greedysnake", "greedysnake_cpu", "greedysnake_horizontal"])
def test_hydra_presets_compose_into_the_strategy(preset):
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(version_base="1.3", config_dir=str(conf)):
        cfg = compose("config", overrides=[f"strategy={preset}", "strategy.offload.io_threads=2"])
    strategy = instantiate(cfg.strategy)
    assert strategy.config.offload.io_threads == 2
    expected = Tier.HOST if preset == "greedysnake_cpu" else Tier.SSD
    assert strategy.config.offload.weights is expected
    assert strategy.config.schedule.value == ("horizontal" if preset.endswith("horizontal") else "vertical")


def test_bf16_on_a_cpu_without_native_bf16_is_named_with_the_measured_factor_and_the_fix():
    from lightning_greedysnake.precision import cpu_bf16_slowdown, slow_bf16_warning

    assert cpu_bf16_slowdown(64, repeats=1) > 0
    assert slow_bf16_warning(0.5) is None  # native bf16 (AVX-512 BF16 / AMX)
    message = slow_bf16_warning(96.0)
    assert message is not None and "96x slower than fp32" in message and "precision='32-true'" in message


def test_bf16_warning_reaches_the_user_at_setup(monkeypatch):
    import lightning as L

    from lightning_greedysnake.strategy import checks
    from tests.helpers import TinyGPTModule, make_trainer, token_loader

    monkeypatch.setattr(checks, "cpu_bf16_slowdown", lambda: 100.0)  # as measured on an AVX2-only EPYC
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(GreedySnakeStrategy(), 1, max_steps=1, precision="bf16-mixed")
    with pytest.warns(UserWarning, match=r"100x slower than fp32.*Fix: Trainer\(precision='32-true'\)"):
        trainer.fit(TinyGPTModule(), token_loader(2))


@pytest.mark.parametrize("kwargs, error", [
    ({"offload_dir": "/a", "offload": {"path": "/b"}}, r"offload_dir='/a' and offload.path='/b' both.*Fix"),
    ({"offload_dir": 3.5}, r"offload_dir=3.5 is not a directory path or a list of them.*Fix"),
    ({"offload_dir": ["/a", 3]}, r"offload_dir=\['/a', 3\] is not a directory path.*Fix"),
    ({"offload_dir": ["/a", "/a"]}, r"offload.path=.*must name one directory or several different ones.*Fix"),
    ({"offload": {"path": 3.5}}, r"offload.path=3.5 must be a directory path.*Fix"),
])
def test_conflicting_or_mistyped_offload_directories_are_refused(kwargs, error):
    with pytest.raises(ValueError, match=error):
        GreedySnakeStrategy(**kwargs)


def test_the_gpu_trainer_group_composes_into_trainer_arguments_for_one_gpu():
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(version_base="1.3", config_dir=str(conf)):
        cfg = compose("config", overrides=["trainer=gpu", "strategy.offload.prefetch_units=2"])
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.precision) == ("gpu", 1, "bf16-mixed")
    assert cfg.strategy.offload.prefetch_units == 2


def test_a_split_placement_composes_from_the_command_line():
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lightning_greedysnake.config import Split

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(version_base="1.3", config_dir=str(conf)):
        cfg = compose("config", overrides=["strategy.offload.optimizer_states={host: 0.6, ssd: 0.4}"])
    strategy = instantiate(cfg.strategy)
    assert strategy.config.offload.optimizer_states == Split(0.6, 0.4)
    assert strategy.config.offload.weights is Tier.SSD


def test_the_old_name_of_the_saved_activations_placement_is_refused_naming_the_new_one():
    """``offload.checkpoints`` is now ``offload.activations`` ("checkpoint" names training checkpoints only):
    the old key is refused with the new one in the error, as a Python mapping and as a Hydra key."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    with pytest.raises(ValueError, match=r"offload.checkpoints='ssd'.*offload.activations.*Fix: offload.activations='ssd'"):
        GreedySnakeStrategy(offload={"checkpoints": "ssd"})
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(version_base="1.3", config_dir=str(conf)):
        cfg = compose("config", overrides=["+strategy.offload.checkpoints=host"])
    with pytest.raises(InstantiationException, match=r"offload.checkpoints='host'.*Fix: offload.activations='host'"):
        instantiate(cfg.strategy)
    with initialize_config_dir(version_base="1.3", config_dir=str(conf)):
        cfg = compose("config", overrides=["strategy.offload.activations=host"])
    assert instantiate(cfg.strategy).config.offload.activations is Tier.HOST
