"""The config's tables of names (components/config/names.py) equal the registries they stand for."""

from components.config import names
from components.rewards.registry import SCORERS
from components.rollout.tools import TOOLS


def test_scorer_names_are_the_registered_scorers():
    assert tuple(sorted(SCORERS)) == names.SCORER_NAMES


def test_tool_names_are_the_registered_tools():
    assert tuple(sorted(TOOLS.names())) == names.TOOL_NAMES
    from components.envs.base import ENVS

    assert tuple(sorted(ENVS)) == names.ENV_NAMES


def test_every_engine_with_a_package_is_an_engine_type():
    from typing import get_args

    from components.config.schema import EngineConfig

    types = set(get_args(EngineConfig.model_fields["type"].annotation))
    assert set(names.ENGINE_PACKAGES) | {"hf"} == types
    assert set(names.ADAPTER_ENGINES) <= types and set(names.INTERRUPTIBLE_ENGINES) <= types


def test_the_backends_are_the_registered_ones_and_ray_s_reach_ray_actors():
    from typing import get_args

    from components.config.schema import TrainerConfig
    from components.training.backends import BACKENDS
    from components.training.transport import RAY

    assert set(get_args(TrainerConfig.model_fields["backend"].annotation)) == set(BACKENDS.names())
    assert {n for n in BACKENDS.names() if BACKENDS.info(n)["transport"] is RAY} == set(names.RAY_BACKENDS)
