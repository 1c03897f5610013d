"""Shared fixtures: a tiny model saved in HF format, small datasets, isolated MLflow/Prefect state."""

from __future__ import annotations

import os

os.environ.setdefault("PYTHONWARNINGS", "ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from components.models import build_char_tokenizer, build_tiny_model, save_pretrained  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


def make_model(tokenizer, seed: int = 0, hidden: int = 32):
    return build_tiny_model(
        tokenizer,
        hidden_size=hidden,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        max_positions=64,
        seed=seed,
    )


def arith_rows(count: int) -> list[dict]:
    """`count` prompts a+a= (a = 0, 1, ...) as rows of the cleaned dataset."""
    return [
        {
            "prompt": f"{a}+{a}=",
            "reward_model": {"ground_truth": str(2 * a)},
            "data_source": "arith",
            "extra_info": {},
        }
        for a in range(count)
    ]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("tiny_model")
    save_pretrained(make_model(tokenizer), tokenizer, out)
    return out


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from components.training.ray_workers import ensure_ray

    ensure_ray()
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)
