"""The training tests' Ray: local, started once for the module that needs it."""

import pytest

from components.training.ray_workers import ensure_ray


@pytest.fixture(scope="module")
def ray_up():
    ensure_ray()
    yield
