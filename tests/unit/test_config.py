import pytest

from lightning_greedysnake import GreedySnakeConfig, GreedySnakeStrategy, GPTConfig, ScheduleKind


def test_defaults():
    config = GreedySnakeConfig()
    assert config.schedule is ScheduleKind.VERTICAL
    assert config.layers_per_unit == 1 and config.recompute


def test_strings_become_enums():
    assert GreedySnakeConfig(schedule="horizontal").schedule is ScheduleKind.HORIZONTAL


@pytest.mark.parametrize(
    "settings,words",
    [
        ({"schedule": "diagonal"}, ["schedule='diagonal'", "'vertical'", "'horizontal'"]),
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
